"""Whether drafting pays, judged by the steps themselves: the serving engine's check on adaptive k's models.

Adaptive k chooses drafts from two models, the acceptance it expects and the step cost it fitted, and both can be
wrong where it matters: on a CPU the step-cost curve is measured at a few batch sizes and bends between them; on a
launch-bound GPU it is flat and calls drafts free when the verify's extra work and the head's forwards are not.
`DraftReturns` measures the outcome instead. Per band of batch sizes (1, 2-3, 4-7, 8-15, ...) it keeps what a plain
step (no drafts) costs there, as a ratio to the step-cost curve (which carries the context length) that follows the
host's speed, and for every step that verified drafts:

- spent: the tokens its rows would have produced in plain steps during the step's extra time,
  `rows * (seconds - plain) / plain`, the whole step timed (proposing, forward, verify, the speculator's commit);
- accepted: the drafts the target accepted.

A band's return is accepted over spent, both decayed per step in the band (drafted or not, so that a band where
drafting stopped is tried again later) and shrunk towards `prior_return` by `prior_tokens` spent tokens. Below 1,
drafting in the band lost tokens: adaptive k then asks its drafts there to promise that many times more
(`AdaptiveK.margin`). Rows count as the policy weighs them (`AdaptiveK.weigh`): a row's accepted drafts and its
share of the time at its weight. One-call `generate` never times its steps (seeded runs stay reproducible); only the
server, whose batches change with every arrival anyway, uses this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Band:
    plain_ratio: float | None = None  # a plain step's seconds over the curve's price, recent steps weighing more
    accepted: float = 0.0  # accepted drafts (weighted), decayed
    spent: float = 0.0  # tokens the drafting steps' extra time would have made in plain steps (weighted), decayed
    drafting_steps: int = 0
    plain_steps: int = 0
    total_accepted: float = 0.0  # the same, not decayed (for reports)
    total_spent: float = 0.0


class DraftReturns:
    """Accepted drafts against the tokens their steps' extra time cost, per band of batch sizes.

    Args:
        step_cost (`StepCost`): the curve that prices a plain step by rows and context; only its shape is used
            (each band learns its own ratio to it, in seconds).
        decay (`float`): factor on a band's accepted and spent tokens at each of its steps.
        ratio_decay (`float`): weight kept by a band's plain-step ratio at each of its plain steps.
        prior_tokens (`float`): spent tokens the prior weighs.
        prior_return (`float`): the return assumed before evidence (above 1: drafting is given the benefit of the
            doubt until it loses).
        floor (`float`): the smallest factor `factor` returns (the largest margin multiplier is its inverse).
    """

    SLOWEST = 4.0

    def __init__(self, step_cost, decay: float = 0.97, ratio_decay: float = 0.9, prior_tokens: float = 4.0,
                 prior_return: float = 1.2, floor: float = 0.25):
        if not 0.0 < decay <= 1.0 or not 0.0 <= ratio_decay < 1.0:
            raise ValueError(f"decay must be in (0, 1] and ratio_decay in [0, 1), got {decay}, {ratio_decay}")
        self.step_cost = step_cost
        self.decay = decay
        self.ratio_decay = ratio_decay
        self.prior_tokens = prior_tokens
        self.prior_return = prior_return
        self.floor = floor
        self.bands: dict[int, _Band] = {}
        self._any_ratio: float | None = None  # every band's plain steps: the fallback for a band without its own

    @staticmethod
    def band(rows: int) -> int:
        """The band of a batch of `rows` rows: 0 for 1 row, 1 for 2-3, 2 for 4-7, ..."""
        return max(rows, 1).bit_length() - 1

    def observe(self, rows: int, context: float, seconds: float, accepted: float, weight: float,
                drafted: bool) -> None:
        """One decode step (no prompt tokens in it) of `rows` rows over `context` cached tokens in all, timed whole
        (`seconds`). `drafted`: it verified drafts, of which `accepted` (weighted) were accepted; `weight`: its rows'
        weights summed (`rows` when rows are not weighed)."""
        band = self.bands.setdefault(self.band(rows), _Band())
        band.accepted *= self.decay
        band.spent *= self.decay
        price = self.step_cost.at(rows, 1.0, context)
        if not drafted:
            ratio = seconds / price
            band.plain_ratio = ratio if band.plain_ratio is None else (
                self.ratio_decay * band.plain_ratio + (1 - self.ratio_decay) * ratio)
            self._any_ratio = ratio if self._any_ratio is None else (
                self.ratio_decay * self._any_ratio + (1 - self.ratio_decay) * ratio)
            band.plain_steps += 1
            return
        ratio = band.plain_ratio if band.plain_ratio is not None else self._any_ratio
        if ratio is None:  # no plain step timed yet: nothing to compare with
            return
        plain = ratio * price
        # A step far slower than its plain counterpart (a compile, a pause of the host) counts as at most
        # `SLOWEST` plain steps' worth, so one outlier does not switch a band off for a hundred steps.
        spent = weight * min((seconds - plain) / plain, self.SLOWEST)
        band.accepted += accepted
        band.spent += spent
        band.total_accepted += accepted
        band.total_spent += spent
        band.drafting_steps += 1

    def value(self, rows: int) -> float:
        """The band's return: accepted drafts per token their time would have made in plain steps (shrunk towards
        the prior; infinite while the drafting steps took no longer than plain ones)."""
        band = self.bands.get(self.band(rows))
        accepted, spent = (band.accepted, band.spent) if band is not None else (0.0, 0.0)
        denominator = spent + self.prior_tokens
        if denominator <= 0:
            return math.inf
        return (accepted + self.prior_return * self.prior_tokens) / denominator

    def factor(self, rows: int) -> float:
        """What the band's drafts' promised gain counts for: their return where below 1 (at least `floor`), else
        1."""
        return max(self.floor, min(1.0, self.value(rows)))

    def summary(self) -> str:
        """One line: per band seen, its rows, steps with and without drafts, accepted and spent tokens over all
        steps, and its return now."""
        parts = []
        for b in sorted(self.bands):
            band = self.bands[b]
            rows = "1" if b == 0 else f"{1 << b}-{(2 << b) - 1}"
            value = self.value(1 << b)
            parts.append(f"{rows} rows: {band.drafting_steps}/{band.plain_steps} steps, accepted {band.total_accepted:.1f} "
                         f"/ spent {band.total_spent:.1f}, return {value:.2f}")
        return "; ".join(parts) or "no steps"
