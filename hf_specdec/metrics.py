"""Acceptance and timing metrics of one speculative `generate` call."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("hf_specdec")


@dataclass
class SpeculativeMetrics:
    """Counts over one call.

    Attributes:
        num_drafts: (row, step) pairs in which the speculator proposed at least one token.
        num_draft_tokens: draft tokens proposed (with draft trees: tree nodes, so `acceptance_rate` is per node and
            `mean_acceptance_length` is the figure to compare with chains).
        num_accepted_tokens: draft tokens the verifier accepted.
        accepted_per_position: `[i]` = drafts with at least `i + 1` accepted tokens (with trees: reaching depth
            `i + 1`).
        num_steps: verify steps (target forwards) of the decode loop.
        num_row_steps: (row, step) pairs: the rows each step fed, summed (`num_steps` at batch 1; fewer than
            `num_steps` x rows where rows finish before the longest one).
        num_emitted_tokens: tokens added to the outputs.
        num_grammar_draft_tokens / num_grammar_tokens: tokens a grammar (or `prefix_allowed_tokens_fn`) drafted
            itself, where it allows only one token or its next text is fixed (a schema's next key), and how many of
            them the target accepted. Not counted in the draft and acceptance figures, which are the speculator's.
        draft_time_s / verify_time_s / total_time_s: wall time in proposing, verifying (target forward, logits
            processing, acceptance) and the whole call.
        drafting_time_s: the part of `draft_time_s` spent in steps that verified drafts; the rest went to steps that
            drafted nothing (a lookup that found no match, adaptive k keeping drafting off). What a drafted token
            costs is this over `num_draft_tokens`; what proposing costs a step, `draft_time_s` over `num_steps`.
        measure_time_s: wall time the call spent measuring this host's costs before its first step (the first call
            on a new host, model, dtype and thread count; 0 after that), included in `total_time_s`.
        k_per_step: the k chosen at each step (adaptive k's choice, 0 where it kept drafting off; with
            `speculative_schedule="constant"`, `num_speculative_tokens`). Rows may draft fewer when they have fewer.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_steps: int = 0
    num_row_steps: int = 0
    num_emitted_tokens: int = 0
    num_grammar_draft_tokens: int = 0
    num_grammar_tokens: int = 0
    draft_time_s: float = 0.0
    drafting_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0
    measure_time_s: float = 0.0
    k_per_step: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per verify of a row that drafted, counting the recovered or bonus token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [n / self.num_drafts for n in self.accepted_per_position] if self.num_drafts else []

    def record_step(self, num_draft_tokens: list[int], num_accepted: list[int]) -> None:
        self.num_steps += 1
        self.num_row_steps += len(num_draft_tokens)
        self.num_drafts += sum(1 for n in num_draft_tokens if n > 0)
        self.num_draft_tokens += sum(num_draft_tokens)
        self.num_accepted_tokens += sum(num_accepted)
        longest = max(num_accepted, default=0)
        if longest > len(self.accepted_per_position):
            self.accepted_per_position += [0] * (longest - len(self.accepted_per_position))
        for n in num_accepted:
            for i in range(n):
                self.accepted_per_position[i] += 1

    def record_proposing(self, seconds: float, num_draft_tokens: list[int]) -> None:
        """A step's proposing time, counted in `drafting_time_s` too where the step verified drafts."""
        self.draft_time_s += seconds
        if any(num_draft_tokens):
            self.drafting_time_s += seconds

    def summary(self) -> str:
        per_pos = ", ".join(f"{r:.3f}" for r in self.acceptance_rate_per_position)
        return (
            f"Speculative decoding: acceptance rate {self.acceptance_rate:.3f}, mean acceptance length "
            f"{self.mean_acceptance_length:.2f}, drafts {self.num_drafts}, draft tokens {self.num_draft_tokens}, "
            f"accepted {self.num_accepted_tokens}, per-position acceptance [{per_pos}], target forwards "
            f"{self.num_steps}, emitted tokens {self.num_emitted_tokens}"
            + (f", grammar drafts {self.num_grammar_draft_tokens} (accepted {self.num_grammar_tokens})"
               if self.num_grammar_draft_tokens else "")
            + f", draft {self.draft_time_s:.3f}s, "
            f"verify {self.verify_time_s:.3f}s, total {self.total_time_s:.3f}s"
        )

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "accepted_per_position": list(self.accepted_per_position), "num_steps": self.num_steps,
            "num_row_steps": self.num_row_steps,
            "num_emitted_tokens": self.num_emitted_tokens, "num_grammar_draft_tokens": self.num_grammar_draft_tokens,
            "num_grammar_tokens": self.num_grammar_tokens,
            "draft_time_s": self.draft_time_s, "drafting_time_s": self.drafting_time_s,
            "verify_time_s": self.verify_time_s, "total_time_s": self.total_time_s,
            "measure_time_s": self.measure_time_s,
            "k_per_step": list(self.k_per_step),
        }
