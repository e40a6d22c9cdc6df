"""Choosing k each step from the acceptance observed so far, so speculation pays for itself or switches off.

Acceptance. Each proposal falls in one of its speculator's confidence classes (n-gram lookup: the length of the
matched context; a model speculator: a single class). Per class the call keeps counts of drafts accepted and tried,
pooled over its rows, and each row keeps its own. A row's chance `p` that its next draft is accepted is its own count
shrunk towards the pooled one, which is shrunk towards the speculator's prior for the class, scaled by how the call's
drafts fared against the priors over all classes (a class seldom seen borrows that evidence: on free text every
match length is accepted less often than its prior says, on copying tasks more often). Counts decay each step,
so estimates follow a row that moves between copying and free writing, and a row that stopped drafting drifts back
towards the prior and is tried again later. With k drafts a row emits `1 + p + ... + p^k` tokens on average (fewer
when it has fewer drafts to offer).

Cost. A target forward of B rows of q tokens over C cached tokens costs `per_row * B + per_context_token * C +
curve(B q)` (`StepCost`), so verifying k drafts costs `cost(B, k + 1, C) / cost(B, 1, C)` plain steps, plus what
drafting costs. On a CPU the curve climbs in steps as the matrix kernels change shape; on a GPU it is nearly flat.
The step takes the k in `[0, max_k]` that maximises the batch's expected tokens per unit of cost, if that beats plain
decoding (k = 0) by a margin (`min_gain`, 10%: the cost model leaves out verification work, and a draft that only
breaks even is not worth the risk). Within a `generate` call costs are never timed, so seeded runs choose the same k
and stay reproducible, and no step waits on the device: they come from this host's cached profile (`calibration.py`,
`hf-specdec calibrate`) when there is one, else from the static curves below; `StepCost.measure(model)` fits one by
hand. The serving engine, whose batches change with every arrival anyway, also corrects them from its own steps'
wall times (`MeasuredStepCost`): a profile measured on an idle host, at other batch sizes, misprices a loaded
server's drafts. `chosen` keeps each step's k, and `idle_explanation` says why drafting stayed off when it mostly did.

The arithmetic runs in numpy on the host: a choice is a few dozen operations on arrays of a few hundred numbers,
where each torch operation's dispatch costs more than its work (a step's choice at 32 rows: 0.32 ms in torch).
The counts are also readable as torch tensors sharing the arrays' memory (`accepted`, `tried`, `priors`,
`weights`), and `acceptance` and `pooled` answer in tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from .returns import DraftReturns
from .step_cost import MeasuredStepCost, StepCost

_MAX_RATE = 0.95  # a prior scaled up by a call's evidence stays below certainty


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
        min_gain (`float`): drafting must promise at least this many times plain decoding's tokens per unit of cost,
            a margin for what the cost model leaves out (verification, context length); below it k = 0.
        packed (`bool`): the target's verify feeds each row only its own drafts (`layout.PackedLayout`), so a
            step costs the rows' tokens summed rather than every row padded to the widest.
        measure_steps (`bool`): correct `step_cost` by the steps' own wall times (`measured`, a `MeasuredStepCost`);
            the serving engine's choice, where k already varies with arrivals. Off, k depends on acceptance alone.
        calibrate (`bool`): scale every draft's expected gain by the drafts accepted over those the estimates
            expected, in the steps so far (`calibration`): the drafts verified are the ones whose estimates came out
            highest, so the raw estimates overrate them (`generate`'s and the serving engine's choice: it reads
            outputs only, so seeded calls stay reproducible).
        check_returns (`bool`): correct the extra cost of drafts per band of batch sizes by what the steps that
            verified drafts there really took beyond plain steps, timed whole, against what the model priced
            (`returns`, a `DraftReturns`; the step feeds it). The serving engine's choice.
        price_reading (`bool`): price a model speculator's backlog (`Speculator.unread`: what it reads before its
            first draft after steps without drafts, or after requests joined) with the drafts, spread over
            `READ_HORIZON` steps. The serving engine's choice, where arrivals stop and resume drafting at large
            batches; in one call a model speculator reads the prompts once and drafting rarely stops.
        draft_subsets (`bool`): a model speculator that can draft for some rows only
            (`Speculator.drafts_row_subsets`) drafts for the rows `choose_drafters` picks, priced for those rows
            alone, where the verify is packed. Off by default, the serving engine's too: faster on the virtual
            clock, not yet shown over HTTP (docs/log/2026-11-28-benchmarks-history.md, "Drafts for the rows the
            run waits for").
    """

    def __init__(self, num_rows: int, max_k: int, step_cost: StepCost, draft_cost_per_token: float = 0.0,
                 priors: tuple[float, ...] = (0.6,), strength: float = 2.0, decay: float = 0.9, min_gain: float = 1.1,
                 packed: bool = False, measure_steps: bool = False, calibrate: bool = False,
                 check_returns: bool = False, price_reading: bool = False, draft_subsets: bool = False):
        if not priors or not all(0.0 <= p < 1.0 for p in priors):
            raise ValueError(f"acceptance priors must be in [0, 1), one per confidence class, got {priors!r}")
        self.max_k = max_k
        self.packed = packed
        self.step_cost = step_cost
        # The serving engine's steps correct the step cost as they run (`measured.observe`); `None`: static only.
        self.measured = MeasuredStepCost(step_cost) if measure_steps else None
        self.returns = DraftReturns(step_cost) if check_returns else None
        self.read_horizon = self.READ_HORIZON if price_reading else float("inf")  # inf: the choice ignores them
        self.draft_subsets = draft_subsets
        # Drafting one token, relative to a one-token target step. A static estimate, like the step cost.
        self.draft_cost_per_token = draft_cost_per_token
        self._priors = np.array(priors, dtype=np.float64)
        self.priors = torch.from_numpy(self._priors)  # the same memory: writes to either show in both
        self.strength = strength
        self.decay = decay
        self.min_gain = min_gain
        classes = len(priors)
        # Host tensors: the policy never touches the device.
        self._accepted = np.zeros((num_rows, classes))
        self._tried = np.zeros((num_rows, classes))
        self.accepted, self.tried = torch.from_numpy(self._accepted), torch.from_numpy(self._tried)
        self.chosen: list[int] = []  # the k chosen at each step
        # Tokens in the rows' KV caches, summed, at the step being planned (set by the step before it proposes, for
        # speculators that ask `drafting_pays` while drafting).
        self.context = 0.0
        # What a token of each row is worth, 1 for every row unless `weigh` says otherwise (see there).
        self._weights = np.ones(num_rows)
        self.weights = torch.from_numpy(self._weights)
        self.num_declined = 0  # steps where drafts were on offer and k was 0
        # Accepted drafts and what the estimates expected of the same drafts, decayed per step (`calibrate`).
        self.calibrate = calibrate
        self.expected_accepted = self.actual_accepted = 0.0
        self._last = (num_rows, 0.0)  # the rows and context of the latest choice, to explain it
        self._most_rows = 0  # the most rows any choice was made for: the call's batch, where rows end apart

    def acceptance(self, rows: list[int], classes: list[int] | None = None) -> torch.Tensor:
        """`[len(rows)]` each row's estimated chance that a draft of the given class is accepted."""
        return torch.from_numpy(self._rates(rows, classes))

    def pooled(self) -> torch.Tensor:
        """`[classes]` the call's acceptance per class: its counts over every row, shrunk towards the class's prior
        times the ratio of drafts accepted to those the priors expected over all classes."""
        return torch.from_numpy(self._pooled())

    def _rates(self, rows: list[int], classes: list[int] | None) -> np.ndarray:
        """`[rows]` each row's acceptance estimate for its class (class 0 where `classes` is None)."""
        cls = np.zeros(len(rows), dtype=np.intp) if classes is None else np.asarray(classes, dtype=np.intp)
        return self._class_rates(rows)[np.arange(len(rows)), cls]

    def _class_rates(self, rows: list[int]) -> np.ndarray:
        """`[rows, classes]` each row's acceptance estimate for every class: its counts, shrunk towards the pooled
        estimate by `strength`."""
        r = np.asarray(rows, dtype=np.intp)
        return (self._accepted[r] + self.strength * self._pooled()[None, :]) / (self._tried[r] + self.strength)

    def _pooled(self) -> np.ndarray:
        accepted, tried = self._accepted.sum(0), self._tried.sum(0)
        expected = float((tried * self._priors).sum())
        scale = (float(accepted.sum()) + self.strength) / (expected + self.strength)
        prior = np.minimum(self._priors * scale, _MAX_RATE)
        return (accepted + self.strength * prior) / (tried + self.strength)

    @property
    def reads_backlog(self) -> bool:
        """Whether a model speculator's backlog (`Speculator.unread`) enters this policy at all: priced in the
        choice (`price_reading`) or in the whole-step check (`returns`). Otherwise the step need not count it."""
        return self.read_horizon != float("inf") or self.returns is not None

    def choose(self, rows: list[int], available: list[int] | None = None, classes: list[int] | None = None,
               context: float = 0.0, unread: float = 0.0) -> int:
        """The k for this step's rows.

        Args:
            rows: the active rows.
            available: drafts each row can offer (known when proposals are made before k is chosen); `None` means
                up to `max_k` each.
            classes: each row's confidence class for this step's proposal; `None` means class 0.
            context: tokens already in the rows' KV caches, summed (the step cost depends on it).
            unread: what the speculator must read before drafting, in target tokens (`Speculator.unread`): paid
                by any k > 0, priced (with `price_reading`; otherwise not) as that many tokens fed with the drafts,
                spread over `READ_HORIZON` steps. A resume's backlog is read once for the stretch of drafting
                steps it starts; while drafting runs it is the few states accepted since the last step, small.
        """
        # Nothing on offer (no lookup matched): k = 0 without the arithmetic, which costs a few small tensor ops.
        offers = available is None or any(a > 0 for a in available)
        k = self._choose(rows, available, classes, context, unread) if self.max_k and rows and offers else 0
        self.chosen.append(k)
        # A step is declined when drafts were possible (a row offered some) and the policy chose none.
        self.num_declined += k == 0 and bool(rows) and (available is None or any(a > 0 for a in available))
        self._note(max(len(rows), 1), context)
        return k

    def choose_rows(self, rows: list[int], available: list[int], classes: list[int] | None = None,
                    context: float = 0.0, record: bool = True) -> list[int]:
        """Drafts to verify per row, for a packed verify (each row feeds only its own) of drafts already made (what
        each row offers, `available`, is known): a row with a likely proposal verifies it while a row beside it with
        an unlikely one feeds one token, instead of one k for all.

        A row's j-th draft adds `p^j` expected tokens (p: its acceptance estimate), so the best set of drafts of a
        given size takes the largest of these over all rows; a step's cost depends only on the tokens fed in all.
        The step takes the size that maximises expected tokens per unit of cost, each draft's gain discounted by
        `min_gain` (a draft must beat its own cost by the margin), if the set beats plain decoding by `min_gain`.
        The drafts were made already: their cost does not enter. `record=False`: the step's k was chosen (and
        recorded) before drafting (`choose`); this only trims each row to the drafts worth verifying."""
        offers = any(a > 0 for a in available)
        ks = self._choose_rows(rows, available, classes, context)[0] if self.max_k and rows and offers else [0] * len(
            rows)
        if not record:
            return ks
        self.chosen.append(max(ks, default=0))
        self.num_declined += not any(ks) and offers
        self._note(max(len(rows), 1), context)
        return ks

    def may_draft(self, rows: list[int], available: list[int], context: float = 0.0) -> bool:
        """Whether `choose_rows` (`choose` where the verify is not packed) could verify any drafts this step were
        each row to offer `available` drafts of its likeliest confidence class. When not, a speculator whose drafts
        are free need not look for proposals (an n-gram lookup, its tensor ops and its device read spared); the step
        is recorded as declined, as `choose_rows` records one. Records nothing when drafting could pay."""
        if self.max_k and rows and any(a > 0 for a in available):
            best = self._class_rates(rows).argmax(1).tolist()
            if (any(self._choose_rows(rows, available, best, context)[0]) if self.packed
                    else self._choose(rows, available, best, context) > 0):
                return True
        self.chosen.append(0)
        self.num_declined += bool(rows) and any(a > 0 for a in available)
        self._note(max(len(rows), 1), context)
        return False

    def choose_drafters(self, rows: list[int], available: list[int] | None = None, context: float = 0.0,
                        unread: list[float] | None = None) -> list[int]:
        """Drafts per row for a model speculator that drafts for the rows it is asked to only
        (`Speculator.drafts_row_subsets`), before it drafts, for a packed verify: the rows and depths of highest
        expected gain, as `choose_rows` takes them from drafts on offer (`available`: at most this many per row, 0
        where the speculator cannot draft; `None`: `max_k` each), with what making them costs added: the
        speculator's forwards (`draft_cost_per_token` per depth) and, with `price_reading`, the backlog of the rows
        chosen alone (`unread`, per row, in target tokens; see `choose`). A row whose own backlog costs more than
        its drafts could gain is left out first, so that it does not veto the others. Pricing every row's k drafts,
        as `choose` does, makes a few rows' drafts look as dear as everyone's: at a large batch, where only the
        rows the run waits for (`weigh`) or the surest ones pay, they were never made. Records the step's k like
        `choose`."""
        n = len(rows)
        counts = [0] * n
        offered = [self.max_k] * n if available is None else [max(0, min(a, self.max_k)) for a in available]
        if self.max_k and rows and any(offered):
            backlog = np.asarray(unread if unread is not None else [0.0] * n, dtype=np.float64)
            plain = float(self._weights[np.asarray(rows, dtype=np.intp)].sum())  # expected tokens, cost 1
            if unread is not None and float(backlog.max()) > 0:
                # A row's drafts raise the step's value only where their gain beats the plain tokens times what
                # its backlog adds to the step's cost.
                depth = np.arange(1, self.max_k + 1, dtype=np.float64)
                gains = np.where(depth[None, :] > np.asarray(offered, dtype=np.float64)[:, None], 0.0,
                                 self._gains(rows, None, depth)).sum(1)
                extra = self._relative(n, 1 + backlog / self.read_horizon / n, context) - 1
                offered = [0 if g < self.min_gain * plain * e else a
                           for a, g, e in zip(offered, gains.tolist(), extra.tolist())]
            # The drafts of highest weighed gain, then the head's depth: each row's first `d` of them for every d,
            # the head's forwards (`d`) and the chosen rows' backlog priced, in one evaluation over d.
            ks = np.asarray(self._choose_rows(rows, offered, None, context)[0], dtype=np.intp)
            most = int(ks.max())
            if most:
                d = np.arange(1, most + 1)
                capped = np.minimum(ks[None, :], d[:, None])  # [depths, rows]
                gained = self._gains(rows, None, d.astype(np.float64)).cumsum(1).T  # [depths, rows]: first j drafts'
                first = np.take_along_axis(gained, np.maximum(capped - 1, 0), axis=0)
                expected = plain + np.where(capped == 0, 0.0, first).sum(1)
                read = float(backlog[ks > 0].sum()) / self.read_horizon / n
                tokens = 1 + capped.sum(1) / n + read
                cost = self._relative(n, tokens, context) + self.draft_cost_per_token * d
                value = expected / self._corrected(n, cost)
                best = int(np.argmax(value))
                if float(value[best]) > self.min_gain * plain:
                    counts = capped[best].tolist()
        self.chosen.append(max(counts, default=0))
        self.num_declined += not any(counts) and any(offered)
        self._note(max(n, 1), context)
        return counts

    def drafting_pays(self, rows: list[int], available: list[int], classes: list[int], alternative: list[int],
                      alternative_classes: list[int], drafted: int, context: float | None = None,
                      unread: float = 0.0) -> bool:
        """Whether the drafts `alternative` (per row, of `alternative_classes`), which take `drafted` draft
        positions to make (a head's forwards), would give a packed step more expected tokens per unit of cost, their
        drafting included (`draft_cost_per_token` each, and reading `unread` target tokens' worth first), than the
        drafts already on offer (`available`, of `classes`). `context`: the step's cached tokens (default:
        `self.context`, the step's). Records nothing."""
        if not self.max_k or not rows or not drafted:
            return False
        context = self.context if context is None else context
        base = self._choose_rows(rows, available, classes, context)[1]
        ks, _, expected, tokens = self._choose_rows(rows, alternative, alternative_classes, context)
        if not any(ks):
            return False
        tokens += unread / self.read_horizon / len(rows)  # the head's backlog, fed with the drafts
        cost = float(self._relative(len(rows), np.float64(tokens), context)) + self.draft_cost_per_token * drafted
        return expected / float(self._corrected(len(rows), np.float64(cost))) > base

    def weigh(self, rows: list[int], remaining: list[int] | None) -> None:
        """How much a token of each row is worth this step. `None`: every row alike (the batch's tokens per unit of
        cost is what counts while requests wait for a place). With `remaining`, each row's tokens still to come at
        most: weights rising with them (`WEIGHT_POWER`), the longest 1. When nobody waits, the work left ends when
        its longest row does, and an accepted draft there saves a whole step at the end while one in a row about to
        finish saves next to nothing; so drafts go where they shorten the run."""
        if remaining is None or not rows:
            self._weights[rows] = 1.0
            return
        longest = max(max(remaining), 1)
        share = np.maximum(np.asarray(remaining, dtype=np.float64), 0.0) / longest
        self._weights[rows] = share ** self.WEIGHT_POWER

    # Weights are (work left / the most any row has left) ** WEIGHT_POWER: a higher power sends an accepted draft's
    # value to the rows the run waits for. It stays 1 (and `draft_subsets` off) because sharper weights, with drafts for
    # the rows chosen, gained only on the virtual clock (`benchmarks/serve_sim.py --weight-power`), not over HTTP
    # (docs/log/2026-11-28-benchmarks-history.md, "Drafts for the rows the run waits for (issue 25, 2026-11-27)").
    WEIGHT_POWER = 1.0

    # A speculator's backlog (`Speculator.unread`) is read once for the drafting steps that follow: priced as spread
    # over this many. Charged whole to one step, a resume would rarely pay where every later step would (a newcomer's
    # prompt at one row); spread over a whole answer, a resume for one step at a large batch (reading up to 64
    # states a row of an EAGLE head, most of a step on a CPU) would look free.
    READ_HORIZON = 8

    # Calibration: how many expected accepted drafts the prior weighs (at a ratio of 1), and the decay per step.
    CALIBRATION_PRIOR, CALIBRATION_DECAY = 8.0, 0.98

    @property
    def calibration(self) -> float:
        """Drafts accepted over those the estimates expected (1 without `calibrate`), shrunk towards 1 by a prior
        of `CALIBRATION_PRIOR` expected drafts and capped at 1.5."""
        if not self.calibrate:
            return 1.0
        prior = self.CALIBRATION_PRIOR
        return min(1.5, (self.actual_accepted + prior) / (self.expected_accepted + prior))

    def _gains(self, rows: list[int], classes, ks: np.ndarray) -> np.ndarray:
        """`[rows, len(ks)]` the expected tokens of each row's draft at each depth in `ks` (a row's j-th draft is
        accepted with chance p^j), weighed and calibrated, at most 1 token each (at most the weight)."""
        rates = self._rates(rows, classes)
        weights = self._weights[np.asarray(rows, dtype=np.intp)]
        gains = rates[:, None] ** ks[None, :]
        gains = np.where(ks[None, :] > 0, np.minimum(gains * self.calibration, 1.0), gains)
        return weights[:, None] * gains

    def priced_extra(self, rows: int, tokens_per_row: float, drafted: int, context: float,
                     unread: float = 0.0) -> float:
        """The extra cost, in plain steps, that the model (without `returns`' correction) gives a step of `rows`
        rows feeding `tokens_per_row` tokens each on average, over `context` cached tokens, whose speculator made
        `drafted` draft positions (a model speculator's forwards; 0 for drafts that cost nothing to make) after
        reading `unread` target tokens' worth of backlog (the whole of it, read in that step, whether the choice
        priced it or not: priced as that many more tokens fed over the rows)."""
        cost = float(self._relative(rows, np.float64(tokens_per_row + unread / rows), context))
        return cost - 1.0 + self.draft_cost_per_token * drafted

    def _corrected(self, rows: int, cost: np.ndarray) -> np.ndarray:
        """Relative step costs with their extra over a plain step scaled by `returns` for this batch size."""
        if self.returns is None:
            return cost
        return 1.0 + self.returns.scale(rows) * np.maximum(cost - 1.0, 0.0)

    def _step_price(self, rows: int, tokens: np.ndarray, drafted: np.ndarray, context: float) -> np.ndarray:
        """What steps of `rows` rows feeding `tokens` each, whose speculator drafted `drafted` positions, cost in
        plain steps: the forward and the drafting, corrected by `returns` where it is on."""
        return self._corrected(rows, self._relative(rows, tokens, context) + self.draft_cost_per_token * drafted)

    def _relative(self, rows: int, tokens: np.ndarray, context: float) -> np.ndarray:
        if self.measured is not None and self.measured.ready:
            return self.measured.relative_costs(rows, tokens, context)
        return self.step_cost.relative_costs(rows, tokens, context)

    def _choose_rows(self, rows, available, classes, context) -> tuple[list[int], float, float, float]:
        """Drafts per row, the step's expected tokens per unit of cost with them, its expected tokens and the tokens
        fed per row on average."""
        weights = self._weights[np.asarray(rows, dtype=np.intp)]
        j = np.arange(1, self.max_k + 1, dtype=np.float64)
        gains = self._gains(rows, classes, j)  # [rows, max_k]: the j-th draft's expected tokens
        offered = np.asarray(available, dtype=np.float64)[:, None]
        gains = np.where(j[None, :] > offered, -1.0, gains).ravel()
        order = np.argsort(-gains, kind="stable")  # descending, equal gains in row order
        values = gains[order]
        usable = int((values >= 0).sum())
        b = len(rows)
        gained = np.concatenate([[0.0], values[:usable].cumsum()])
        expected = float(weights.sum()) + gained
        tokens = 1 + np.arange(usable + 1, dtype=np.float64) / b  # tokens fed per row, on average
        cost = self._corrected(b, self._relative(b, tokens, context))
        value = expected / cost
        # The size is chosen with every draft's gain discounted by the margin, so a draft joins only where it beats
        # its own cost by the margin too (at a large batch a row's draft adds little against what its width costs,
        # and one that only breaks even by the model is a loss when the model errs); the set as a whole must beat
        # plain decoding by the margin as before.
        best = int(np.argmax((expected[0] + gained / self.min_gain) / cost))
        if best == 0 or value[best] < self.min_gain * value[0]:
            return [0] * b, float(value[0]), float(expected[0]), 1.0
        # Per row, its drafts among the best `best` (a row's gains fall with j, so they are its first ones).
        counts = np.bincount(order[:best] // self.max_k, minlength=b)
        return counts.tolist(), float(value[best]), float(expected[best]), float(tokens[best])

    def _choose(self, rows, available, classes, context, unread: float = 0.0) -> int:
        ks = np.arange(self.max_k + 1, dtype=np.float64)
        # Expected emitted tokens summed over rows for each k: sum over j = 0..min(k, available) of rate^j.
        terms = self._gains(rows, classes, ks)
        if available is not None:
            terms = np.where(ks[None, :] > np.asarray(available, dtype=np.float64)[:, None], 0.0, terms)
        expected = terms.cumsum(axis=1).sum(0)  # [max_k + 1]
        tokens = ks + 1  # per row, padded to k
        if self.packed and available is not None:  # each row feeds min(k, what it offers) drafts
            offered = np.asarray(available, dtype=np.float64)[:, None]
            tokens = (1 + np.minimum(ks[None, :], offered)).mean(0)
        # The backlog is read once, whatever k: fed with the drafts (so a step's fixed extra is counted once).
        tokens = tokens + (ks > 0) * (unread / self.read_horizon / len(rows))
        value = expected / self._step_price(len(rows), tokens, ks, context)
        best = int(np.argmax(value))
        return best if value[best] >= self.min_gain * value[0] else 0

    def _note(self, rows: int, context: float) -> None:
        """Keeps the latest choice's rows and context (what `idle_explanation` prices) and the most rows seen."""
        self._last = (rows, context)
        self._most_rows = max(self._most_rows, rows)

    def idle_explanation(self, min_steps: int = 32) -> str | None:
        """When k was 0 in most steps (of a call of at least `min_steps` steps) although drafts were on offer, a
        sentence saying why: what verifying and drafting cost and the acceptance estimated at the end; otherwise
        None. Steps where no row had anything to draft (an n-gram lookup with no match) do not count as declined. A
        short answer says too little about acceptance to report on (a few steps of evidence barely move the
        estimate off its prior). Nor does a call whose estimates at its end say drafting pays (it declined while
        they were lower, and drafted once they rose): the reasons, read from those estimates, would contradict
        the sentence ("acceptance 0.67, so drafting was not expected to pay")."""
        idle = self.num_declined
        if self.max_k == 0 or len(self.chosen) < min_steps or 2 * idle <= len(self.chosen):
            return None
        rows, context = self._last
        if self._pays_now(rows, context):
            return None
        verify = self._relative(rows, np.array([2.0, self.max_k + 1.0]), context)
        pooled = self._pooled()
        # Priced at the rows of the call's last steps: where rows ended apart, fewer than the call's batch, said so.
        batch = (f"{rows}" if rows >= self._most_rows
                 else f"{rows} (the rows left at the end of a batch of {self._most_rows})")
        return (f"adaptive k kept drafting off in {idle} of {len(self.chosen)} steps: at batch {batch} a verify of 1 "
                f"draft costs {float(verify[0]):.2f} plain steps and one of {self.max_k} drafts "
                f"{float(verify[1]):.2f}, a drafted token {self.draft_cost_per_token:.2f}, and the acceptance "
                f"estimated from this call is {', '.join(f'{p:.2f}' for p in pooled.tolist())}{self._calibrated()}, "
                f"so drafting was not expected to beat plain decoding by {self.min_gain - 1:.0%}")

    def _calibrated(self) -> str:
        """What the sentence adds where calibration discounts the estimates (the drafts verified fared worse than
        their estimates said): without it, an estimate that pays on its face reads as a contradiction."""
        ratio = self.calibration
        if ratio >= 0.95:
            return ""
        return (f" (the drafts verified were accepted {ratio:.2f} times as often as their estimates said, which "
                "discounts them)")

    def _pays_now(self, rows: int, context: float) -> bool:
        """Whether a step of `rows` rows, each drafting at the best class's pooled estimate (calibrated), would draft
        by the call's estimates as they stand."""
        rate = float(self._pooled().max())
        ks = np.arange(self.max_k + 1, dtype=np.float64)
        gains = np.where(ks > 0, np.minimum(rate ** ks * self.calibration, 1.0), 0.0)
        value = (1 + gains.cumsum(0)) / self._step_price(rows, ks + 1, ks, context)
        return float(value[1:].max()) >= self.min_gain * float(value[0])

    def update(self, rows: list[int], num_drafted: list[int], num_accepted: list[int],
               classes: list[int] | None = None) -> None:
        """Folds one step's outcome into the counts: each row's proposal was of class `classes[i]`."""
        if self.calibrate:
            # Every step, drafted or not, so that evidence fades while drafting is off and the ratio drifts back
            # towards 1, as the acceptance counts drift back to the priors: drafting is tried again later.
            self.expected_accepted *= self.CALIBRATION_DECAY
            self.actual_accepted *= self.CALIBRATION_DECAY
            if any(num_drafted):
                # What the estimates, as they stood when these drafts were chosen, expected of them: sum of p^j.
                rates = self._rates(rows, classes)
                depth = np.arange(1, max(num_drafted) + 1, dtype=np.float64)
                drafted = np.asarray(num_drafted, dtype=np.float64)
                expected = np.where(depth[None, :] > drafted[:, None], 0.0, rates[:, None] ** depth[None, :])
                self.expected_accepted += float(expected.sum())
                self.actual_accepted += float(sum(num_accepted))
        self._accepted *= self.decay
        self._tried *= self.decay
        drafted = np.asarray(num_drafted, dtype=np.float64)
        accepted = np.asarray(num_accepted, dtype=np.float64)
        # Tokens tried: every accepted one, plus the rejected one when a row stopped before its last draft.
        tried = accepted + (accepted < drafted)
        r = np.asarray(rows, dtype=np.intp)
        cls = np.zeros(len(rows), dtype=np.intp) if classes is None else np.asarray(classes, dtype=np.intp)
        self._accepted[r, cls] += accepted  # a step's rows are distinct
        self._tried[r, cls] += tried
