"""Choosing k each step from the acceptance observed so far, so speculation pays for itself or switches off.

Each row keeps an estimate `a` of the chance that its next draft token is accepted (a smoothed count of accepted
over tried tokens). With k drafts a row then emits `1 + a + a^2 + ... + a^k` tokens on average, while the verify
forward costs `1 + cost_per_token * k` single-token steps (plus what drafting costs). The step takes the k in
`[0, max_k]` that maximises the batch's expected tokens per unit of cost; k = 0 is plain decoding. A row that stops
drafting drifts back towards the prior, so speculation is tried again later instead of being switched off for good.
"""

from __future__ import annotations

import torch

# Marginal cost of one more token in a verify forward, relative to a single-token decode step. Measured on a 2-core
# CPU with SmolLM2-135M (5 tokens cost 1.6 steps, 11 tokens 2.4): see docs/benchmarks.md. Accelerators verify a few
# extra tokens almost for free at small batch sizes.
DEFAULT_COST_PER_TOKEN = {"cpu": 0.15, "cuda": 0.03}


class AdaptiveK:
    """Per-row acceptance estimates and the k they imply, for one `generate` call's rows `0 .. num_rows - 1`.

    Args:
        num_rows (`int`): rows in the batch.
        max_k (`int`): the largest k (`num_speculative_tokens`).
        cost_per_token (`float`): verify cost of one more token, relative to a one-token step.
        draft_cost_per_token (`float`): the speculator's cost of drafting one token, in the same unit.
        prior (`float`): acceptance assumed before a row has drafted.
        smoothing (`float`): weight of the newest step in the running estimate.
    """

    def __init__(self, num_rows: int, max_k: int, cost_per_token: float, draft_cost_per_token: float = 0.0,
                 prior: float = 0.6, smoothing: float = 0.3):
        self.max_k = max_k
        self.cost_per_token = cost_per_token
        # Drafting one token, relative to a one-token target step. A static estimate, not a timing, so that seeded
        # runs choose the same k and stay reproducible.
        self.draft_cost_per_token = draft_cost_per_token
        self.prior = prior
        self.smoothing = smoothing
        self.acceptance = torch.full((num_rows,), prior, dtype=torch.float64)  # host tensor: no device syncs

    def choose(self, rows: list[int]) -> int:
        """The k for this step's rows."""
        if self.max_k == 0 or not rows:
            return 0
        rates = self.acceptance[rows]
        ks = torch.arange(self.max_k + 1, dtype=torch.float64)
        # Expected emitted tokens summed over rows for each k: sum over j = 0..k of rate^j.
        expected = torch.cumsum(rates[:, None] ** ks[None, :], dim=1).sum(0)  # [max_k + 1]
        cost = 1.0 + (self.cost_per_token + self.draft_cost_per_token) * ks
        return int(torch.argmax(expected / cost))

    def update(self, rows: list[int], num_drafted: list[int], num_accepted: list[int]) -> None:
        """Folds one step's outcome into each row's estimate."""
        drafted = torch.tensor(num_drafted, dtype=torch.float64)
        accepted = torch.tensor(num_accepted, dtype=torch.float64)
        rates = self.acceptance[rows]
        # Tokens tried: every accepted one, plus the rejected one when a row stopped before its last draft.
        tried = accepted + (accepted < drafted).double()
        observed = accepted / tried.clamp(min=1)
        updated = (1 - self.smoothing) * rates + self.smoothing * observed
        # A row that did not draft gives no evidence: it drifts back to the prior, so it is tried again later.
        idle = rates + 0.1 * (self.prior - rates)
        self.acceptance[rows] = torch.where(drafted > 0, updated, idle)
