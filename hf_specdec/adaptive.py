"""Choosing k each step from the acceptance observed so far, so speculation pays for itself or switches off.

Acceptance. Each proposal falls in one of its speculator's confidence classes (n-gram lookup: the length of the
matched context; a model speculator: a single class). Per class the call keeps counts of drafts accepted and tried,
pooled over its rows, and each row keeps its own. A row's chance `p` that its next draft is accepted is its own count
shrunk towards the pooled one, which is shrunk towards the speculator's prior for the class. Counts decay each step,
so estimates follow a row that moves between copying and free writing, and a row that stopped drafting drifts back
towards the prior and is tried again later. With k drafts a row emits `1 + p + ... + p^k` tokens on average (fewer
when it has fewer drafts to offer).

Cost. A target forward of B rows of q tokens costs `fixed + per_row * B + per_token * (B q) ** exponent` (`StepCost`),
so verifying k drafts costs `cost(B, k + 1) / cost(B, 1)` plain steps, plus what drafting costs. On a CPU the
per-token part is large and concave (matrix products grow more efficient with more rows), on a GPU it is nearly
free. The step takes the k in `[0, max_k]` that maximises the batch's expected tokens per unit of cost; k = 0 is
plain decoding. Everything here is a static estimate on host tensors, never a timing, so seeded runs choose the same k
and stay reproducible, and no step waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepCost:
    """Wall time of one target forward of `rows` rows of `tokens` tokens each, in arbitrary units:
    `fixed + per_row * rows + per_token * (rows * tokens) ** exponent`."""

    fixed: float
    per_row: float
    per_token: float
    exponent: float = 1.0

    def __call__(self, rows: int, tokens: torch.Tensor) -> torch.Tensor:
        return self.fixed + self.per_row * rows + self.per_token * (rows * tokens.double()) ** self.exponent

    def relative(self, rows: int, tokens: torch.Tensor) -> torch.Tensor:
        """Cost of forwards of `tokens` per row relative to a plain decode step (1 token per row)."""
        return self(rows, tokens) / self(rows, torch.ones((), dtype=torch.float64))


# Fitted (to within 17%) to 18 forwards of SmolLM2-135M at 240 tokens of context on a 2-core CPU, batch 1/4/16 and
# 1-16 tokens per row (docs/benchmarks.md): weights stream once per forward, each row adds attention and bookkeeping,
# and tokens are cheaper the more there are. On accelerators a forward of a few hundred tokens costs about as much as
# one of a single token.
DEFAULT_STEP_COST = {"cpu": StepCost(fixed=13.5, per_row=2.95, per_token=21.8, exponent=0.42),
                     "cuda": StepCost(fixed=1.0, per_row=0.0, per_token=0.005)}


class AdaptiveK:
    """Acceptance estimates and the k they imply, for one `generate` call's rows `0 .. num_rows - 1`.

    Args:
        num_rows (`int`): rows in the batch.
        max_k (`int`): the largest k (`num_speculative_tokens`).
        step_cost (`StepCost`): the target's forward cost model.
        draft_cost_per_token (`float`): the speculator's cost of drafting one token relative to a one-token step.
        priors (`tuple[float, ...]`): acceptance assumed per confidence class before any evidence.
        strength (`float`): how many tried drafts the prior (for the pooled estimate) and the pooled estimate (for a
            row's) weigh.
        decay (`float`): factor applied to every count each step; older evidence fades.
    """

    def __init__(self, num_rows: int, max_k: int, step_cost: StepCost, draft_cost_per_token: float = 0.0,
                 priors: tuple[float, ...] = (0.6,), strength: float = 2.0, decay: float = 0.9):
        if not priors or not all(0.0 <= p < 1.0 for p in priors):
            raise ValueError(f"acceptance priors must be in [0, 1), one per confidence class, got {priors!r}")
        self.max_k = max_k
        self.step_cost = step_cost
        # Drafting one token, relative to a one-token target step. A static estimate, like the step cost.
        self.draft_cost_per_token = draft_cost_per_token
        self.priors = torch.tensor(priors, dtype=torch.float64)
        self.strength = strength
        self.decay = decay
        classes = len(priors)
        # Host tensors: the policy never touches the device.
        self.accepted = torch.zeros(num_rows, classes, dtype=torch.float64)
        self.tried = torch.zeros(num_rows, classes, dtype=torch.float64)

    def acceptance(self, rows: list[int], classes: list[int] | None = None) -> torch.Tensor:
        """`[len(rows)]` each row's estimated chance that a draft of the given class is accepted."""
        cls = torch.tensor(classes if classes is not None else [0] * len(rows), dtype=torch.long)
        pooled = (self.accepted.sum(0) + self.strength * self.priors) / (self.tried.sum(0) + self.strength)
        r = torch.tensor(rows, dtype=torch.long)
        own_accepted, own_tried = self.accepted[r, cls], self.tried[r, cls]
        return (own_accepted + self.strength * pooled[cls]) / (own_tried + self.strength)

    def choose(self, rows: list[int], available: list[int] | None = None, classes: list[int] | None = None) -> int:
        """The k for this step's rows.

        Args:
            rows: the active rows.
            available: drafts each row can offer (known when proposals are made before k is chosen); `None` means
                up to `max_k` each.
            classes: each row's confidence class for this step's proposal; `None` means class 0.
        """
        if self.max_k == 0 or not rows:
            return 0
        rates = self.acceptance(rows, classes)
        ks = torch.arange(self.max_k + 1, dtype=torch.float64)
        # Expected emitted tokens summed over rows for each k: sum over j = 0..min(k, available) of rate^j.
        terms = rates[:, None] ** ks[None, :]
        if available is not None:
            terms = terms.masked_fill(ks[None, :] > torch.tensor(available, dtype=torch.float64)[:, None], 0.0)
        expected = terms.cumsum(dim=1).sum(0)  # [max_k + 1]
        cost = self.step_cost.relative(len(rows), ks + 1) + self.draft_cost_per_token * ks
        return int(torch.argmax(expected / cost))

    def update(self, rows: list[int], num_drafted: list[int], num_accepted: list[int],
               classes: list[int] | None = None) -> None:
        """Folds one step's outcome into the counts: each row's proposal was of class `classes[i]`."""
        self.accepted.mul_(self.decay)
        self.tried.mul_(self.decay)
        drafted = torch.tensor(num_drafted, dtype=torch.float64)
        accepted = torch.tensor(num_accepted, dtype=torch.float64)
        # Tokens tried: every accepted one, plus the rejected one when a row stopped before its last draft.
        tried = accepted + (accepted < drafted).double()
        r = torch.tensor(rows, dtype=torch.long)
        cls = torch.tensor(classes if classes is not None else [0] * len(rows), dtype=torch.long)
        self.accepted.index_put_((r, cls), accepted, accumulate=True)
        self.tried.index_put_((r, cls), tried, accumulate=True)
