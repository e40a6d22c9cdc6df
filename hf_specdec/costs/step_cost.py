"""What a target forward costs on this host: the fitted curve adaptive k prices a verify with, its static defaults,
and measuring it."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from ..cache.paged import PagedKVCache
from ..runners.dense import make_runner, runner_attention
from ..runners.model_runner import ModelRunner, input_device
from ..runners.support import check_model_supported
from .timing import ATTEMPTS, BOUND, FLOOR, Timer, measure_repeated, name, out_of_bounds, timed_round, wall_timer


@dataclass(frozen=True)
class StepCost:
    """Wall time of one target forward of `rows` rows of `tokens` new tokens each over `context` cached tokens in
    all, in milliseconds (or any unit): `per_row * rows + per_context_token * context + curve(rows * tokens)`, where
    `curve` is piecewise linear through `points` (total tokens, time), extended at its average rate.
    `StepCost.measure(model)` fits one to the machine at hand.

    Args:
        per_row (`float`): the cost each row adds (bookkeeping, kernel launches).
        points (`tuple[tuple[float, float], ...]`): `(total tokens, time)` pairs, tokens ascending, times not
            decreasing.
        per_context_token (`float`): the cost of each cached token attended to (summed over the rows).
    """

    per_row: float
    points: tuple[tuple[float, float], ...]
    per_context_token: float = 0.0

    def __post_init__(self):
        tokens = [n for n, _ in self.points]
        times = [t for _, t in self.points]
        if len(self.points) < 2 or tokens != sorted(set(tokens)) or times != sorted(times) or times[0] <= 0:
            raise ValueError(f"StepCost needs at least two (tokens, time) points with tokens ascending and times "
                             f"positive and not decreasing, got {self.points!r}")
        # Tuples (`at` bisects them), and the points as arrays, built once: the policy prices several steps per
        # decode step.
        object.__setattr__(self, "points", tuple((float(n), float(t)) for n, t in self.points))
        object.__setattr__(self, "_xs", np.array(tokens, dtype=np.float64))
        object.__setattr__(self, "_ys", np.array(times, dtype=np.float64))

    def pessimistic(self, factor: float = 2.0) -> StepCost:
        """The same cost with every token past a forward's first costing `factor` times as much: what a host that
        was never measured prices verification with, where drafting that loses to plain decoding is worse than
        drafting less (a head on a CPU whose multi-token forwards cost more than the static curve says)."""
        first = self.points[0][1]
        return StepCost(self.per_row, tuple((n, first + factor * (t - first)) for n, t in self.points),
                        self.per_context_token)

    def __call__(self, rows: int, tokens: torch.Tensor, context: float = 0.0) -> torch.Tensor:
        return torch.as_tensor(self.costs(rows, _array(tokens), context))

    def costs(self, rows: int, tokens: np.ndarray, context: float = 0.0) -> np.ndarray:
        """`self(rows, tokens, context)` over a numpy array of tokens per row (what adaptive k computes with)."""
        xs, ys = self._xs, self._ys
        n = np.maximum(rows * tokens, xs[0])
        i = np.clip(np.searchsorted(xs, n) - 1, 0, len(xs) - 2)
        inside = ys[i] + (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) * (n - xs[i])
        # Past the last point, time grows at the curve's average rate (its last segment may be flat).
        beyond = ys[-1] + (ys[-1] - ys[0]) / (xs[-1] - xs[0]) * (n - xs[-1])
        return self.per_row * rows + self.per_context_token * context + np.where(n > xs[-1], beyond, inside)

    def at(self, rows: int, tokens: float, context: float = 0.0) -> float:
        """`self(rows, tokens, context)` for one number of tokens per row, in plain floats (no tensor ops)."""
        points = self.points
        n = max(rows * tokens, points[0][0])
        (x0, y0), (x1, y1) = points[0], points[-1]
        if n > x1:
            curve = y1 + (y1 - y0) / (x1 - x0) * (n - x1)
        else:
            i = min(max(bisect.bisect_left(points, (n,)) - 1, 0), len(points) - 2)
            (xa, ya), (xb, yb) = points[i], points[i + 1]
            curve = ya + (yb - ya) / (xb - xa) * (n - xa)
        return self.per_row * rows + self.per_context_token * context + curve

    def relative(self, rows: int, tokens: torch.Tensor, context: float = 0.0) -> torch.Tensor:
        """Cost of forwards of `tokens` per row relative to a plain decode step (1 token per row), over `context`
        cached tokens in all."""
        return torch.as_tensor(self.relative_costs(rows, _array(tokens), context))

    def relative_costs(self, rows: int, tokens: np.ndarray, context: float = 0.0) -> np.ndarray:
        """`relative` over a numpy array."""
        return self.costs(rows, tokens, context) / self.at(rows, 1.0, context)

    @classmethod
    def measure(cls, model, rows: tuple[int, ...] = (1, 4, 16), tokens: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16),
                contexts: tuple[int, ...] = (64, 256), repeats: int = 5) -> StepCost:
        """Times target forwards through the paged KV cache (random token ids, each of `contexts` tokens cached per
        row; interleaved and repeated, see `timing.py`) and fits a `StepCost` (`fit`). Takes under a minute on a
        CPU; pass the result to `generate(..., speculative_step_cost=...)`. Logs a warning when the timings
        disagree or break the physical bounds (a busy host); `hf-specdec calibrate` then keeps the static default."""
        import logging


        step_cost, measurement = measure_step_cost(model, rows, tokens, contexts, repeats)
        if measurement.problem is not None:
            logging.getLogger("hf_specdec").warning(f"StepCost.measure: not trustworthy ({measurement.problem})")
        return step_cost

    @classmethod
    def fit(cls, samples: list[tuple[int, int, int, float]]) -> StepCost:
        """Fits a `StepCost` to `(rows, total new tokens, total cached tokens, time)` samples by least squares
        (`time = per_row * rows + per_context_token * cached + curve[total]`), then makes the curve non-decreasing
        (`_non_decreasing`)."""
        totals = sorted({n for _, n, _, _ in samples})
        a = torch.zeros(len(samples), 2 + len(totals), dtype=torch.float64)
        y = torch.tensor([t for *_, t in samples], dtype=torch.float64)
        # Timed over one context length per row, cached tokens grow with rows alone: the two costs cannot be told
        # apart, and the split a least-squares fit makes would price every cached token of a long call by what rows
        # cost. The rows then carry it, and a cached token costs nothing more.
        one_context = len({c / b for b, _, c, _ in samples}) == 1
        for i, (b, n, c, _) in enumerate(samples):
            a[i, 0], a[i, 1] = b, 0.0 if one_context else c
            a[i, 2 + totals.index(n)] = 1.0
        # A light pull of the per-row and per-context costs towards 0 keeps the system solvable when no total was
        # timed at two batch sizes or two context lengths.
        ridge = torch.zeros(2, a.shape[1], dtype=torch.float64)
        ridge[0, 0] = ridge[1, 1] = 1e-3
        solution = torch.linalg.lstsq(torch.cat([a, ridge]), torch.cat([y, torch.zeros(2, dtype=torch.float64)]))
        per_row = max(0.0, float(solution.solution[0]))
        per_context_token = max(0.0, float(solution.solution[1]))
        curve = _non_decreasing(solution.solution[2:].clamp(min=1e-6).tolist())
        if len(totals) == 1:
            totals, curve = totals + [totals[0] + 1], curve + curve
        return cls(per_row=per_row, points=tuple(zip(map(float, totals), curve)), per_context_token=per_context_token)


def _non_decreasing(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in least squares (pooling adjacent violators: a run of values
    that falls is replaced by its mean). Totals are timed at different row counts, and a total timed at one row can
    cost as much as or more than a larger one timed at more rows (SmolLM2-135M on a 2-core AMD EPYC over 32 cached
    tokens: 1 row x 3 tokens 42.5 ms, 4 rows x 1 token 41.9 ms): raising the later value to the earlier one, as a
    running maximum does, prices the 4-row plain step at the 1-row verify's cost, and every 4-row verify too cheap
    against it."""
    blocks: list[list[float]] = []  # [sum, count]
    for value in values:
        blocks.append([value, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


class MeasuredStepCost:
    """A `StepCost` corrected by the wall times of the steps it prices.

    Each observed step (its rows `B`, tokens fed `N` of which `D` are drafts, cached tokens `C`, and the time of its
    target forward and verify) is fitted as `t = s * base(B, 1, C) + m * (base(B, (N - D) / B, C) - base(B, 1, C)) +
    w * D + o * [D > 0]`: `s` puts the base curve in this host's units, `m` scales what other tokens beyond one per
    row cost (newcomers' prompts; a profile taken on an idle host at other batch sizes can be off by half), `w` is
    what a draft token costs and `o` what a step with drafts costs beyond its tokens (a ragged step's attention and
    packing, the verify). Drafts are priced per token, not by the curve: a CPU's curve, measured at a few widths,
    climbs in steps, and on its flat stretches it calls a few drafts free when each costs a few percent of a loaded
    step (`benchmarks/draft_pricing.py`). Weighted least squares with counts that decay each step, so the fit follows
    the load; a light prior holds `m = s`, `w = s` times the curve's average price of a token and `o = 0` until
    steps say otherwise. Used only once `min_steps` steps were seen. `relative` then answers as `StepCost.relative`
    does, for steps whose tokens beyond one per row are drafts.

    Args:
        base (`StepCost`): the curve whose shape is kept.
        decay (`float`): factor on the counts per observed step (0.98: about the last 50 steps weigh).
        min_steps (`int`): steps to see before the fit is used.
        prior_steps (`float`): how many observed steps the prior weighs, each at a quarter of a plain step's extra
            cost (for `m`), a step of 4 drafts at that price (for `w`) or 1 unit of time (for `o`).
    """

    # Once the fit is in use, a step further from its prediction (relatively) than OUTLIER times the typical
    # relative error, and than OUTLIER_FLOOR, weighs the limit over its error (Huber's weights: its residual counts
    # as if clipped to the limit).
    OUTLIER, OUTLIER_FLOOR = 4.0, 0.15

    def __init__(self, base: StepCost, decay: float = 0.98, min_steps: int = 16, prior_steps: float = 2.0):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.base = base
        self.decay = decay
        self.min_steps = min_steps
        self.prior_steps = prior_steps
        # The curve's average price of one more token, end to end: the prior's price of a draft token.
        (x0, y0), (x1, y1) = base.points[0], base.points[-1]
        self.token_price = (y1 - y0) / (x1 - x0)
        # numpy on the host, as adaptive k's arithmetic: a step's update is a few operations on 4x4 numbers.
        self.gram = np.zeros((4, 4))
        self.moment = np.zeros(4)
        self.weight = 0.0  # observations, decayed
        self.steps = 0  # observations, all
        self.skipped = 0  # steps not fitted (prefills)
        self.typical_error = 0.05  # a step's relative distance from the fit, on average (outliers clipped)
        self._params: tuple[float, float, float, float] | None = None
        self._stale = False

    def observe(self, rows: int, tokens_fed: int, context: float, draft_tokens: int, seconds: float) -> None:
        """One step: `rows` rows fed `tokens_fed` tokens in all, `draft_tokens` of them drafts, over `context`
        cached tokens, in `seconds`. A step whose other tokens beyond one per row outnumber its rows (newcomers'
        prompts: a prefill, which the curve prices by extrapolation, with the engine's first allocations in the
        first one) is not fitted: its error would land on the drafts' price, and drafts are priced for decode
        steps."""
        if tokens_fed - draft_tokens - rows > rows:
            self.skipped += 1
            return
        plain = self.base.at(rows, 1.0, context)
        other = self.base.at(rows, (tokens_fed - draft_tokens) / rows, context) - plain
        x = np.array([plain, other, float(draft_tokens), float(draft_tokens > 0)])
        y = seconds * 1e3
        weight = 1.0
        if self.ready:
            # A step far off the fit (a pause of the host, a collection) counts less, in proportion: a few drafts
            # weigh as much as the whole prior on their price, so one such step would set it for a hundred steps.
            predicted = float(x @ np.array(self.params))
            error = abs(y - predicted) / max(predicted, 1e-9)
            limit = max(self.OUTLIER_FLOOR, self.OUTLIER * self.typical_error)
            weight = min(1.0, limit / max(error, 1e-12))
            self.typical_error = 0.95 * self.typical_error + 0.05 * min(error, limit)
        self.gram = self.gram * self.decay + weight * np.outer(x, x)
        self.moment = self.moment * self.decay + weight * (x * y)
        self.weight = self.weight * self.decay + weight
        self.steps += 1
        self._stale = True

    @property
    def ready(self) -> bool:
        return self.steps >= self.min_steps and self.params is not None

    @property
    def params(self) -> tuple[float, float, float, float] | None:
        """`(s, m, w, o)`, or None before any step or when the fit is degenerate (`s <= 0`)."""
        if self._stale:
            self._stale = False
            self._params = self._fit()
        return self._params

    def _fit(self) -> tuple[float, float, float, float] | None:
        if self.weight == 0.0:
            return None
        # The prior in the data's own units: a quarter of a plain step's base cost for `m`, steps of 4 drafts for
        # `w` (below), 1 ms for `o`.
        ref = 0.0625 * float(self.gram[0, 0]) / self.weight
        prior = np.zeros((4, 4))
        prior[0, 0] = prior[1, 1] = self.prior_steps * ref
        prior[0, 1] = prior[1, 0] = -self.prior_steps * ref  # (m - s)^2
        # (w - price * s)^2, weighed like `prior_steps` steps of 4 drafts each (least squares counts a step's drafts
        # squared): the first steps with drafts outweigh it; one far off the fit is damped in `observe`.
        price, drafts = self.token_price, 16 * self.prior_steps
        prior[0, 0] += drafts * price ** 2
        prior[2, 2] = drafts
        prior[0, 2] = prior[2, 0] = -drafts * price
        prior[3, 3] = self.prior_steps
        try:
            s, m, w, o = np.linalg.solve(self.gram + prior, self.moment).tolist()
        except np.linalg.LinAlgError:  # singular: nothing informative seen yet
            return None
        if not s > 0:
            return None
        return s, max(m, 0.0), max(w, 0.0), max(o, 0.0)

    def relative(self, rows: int, tokens: torch.Tensor, context: float = 0.0) -> torch.Tensor:
        """The cost of a step whose rows feed `tokens` each on average, every one past the first a draft, relative
        to a plain step."""
        return torch.as_tensor(self.relative_costs(rows, _array(tokens), context))

    def relative_costs(self, rows: int, tokens: np.ndarray, context: float = 0.0) -> np.ndarray:
        """`relative` over a numpy array."""
        s, _, w, o = self.params
        plain = s * self.base.at(rows, 1.0, context)
        drafts = np.maximum(tokens - 1, 0.0) * rows
        return (plain + w * drafts + o * (drafts > 0)) / plain


def _array(tokens) -> np.ndarray:
    """Tokens per row (a tensor, a number or a sequence) as a float64 numpy array."""
    if isinstance(tokens, torch.Tensor):
        return tokens.detach().to("cpu", torch.float64).numpy()
    return np.asarray(tokens, dtype=np.float64)


# What a call that measured nothing prices verification with. The CPU curve is timed as such a call runs: with the
# stock linear forms (no profile), `HF_SPECDEC_CALIBRATION=off python benchmarks/step_cost.py --threads 2`, SmolLM2-135M
# in float32 on a 2-core AMD EPYC (batch 1/4/16, 1-16 tokens per row, 64 and 256 tokens of context; 2026-12-07). There
# a forward of 2 tokens costs 1.55 plain steps at batch 1 (the stock product is slow at 2-8 rows) and one of 3-11
# tokens hardly more; at 4 rows and more the curve climbs in steps as the matrix kernels change shape. The curve it
# replaced was timed with this host's faster forms in place and priced a second token free, so n-gram drafted short
# matches on open chat at a loss without a profile (0.92x speculation off, docs/benchmarks.md). A CPU with no profile
# prices verification at twice this curve's extra cost (`calibration.static_step_cost`). On accelerators a forward of
# a few hundred tokens costs about as much as one of a single token. `hf-specdec calibrate` and a first call
# (calibration.py) measure this host's own.
DEFAULT_STEP_COST = {
    "cpu": StepCost(per_row=0.0, per_context_token=0.0132, points=(
        (1, 66.4), (2, 103.3), (3, 103.3), (4, 103.3), (6, 107.0), (8, 107.0), (12, 108.1), (16, 115.0), (24, 134.0),
        (32, 161.3), (48, 207.9), (64, 232.2), (96, 313.5), (128, 381.0), (192, 528.8), (256, 681.1))),
    "cuda": StepCost(per_row=0.0, points=((1.0, 1.005), (1024.0, 6.12))),
}

# The same host and grid timed with its own faster linear forms in place (2026-11): what a CPU call prices with when
# its profile holds this host's forms but no trusted step cost (the forms and the step cost are judged apart; a noisy
# moment can reject the one and keep the other). With those forms a second token at batch 1 costs next to nothing;
# priced by the stock curve instead, a head's drafts never paid (a fresh `hf-specdec run` whose step cost was found
# unsteady, 2026-12-08: the head drafted nothing on either prompt).
HOST_FORMS_CPU_STEP_COST = StepCost(per_row=0.0, per_context_token=0.00925, points=(
    (1, 43.7), (2, 43.7), (3, 44.9), (4, 64.2), (6, 70.8), (8, 84.3), (12, 93.0), (16, 93.0), (24, 98.6),
    (32, 111.3), (48, 133.4), (64, 161.3), (96, 208.5), (128, 229.0), (192, 302.7), (256, 391.5)))


def check_step_times(medians: dict[tuple, float]) -> str | None:
    """A forward of b rows x q tokens against b rows x 1 token and 1 row x 1 token over the same context."""
    for key, cost in medians.items():
        _, b, q, c = key
        for other, work in (((b, 1, c), q), ((1, 1, c), b * q)):
            if other != (b, q, c) and ("step", *other) in medians:
                problem = out_of_bounds(cost, work, medians[("step", *other)], name(key))
                if problem:
                    return problem
    return None


def check_step_cost(step_cost, rows: tuple[int, ...] = (1, 4, 16), tokens: tuple[int, ...] = (2, 3, 4, 8),
                    context_per_row: int = 128) -> str | None:
    """The same bound on a fitted `StepCost`: a forward of q tokens per row within [FLOOR, BOUND * q] plain
    steps (a fitted curve can stray where no timing pinned it, and a cached file can have been edited)."""
    for b in rows:
        relative = step_cost.relative(b, torch.tensor(tokens, dtype=torch.float64), b * context_per_row).tolist()
        for q, r in zip(tokens, relative):
            if not FLOOR <= r <= BOUND * q:
                return (f"a forward of {q} tokens per row at batch {b} is priced at {r:.2f} plain steps, outside "
                        f"the physical range [{FLOOR:.2f}, {BOUND * q:.2f}]")
    return None


# The target's step cost ---------------------------------------------------------------------------------------------
def measure_step_cost(model, rows: tuple[int, ...], tokens: tuple[int, ...] | dict[int, tuple[int, ...]],
                      contexts: tuple[int, ...], repeats: int, timer: Timer | None = None, attempts: int = ATTEMPTS):
    """Times target forwards through the model's KV cache (paged, or masked: `dense.make_runner`) with random
    token ids, `contexts` tokens cached per row (`fill_context`), every (rows, tokens, context) cell once per round,
    and fits a `StepCost`. Each cell's rows sit in regions of the pool, as `generate` places them, and several rows of
    more than one token a row are fed as verifies come where the model packs ragged steps (`verify_counts`).
    `tokens`: the new tokens per row timed at every row count, or a dict giving them per row count. Returns
    `(step cost, Measurement)`; the measurement's `problem` says why the cost is not to be trusted."""

    check_model_supported(model)  # its trial decides whether ragged steps go packed (once per model)
    vocab = model.config.get_text_config().vocab_size
    device = input_device(model)  # not model.device: `meta` for a model offloaded to disk
    timer = timer or wall_timer(device)
    runners, cells = {}, {}
    with torch.no_grad(), runner_attention(model):
        per_rows = tokens if isinstance(tokens, dict) else dict.fromkeys(rows, tokens)
        if set(per_rows) != set(rows):
            raise ValueError(f"tokens per row count must name exactly the row counts timed {tuple(rows)}, got "
                             f"{sorted(per_rows)}; pass one tuple of token counts for every row count, or a dict "
                             "with one entry per row count")
        for b, c in ((b, c) for c in contexts for b in rows):
            width = max(max(verify_counts(b, q, True)) for q in per_rows[b])  # the widest row, packed or not
            runner = runners[b, c] = make_runner(model, num_blocks=b * (c + width) // 16 + 2 * b + 1)
            for seq in range(b):
                runner.add_sequence(seq)
            if hasattr(runner, "give_regions"):  # as `generate` places its rows: regions of the pool, read in place
                runner.give_regions(list(range(b)), -(-(c + width) // 16) * 16)
            fill_context(runner, b, c, vocab, device)
            for q in per_rows[b]:
                counts = verify_counts(b, q, getattr(runner, "packed", False))
                ids = torch.randint(vocab, (b, max(counts)), device=device)
                # Logits as a greedy verify takes them: a packed step's left packed (`packed_logits`); a sampled
                # one also spreads them to `[rows, k + 1, vocab]`, a copy not priced here.
                cells["step", b, q, c] = lambda runner=runner, ids=ids, b=b, counts=counts: runner.forward(
                    list(range(b)), ids, counts, max(counts), logit_counts=counts, packed_logits=True)

        def rollback(key):
            _, b, _, c = key
            for seq in range(b):
                runners[b, c].rollback(seq, c)

        timed_round(cells, lambda key, fn: fn(), after=rollback)  # warm-up
        measurement = measure_repeated(lambda i: timed_round(cells, timer, i * 7, rollback), repeats,
                                       check_step_times, attempts)
    samples = [(b, b * q, b * c, 1000 * t) for (_, b, q, c), t in measurement.medians.items()]
    step_cost = StepCost.fit(samples)
    if measurement.problem is None:
        measurement.problem = check_step_cost(step_cost, rows)
    return step_cost, measurement


def verify_counts(rows: int, tokens: int, packed: bool) -> list[int]:
    """The tokens each row feeds in a timed forward of `rows x tokens` tokens in all. Where ragged steps go packed,
    a forward of several rows and more than one token a row is timed as verifies come: the extra tokens on the first
    half of the rows, the others feeding one (3, 3, 1, 1 for 4 x 2). A packed ragged step costs more than a uniform one
    of as many tokens (its attention runs per group of rows of one width): on a 2-core AMD EPYC, SmolLM2-135M at 4 rows
    over 32 cached tokens, 51.6 ms against 48.0 for 2 each and 44.4 for 1 each; a batch-4 decode's verifies cost 1.20
    plain steps where a curve through uniform forwards priced 1.10 (docs/benchmarks.md)."""
    if not packed or rows == 1 or tokens == 1:
        return [tokens] * rows
    half = (rows + 1) // 2
    extra, spare = divmod(rows * (tokens - 1), half)
    return [1 + extra + (i < spare) for i in range(half)] + [1] * (rows - half)


def fill_context(runner, rows: int, context: int, vocab: int, device) -> None:
    """Gives rows `0 .. rows - 1` of a fresh runner `context` cached tokens each. A forward's time depends on how many
    tokens it attends to, not on what they hold, so a paged cache only reserves them (its keys and values stay zero)
    instead of computing a prefill of `rows x context` tokens (16 x 32 tokens: 0.6 s of a first call's 5 s on a
    2-core CPU); other caches (recurrent layers, LongRoPE's per-row rotation, a dense runner) are filled by a
    forward."""
    if isinstance(runner, ModelRunner) and type(runner.cache) is PagedKVCache and runner.rope is None:
        runner.cache.reserve(list(range(rows)), [context] * rows)
        return
    runner.forward(list(range(rows)), torch.randint(vocab, (rows, context), device=device), [context] * rows, 1)
