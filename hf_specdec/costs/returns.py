"""What drafting really cost at each batch size, judged by whole steps: the serving engine's check on adaptive k.

Adaptive k prices a step with drafts from its step-cost model: in serving, the calibrated curve corrected by the
forwards' own timings (`MeasuredStepCost`), whose price of a draft is one number for every batch size. It is not:
at one row a CPU's matrix kernels are bound by reading the weights and a few more tokens cost next to nothing, at
twenty rows they are bound by arithmetic and every draft costs its share; a launch-bound GPU prices tokens flat and
the verify's extra kernels and a head's forwards are what cost. The model also leaves out what happens around the
forward (proposing, a head's forwards, the speculator's commit). `DraftReturns` compares, per band of batch sizes
(1, 2-3, 4-7, 8-15, ...), what the steps that verified drafts took beyond a plain step with what the model said:

- a plain step's time there, as a ratio to the step-cost curve's price (which carries the context length), recent
  steps weighing more, so it follows the host's speed;
- for each step with drafts, timed whole (proposing to commit): its extra time over that plain step, and the extra
  the model priced for the same drafts (`AdaptiveK.priced_extra`), both in plain steps.

A band's correction (`scale`) is realized extra over priced extra, decayed per step in the band (drafted or not:
a band the policy stopped drafting in drifts back to 1 and is tried again) and shrunk towards 1 by `prior` plain
steps of evidence; adaptive k multiplies the extra cost of every draft set in that band by it. Alongside, accepted
drafts are counted per band, for reports (`summary`). One-call `generate` never times its steps (seeded runs stay
reproducible); only the server, whose batches change with every arrival anyway, uses this.

The references are guarded: a band's plain time starts at the lower median of its first plain steps and follows
later ones within bounds; a band without a settled, fresh plain reference of its own (fewer than `SEED` plain steps,
or none in its last `STALE` steps) may have its drafts made dearer, never cheaper; one step counts at most the
largest correction times its price (or a quarter of a plain step), above or below it. A step whose speculator ran
draft forwards but verified no draft is neither plain nor drafting: it is left out. On a
GPU a step is read after the commit's host transfer, with no sync of its own: work queued after that transfer (a
head reading the committed states) lands in the next step's time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Band:
    plain_ratio: float | None = None  # a plain step's seconds over the curve's price, recent steps weighing more
    first_ratios: list = field(default_factory=list)  # the first plain steps' ratios (the reference's seed)
    since_plain: int = 0  # the band's steps since its last plain step
    realized: float = 0.0  # the drafting steps' extra time, in plain steps, decayed
    priced: float = 0.0  # what the model priced for the same drafts, in plain steps, decayed
    drafting_steps: int = 0
    plain_steps: int = 0
    accepted: float = 0.0  # accepted drafts, all steps (for reports)
    drafted: float = 0.0  # verified drafts, all steps (for reports)


class DraftReturns:
    """Realized against priced extra cost of steps with drafts, per band of batch sizes.

    Args:
        step_cost (`StepCost`): the curve that prices a plain step by rows and context; only its shape is used
            (each band learns its own ratio to it, in seconds).
        decay (`float`): factor on a band's realized and priced extra at each of its steps.
        ratio_decay (`float`): weight kept by a band's plain-step ratio at each of its plain steps.
        prior (`float`): plain steps of extra cost that the prior (a correction of 1) weighs.
        bounds (`tuple[float, float]`): the smallest and largest correction.
    """

    # A plain reference starts at the lower median of a band's first SEED plain steps (the first decode steps carry
    # one-off allocations); afterwards a plain step's ratio enters within [1 / DAMP, DAMP] times the reference (a
    # pause of the host moves it a little, a lasting change of speed over a few steps).
    SEED, DAMP = 3, 1.5
    # A band whose last plain step is more than STALE of its steps ago (it drafts every step) has no fresh reference:
    # its correction may then make drafts dearer, never cheaper, so an error in the reference cannot lock drafting on.
    STALE = 32

    def __init__(self, step_cost, decay: float = 0.97, ratio_decay: float = 0.9, prior: float = 0.5,
                 bounds: tuple[float, float] = (0.25, 4.0)):
        if not 0.0 < decay <= 1.0 or not 0.0 <= ratio_decay < 1.0:
            raise ValueError(f"decay must be in (0, 1] and ratio_decay in [0, 1), got {decay}, {ratio_decay}")
        self.step_cost = step_cost
        self.decay = decay
        self.ratio_decay = ratio_decay
        self.prior = prior
        self.bounds = bounds
        self.bands: dict[int, _Band] = {}
        self._any_ratio: float | None = None  # every band's plain steps: the fallback for a band without its own

    @staticmethod
    def band(rows: int) -> int:
        """The band of a batch of `rows` rows: 0 for 1 row, 1 for 2-3, 2 for 4-7, ..."""
        return max(rows, 1).bit_length() - 1

    def observe(self, rows: int, context: float, seconds: float, priced_extra: float = 0.0, drafted: int = 0,
                accepted: int = 0) -> None:
        """One decode step (no prompt tokens in it) of `rows` rows over `context` cached tokens in all, timed whole
        (`seconds`). A step with drafts (`drafted` > 0, `accepted` of them accepted) brings the extra cost the
        policy priced for them, in plain steps (`priced_extra`)."""
        band = self.bands.setdefault(self.band(rows), _Band())
        band.realized *= self.decay
        band.priced *= self.decay
        price = self.step_cost.at(rows, 1.0, context)
        if not drafted:
            band.plain_ratio = self._follow(band, seconds / price)
            self._any_ratio = band.plain_ratio if self._any_ratio is None else (
                self.ratio_decay * self._any_ratio + (1 - self.ratio_decay) * band.plain_ratio)
            band.plain_steps += 1
            band.since_plain = 0
            return
        band.since_plain += 1
        ratio = band.plain_ratio if band.plain_ratio is not None else self._any_ratio
        if ratio is None:  # no plain step timed yet: nothing to compare with
            return
        plain = ratio * price
        priced = max(priced_extra, 0.0)
        # One step counts at most the largest correction times its price (and a quarter of a plain step) either
        # way: a pause of the host during one step, or one faster than the reference, moves the band's correction
        # a little, not for a hundred steps.
        limit = max(self.bounds[1] * priced, 0.25)
        band.realized += min(max((seconds - plain) / plain, -limit), limit)
        band.priced += priced
        band.drafting_steps += 1
        band.drafted += drafted
        band.accepted += accepted

    def _follow(self, band: _Band, ratio: float) -> float:
        """The band's plain reference after a plain step of `ratio`."""
        if len(band.first_ratios) < self.SEED:
            band.first_ratios.append(ratio)
            # The lower median: with two, a slow first step does not stay the reference.
            return sorted(band.first_ratios)[(len(band.first_ratios) - 1) // 2]
        reference = band.plain_ratio
        ratio = min(max(ratio, reference / self.DAMP), reference * self.DAMP)
        return self.ratio_decay * reference + (1 - self.ratio_decay) * ratio

    def scale(self, rows: int) -> float:
        """What the extra cost of drafts at a batch of `rows` rows really is, as a multiple of what the policy's
        model prices: realized over priced extra in the band, shrunk towards 1, within `bounds`."""
        band = self.bands.get(self.band(rows))
        if band is None:
            return 1.0
        value = (band.realized + self.prior) / (band.priced + self.prior)
        if len(band.first_ratios) < self.SEED or band.since_plain > self.STALE:  # no settled, fresh reference
            value = max(value, 1.0)
        return min(max(value, self.bounds[0]), self.bounds[1])

    def summary(self) -> str:
        """One line: per band seen, its rows, steps with and without drafts, drafts verified and accepted, and its
        correction now."""
        parts = []
        for b in sorted(self.bands):
            band = self.bands[b]
            rows = "1" if b == 0 else f"{1 << b}-{(2 << b) - 1}"
            parts.append(f"{rows} rows: {band.drafting_steps}/{band.plain_steps} steps, {band.drafted:.0f} drafted, "
                         f"{band.accepted:.0f} accepted, extra cost x{self.scale(1 << b):.2f}")
        return "; ".join(parts) or "no steps"
