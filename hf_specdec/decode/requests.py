"""What a request asks for: its prompt and how many tokens to generate (`Request`), how it picks them
(`SamplingParams`), and what it has got so far, which the scheduler fills in (`scheduler.Scheduler`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

# Bounds of `SamplingParams.repetition_penalty`: logits divided or multiplied by it stay finite in float32.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


@dataclass
class SamplingParams:
    """How one request picks its tokens. `temperature=0` is greedy decoding (the target's argmax).

    Penalties and biases change the target's logits before temperature, top-k and top-p, at every position a step
    verifies, with that position's own history (the drafts before it included), so speculation keeps the
    distribution they define exact. As OpenAI's and vLLM's: `logit_bias` adds to the named tokens' logits (token id ->
    bias, -100 to 100); `repetition_penalty` (transformers' and vLLM's, 1 is off) divides the positive logits (and
    multiplies the negative ones) of every token in the prompt or the output; `frequency_penalty` subtracts that much
    per earlier occurrence in the output and `presence_penalty` that much once for any (both -2 to 2).
    `min_tokens` (vLLM's) keeps the end-of-sequence tokens out until that many tokens were generated; `ignore_eos`
    (vLLM's) goes on past them to `max_new_tokens`, as a benchmark's fixed-length requests do.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be from -2 to 2, got {getattr(self, name)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be from {MIN_REPETITION_PENALTY} to {MAX_REPETITION_PENALTY} "
                             f"(1: off), got {self.repetition_penalty}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.logit_bias and not all(isinstance(t, int) and t >= 0 and -100 <= b <= 100
                                       for t, b in self.logit_bias.items()):
            raise ValueError("logit_bias maps token ids (non-negative integers) to biases from -100 to 100")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether penalties or biases change the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens)


@dataclass(eq=False)
class Request:
    """One prompt to continue.

    Attributes:
        prompt_ids: the prompt's token ids (`None` when the caller already wrote it into the batch).
        max_new_tokens: the most tokens to generate.
        sampling: greedy by default.
        grammar: an xgrammar `CompiledGrammar` constraining the output, or `None`.
        output_ids: generated tokens so far (filled in when the scheduler reports tokens).
        logprobs: `None`, or how many of the likeliest alternatives to report with each generated token's log
            probability (0: the token's own only). The target's log-softmax before any processing (temperature,
            top-k/top-p, grammars), at the position that produced the token, whichever step verified it.
        output_logprobs: with `logprobs`, one `(log probability, [(token id, log probability), ...])` per token of
            `output_ids`, the alternatives likeliest first.
        prompt_logprobs: `None`, or how many alternatives to list with the log probability of each prompt token after
            the first, given the tokens before it (vLLM's `prompt_logprobs`; the completions API's `echo` with
            `logprobs`). Such a prompt is fed in pieces of its own whose every position gives logits, never from
            the prefix cache; with `max_new_tokens=0` the request ends once its prompt is scored.
        prompt_token_logprobs: with `prompt_logprobs`, one `(log probability, alternatives)` per prompt token after
            the first, as `output_logprobs`.
        num_generated: how many tokens were generated.
        finish_reason: `"stop"` (EOS or a stop rule), `"length"` (max_new_tokens), `"cancelled"`, or `"error"`
            (refused as it joined the batch, or its grammar allowed no token: `error` says why); `None` while running.
        error_field: what the error is about, where it is a part of the request (`"grammar"`); else `None`.
    """

    prompt_ids: list[int] | None
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    grammar: object = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    output_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    output_logprobs: list = field(default_factory=list)
    prompt_logprobs: int | None = None
    prompt_token_logprobs: list = field(default_factory=list)
    num_generated: int = 0
    finish_reason: str | None = None
    slot: int | None = None
    cancelled: bool = False
    error: str | None = None
    error_field: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
