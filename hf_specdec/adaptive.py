"""Choosing k each step from the acceptance observed so far, so speculation pays for itself or switches off.

Each row keeps an estimate `a` of the chance that its next draft token is accepted (a smoothed count of accepted
over tried tokens). With k drafts a row then emits `1 + a + a^2 + ... + a^k` tokens on average. A forward costs a
fixed part plus a part per token it processes (`token_cost_ratio` = per-token / fixed); at batch size B, verifying k
drafts per row costs `1 + beta * k` plain steps with `beta = B r / (1 + B r)`, plus what drafting costs. So the larger
the batch, the dearer each draft (the well-known loss of speculation at high batch sizes), and k shrinks with it. The step takes the k in
`[0, max_k]` that maximises the batch's expected tokens per unit of cost; k = 0 is plain decoding. A row that stops
drafting drifts back towards the prior, so speculation is tried again later instead of being switched off for good.
"""

from __future__ import annotations

import torch

# Cost of one more token in a forward, relative to the forward's fixed cost. Measured on a 2-core CPU with
# SmolLM2-135M at 240 tokens of context: 41 ms fixed + 7.3 ms per token (docs/benchmarks.md). Accelerators process
# many tokens per forward almost for free: a small ratio.
DEFAULT_TOKEN_COST_RATIO = {"cpu": 0.18, "cuda": 0.005}


class AdaptiveK:
    """Per-row acceptance estimates and the k they imply, for one `generate` call's rows `0 .. num_rows - 1`.

    Args:
        num_rows (`int`): rows in the batch.
        max_k (`int`): the largest k (`num_speculative_tokens`).
        token_cost_ratio (`float`): a forward's cost per token relative to its fixed cost.
        draft_cost_per_token (`float`): the speculator's cost of drafting one token, in the same unit.
        prior (`float`): acceptance assumed before a row has drafted.
        smoothing (`float`): weight of the newest step in the running estimate.
    """

    def __init__(self, num_rows: int, max_k: int, token_cost_ratio: float, draft_cost_per_token: float = 0.0,
                 prior: float = 0.6, smoothing: float = 0.3):
        self.max_k = max_k
        self.token_cost_ratio = token_cost_ratio
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
        cost = 1.0 + (self.verify_cost_per_token(len(rows)) + self.draft_cost_per_token) * ks
        return int(torch.argmax(expected / cost))

    def verify_cost_per_token(self, batch_size: int) -> float:
        """Cost of verifying one more draft per row, relative to a plain decode step of the batch."""
        per_batch = batch_size * self.token_cost_ratio
        return per_batch / (1.0 + per_batch)

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
