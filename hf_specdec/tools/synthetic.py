"""Benchmarks only: a speculator whose drafts are accepted at a set rate, to measure the engine apart from draft
quality.

`SyntheticSpeculator` drafts the target's own recorded greedy continuation, each draft token replaced by another at
a set rate, so a verify accepts drafts up to the first replaced one: the mean acceptance length is set by the rate
and k alone (`acceptance_for_length`). It is never reachable from `generate(speculator="...")` by a name: a benchmark
builds it from a recorded reference, and on any other input its drafts are simply rejected (the output stays the
target's, as with every speculator).
"""

from __future__ import annotations

import torch

from ..decode.speculator import Speculator
from ..types import PAD_ID, DraftProposal, SequenceBatch


def acceptance_for_length(mean_length: float, k: int) -> float:
    """The per-token acceptance a at which a chain of k drafts gives `mean_length` tokens per verify on average
    (`1 + a + a^2 + ... + a^k`), found by bisection; `mean_length` must lie in `[1, k + 1)`."""
    if not 1.0 <= mean_length < k + 1:
        raise ValueError(f"a mean acceptance length must lie in [1, k + 1) = [1, {k + 1}), got {mean_length}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if sum(mid ** j for j in range(k + 1)) < mean_length:
            low = mid
        else:
            high = mid
    return (low + high) / 2


class SyntheticSpeculator(Speculator):
    """Drafts from `reference`, the target's greedy output for the same inputs (`generate(..., do_sample=False)`'s
    sequences: prompts as passed, then the continuation), each draft token kept with probability `acceptance` and
    otherwise replaced by a different token. Drafting costs nothing (no model runs).

    Args:
        reference (`torch.Tensor`): `[batch, prompt_width + new_tokens]` the recorded greedy sequences.
        acceptance (`float`): the chance each draft token is the reference's (`acceptance_for_length` turns a mean
            acceptance length into it).
        vocab_size (`int`): the target's vocabulary, for the replacement tokens.
        seed (`int`): the replacement draws' seed (drafts repeat run to run).
    """

    drafts_are_free = True

    def __init__(self, reference: torch.Tensor, acceptance: float, vocab_size: int, seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must lie in [0, 1], got {acceptance}")
        self.reference = reference
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.seed = seed
        self.confidence_priors = (acceptance,)
        self._generator = None

    def __repr__(self) -> str:
        return f"SyntheticSpeculator(acceptance={self.acceptance:.3f})"

    def begin(self, target, batch: SequenceBatch) -> None:
        if self.reference.shape[0] != batch.token_ids.shape[0]:
            raise ValueError(f"the reference holds {self.reference.shape[0]} rows, the call "
                             f"{batch.token_ids.shape[0]}: record it with the same inputs")
        self.reference = self.reference.to(batch.device)
        self._generator = torch.Generator(device=batch.device).manual_seed(self.seed)

    def propose(self, batch: SequenceBatch, k: int) -> DraftProposal:
        rows = batch.active_tensor()
        if k == 0:
            return DraftProposal.empty(len(batch.active), batch.device)
        width = self.reference.shape[1]
        columns = batch.end_cols(batch.active)[:, None] + torch.arange(k, device=batch.device)[None, :]
        inside = columns < width
        drafts = self.reference[rows[:, None], columns.clamp(max=width - 1)]
        draws = torch.rand(drafts.shape, generator=self._generator, device=batch.device)
        shift = torch.randint(1, self.vocab_size, drafts.shape, generator=self._generator, device=batch.device)
        drafts = torch.where(draws < self.acceptance, drafts, (drafts + shift) % self.vocab_size)
        num_tokens = inside.sum(-1)
        return DraftProposal(torch.where(inside, drafts, PAD_ID), num_tokens)

    def end(self) -> None:
        self._generator = None
