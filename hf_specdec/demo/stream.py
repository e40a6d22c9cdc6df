"""What a streamed run looks like: per-step tokens with who produced them, and the results the app renders.

A transformers streamer gets `put(tokens)` once per step: for plain `generate` one token, for speculative
generation that step's output (its accepted drafts, then one token the target produced itself), after a first
`put` of the prompt. `StepStreamer` queues those steps with their arrival time; a `Pane` turns them into text pieces.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from ..metrics import SpeculativeMetrics

NGRAM_LABEL = "n-gram (prompt lookup)"


@dataclass(frozen=True)
class Settings:
    """One request's generation settings, already checked (see `DemoSession.check_settings`)."""

    speculator: str = NGRAM_LABEL
    k: int = 5
    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    schedule: str = "adaptive"
    grammar: object = None  # JSON mode: an hf_specdec.Grammar both runs follow
    tokenizer: object = None  # the target's, which compiles the grammar

    def generate_kwargs(self) -> dict:
        constraint = dict(grammar=self.grammar, tokenizer=self.tokenizer) if self.grammar is not None else {}
        if not self.do_sample:
            return dict(max_new_tokens=self.max_new_tokens, do_sample=False, **constraint)
        return dict(max_new_tokens=self.max_new_tokens, do_sample=True, temperature=self.temperature,
                    top_p=self.top_p, top_k=0, **constraint)


@dataclass
class Piece:
    """Decoded text of one generated token and who produced it: `"accepted"` (a draft) or `"target"`."""

    text: str
    kind: str
    step: int


@dataclass
class Pane:
    """One run as it streams: its tokens grouped by step, their text pieces, and its timing."""

    speculative: bool
    token_ids: list[int] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    step_sizes: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0
    done: bool = False
    _text: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def num_accepted(self) -> int:
        return sum(p.kind == "accepted" for p in self.pieces)

    def add_step(self, token_ids: list[int], tokenizer) -> None:
        """Appends one streamed step: for a speculative run all but its last token are accepted drafts."""
        step = len(self.step_sizes)
        self.step_sizes.append(len(token_ids))
        for i, token_id in enumerate(token_ids):
            self.token_ids.append(token_id)
            text = tokenizer.decode(self.token_ids, skip_special_tokens=True)
            piece = ""
            # A token that ends inside a multi-byte character decodes to U+FFFD; its text arrives with the next one.
            if not text.endswith("\ufffd") and text.startswith(self._text):
                piece, self._text = text[len(self._text):], text
            kind = "accepted" if self.speculative and i < len(token_ids) - 1 else "target"
            self.pieces.append(Piece(piece, kind, step))

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)


@dataclass
class Comparison:
    """A snapshot of a comparison: both panes, and once the speculative run ends its metrics."""

    plain: Pane
    speculative: Pane
    settings: Settings
    metrics: SpeculativeMetrics | None = None

    @property
    def done(self) -> bool:
        return self.plain.done and self.speculative.done

    @property
    def speedup(self) -> float:
        return self.speculative.tokens_per_s / self.plain.tokens_per_s if self.plain.tokens_per_s else 0.0

    @property
    def identical(self) -> bool:
        return self.plain.token_ids == self.speculative.token_ids


@dataclass
class BatchResult:
    """Both runs of a batch: outputs per prompt, wall times and the speculative run's metrics."""

    prompts: list[str]
    outputs: list[str]
    num_new_tokens: list[int]
    plain_time_s: float
    speculative_time_s: float
    identical: bool
    metrics: SpeculativeMetrics
    settings: Settings

    @property
    def plain_tokens_per_s(self) -> float:
        return sum(self.num_new_tokens) / self.plain_time_s

    @property
    def speculative_tokens_per_s(self) -> float:
        return sum(self.num_new_tokens) / self.speculative_time_s


class RunCancelled(Exception):
    """Raised inside `generate` (from the streamer) to end a run nobody is watching any more."""


class StepStreamer:
    """A transformers streamer that queues each `put` (after the prompt) with the time it arrived.

    `cancel()` makes the next `put` raise `RunCancelled`, which ends the `generate` call at its next step at no cost
    to the steps before (a stopping criterion would be called after every token).
    """

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self._prompt_seen = False
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        self._cancelled.set()

    def put(self, value: torch.Tensor) -> None:
        if self._cancelled.is_set():
            raise RunCancelled("the demo's page stopped listening")
        if not self._prompt_seen:  # generate puts the prompt first
            self._prompt_seen = True
            return
        self.queue.put((time.perf_counter(), value.reshape(-1).tolist()))

    def end(self) -> None:
        self.queue.put(None)
