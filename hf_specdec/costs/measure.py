"""Timing this host's costs so that one noisy moment cannot poison them (calibration.py caches what passes).

A loaded host (other processes, a throttled CPU) slows some timings and not others, and a profile fitted to them
prices drafting wrongly for every later call: one measured under load priced a 1-draft verify at 4.6 plain steps.
So every measurement here is
- interleaved: a round times every cell once (each (rows, tokens, context) forward; each linear row count in both
  forms, side by side), so a slow moment hits a round rather than one cell, and the median over rounds is kept;
- repeated and checked: when a cell's repeats disagree (the middle ones differ by more than `SPREAD`) the whole grid
  is measured again, up to `attempts` times in all;
- bounded by physics: a forward of B rows of q tokens does at most the work of B * q one-token forwards (it reads
  the weights once instead of B * q times), so it may cost at most `BOUND` times that much, and no less than
  `FLOOR` times a one-token forward (not 1: on some hosts a one-row product runs a slower kernel than a few rows,
  e.g. MKL on an AMD EPYC, where a 4-token forward took 0.76 of a one-token one); the same holds for a linear layer
  over r rows.
What still fails comes back as `Measurement.problem`, and the caller keeps the static default instead. Timings go
through a `Timer`, `timer(key, fn) -> seconds`, which tests replace with made-up numbers.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SPREAD = 1.3  # the middle repeats of one timing may differ by at most this factor
BOUND = 1.25  # slack on the physical bounds above
FLOOR = 0.5  # the least a forward of more tokens (or a linear layer over more rows) may cost, in one-token ones
ATTEMPTS = 2  # measurements of a grid before giving up on it

Timer = Callable[[tuple, Callable[[], object]], float]


def wall_timer(device: torch.device) -> Timer:
    """Times `fn()` by the wall clock, waiting for `device` before and after."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timer(key: tuple, fn: Callable[[], object]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start
    return timer


@dataclass
class Measurement:
    """Medians of repeated timings, and why they cannot be trusted (`problem`; None when they can)."""

    medians: dict[tuple, float]
    problem: str | None = None
    attempts: int = 1


def spread(values: list[float]) -> float:
    """How far a timing's middle repeats lie apart (the lowest and highest quarter left out), as a ratio."""
    low, high = _middle(values)
    return high / max(low, 1e-12)


def _middle(values) -> tuple[float, float]:
    """The lowest and highest of the middle repeats (the lowest and highest quarter left out)."""
    values = sorted(values)
    cut = len(values) // 4
    return values[cut], values[-1 - cut]


def name(key: tuple) -> str:
    if key[0] == "step":
        return f"a forward of {key[1]} row(s) x {key[2]} token(s) over {key[3]} cached"
    if key[0] == "linear":
        return f"a {key[2]}-row linear layer ({key[1]} form)"
    if key[0] == "packed":
        return f"a {key[2]}-row linear layer of shape {key[3]} ({key[1]} form)"
    return "a drafted token's cost" if key == ("draft",) else " ".join(map(str, key))


def _show(key: tuple, value: float) -> str:
    return f"{value:.4g} plain steps" if key == ("draft",) else f"{1000 * value:.4g} ms"


def _disagreement(samples: dict[tuple, list[float]]) -> str | None:
    spreads = {key: spread(values) for key, values in samples.items() if len(values) >= 3}
    noisy = [key for key, s in spreads.items() if s > SPREAD]
    if not noisy:
        return None
    worst = max(noisy, key=spreads.get)
    values = sorted(samples[worst])
    return (f"{len(noisy)} of {len(samples)} timings disagree between repeats (worst: {name(worst)}, "
            f"{_show(worst, values[0])} to {_show(worst, values[-1])}; at most {SPREAD}x apart is accepted)")


def measure_repeated(run_round: Callable[[int], dict[tuple, float]], repeats: int,
                     check: Callable[[dict[tuple, float]], str | None] | None = None,
                     attempts: int = ATTEMPTS,
                     agree: Callable[[dict[tuple, list[float]]], str | None] | None = None) -> Measurement:
    """Runs `repeats` rounds (`run_round(i) -> {key: seconds}`) and keeps each key's median, when the repeats agree
    (`agree(samples)` says why not; by default no key's middle repeats may lie more than `SPREAD` apart) and
    `check(medians)` finds nothing implausible; otherwise measures all again, `attempts` times in all."""
    agree = agree or _disagreement
    for attempt in range(1, attempts + 1):
        samples: dict[tuple, list[float]] = {}
        for i in range(repeats):
            for key, value in run_round(i).items():
                samples.setdefault(key, []).append(value)
        medians = {key: statistics.median(values) for key, values in samples.items()}
        problem = agree(samples) or (check(medians) if check is not None else None)
        if problem is None:
            return Measurement(medians, None, attempt)
    return Measurement(medians, f"{problem}; measured {attempts} time(s)", attempts)


def timed_round(cells: dict[tuple, Callable[[], object]], timer: Timer, start: int = 0,
                after: Callable[[tuple], None] | None = None) -> dict[tuple, float]:
    """Times each cell once, beginning with the `start`-th (rounds rotate so no cell always comes first); `after`
    runs untimed after each."""
    keys = list(cells)
    start %= max(len(keys), 1)
    out = {}
    for key in keys[start:] + keys[:start]:
        out[key] = timer(key, cells[key])
        if after is not None:
            after(key)
    return out


def _out_of_bounds(cost: float, work: float, unit: float, what: str) -> str | None:
    """`cost` of `work` times the work that costs `unit`: physical when within [FLOOR * unit, BOUND * work * unit]."""
    if cost > BOUND * work * unit or cost < FLOOR * unit:
        return (f"{what} took {cost / unit:.2f} times the one-token (one-row) cost, outside the physical range "
                f"[{FLOOR:.2f}, {BOUND * work:.2f}]")
    return None


def check_step_times(medians: dict[tuple, float]) -> str | None:
    """A forward of b rows x q tokens against b rows x 1 token and 1 row x 1 token over the same context."""
    for key, cost in medians.items():
        _, b, q, c = key
        for other, work in (((b, 1, c), q), ((1, 1, c), b * q)):
            if other != (b, q, c) and ("step", *other) in medians:
                problem = _out_of_bounds(cost, work, medians[("step", *other)], name(key))
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
def measure_step_cost(model, rows: tuple[int, ...], tokens: tuple[int, ...], contexts: tuple[int, ...],
                      repeats: int, timer: Timer | None = None, attempts: int = ATTEMPTS):
    """Times target forwards through the model's KV cache (paged, or masked: `dense_runner.make_runner`) with random
    token ids, `contexts` tokens cached per row, every (rows, tokens, context) cell once per round, and fits a
    `StepCost`. Returns `(step cost, Measurement)`; the
    measurement's `problem` says why the cost is not to be trusted."""
    from .adaptive import StepCost
    from ..runners.dense import make_runner, runner_attention
    from ..runners.model_runner import input_device

    vocab = model.config.get_text_config().vocab_size
    device = input_device(model)  # not model.device: `meta` for a model offloaded to disk
    timer = timer or wall_timer(device)
    runners, cells = {}, {}
    with torch.no_grad(), runner_attention(model):
        for b, c in ((b, c) for c in contexts for b in rows):
            runner = runners[b, c] = make_runner(model, num_blocks=b * (c + max(tokens)) // 16 + 2 * b + 1)
            for seq in range(b):
                runner.add_sequence(seq)
            runner.forward(list(range(b)), torch.randint(vocab, (b, c), device=device), [c] * b, 1)
            for q in tokens:
                ids = torch.randint(vocab, (b, q), device=device)
                cells["step", b, q, c] = lambda runner=runner, ids=ids, b=b, q=q: runner.forward(
                    list(range(b)), ids, [q] * b, q)

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


# The small-row linear form ------------------------------------------------------------------------------------------
def thin_linear_candidate(module: torch.nn.Module) -> bool:
    """Whether a module is a plain full-precision `torch.nn.Linear` whose product runs on the CPU: its weight is
    there, or accelerate's hook brings it there (an offloaded layer's weight sits on `meta` until the hook streams it
    in for the forward). Quantized and wrapped layers are not."""
    if not (type(module) is torch.nn.Linear and type(module.weight) is torch.nn.Parameter
            and module.weight.is_floating_point()):
        return False
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    return torch.device(device if device is not None else module.weight.device).type == "cpu"


def measure_thin_linear(model, rows: tuple[int, ...], margin: float, repeats: int = 5, timer: Timer | None = None,
                        attempts: int = ATTEMPTS
                        ) -> tuple[tuple[int, ...], dict, str | None, dict[tuple[int, int], tuple[int, ...]]]:
    """Times the model's linear layers (each weight shape, weighted by how many layers have it) over `rows` input
    rows as `F.linear` ("stock") and as `(W @ x.T).T` made row-major ("thin"), the two forms side by side in each
    round; returns the row counts where thin took at most `margin` of stock's time, the timings, and why they are
    not to be trusted (None when they are). The choice rests on each round's ratio of the pair (thin over stock), not on absolute
    times: load that comes and goes slows both forms of a pair alike. A row count gets the thin form only where
    every middle round (the lowest and highest quarter left out) chose it; elsewhere it keeps the stock form. The
    same choice is made for each weight shape alone (the fourth value: every shape -> the row counts where thin won
    for it, empty where it never did),
    as the forms' speeds differ by shape: on an AMD EPYC with MKL the thin form is 1.6-2.9x faster for an LM head's
    `[vocab, hidden]` weight from 2 rows up, and slower for the layers' at 6-12 rows."""
    from ..runners.model_runner import input_device

    layers = [m for m in model.modules() if thin_linear_candidate(m)]
    device = input_device(model)  # not model.device: `meta` when the first weights live on disk
    if device.type != "cpu" or not layers:
        return (), {}, None, {}
    timer = timer or wall_timer(device)
    shapes = Counter(tuple(m.weight.shape) for m in layers)
    # A layer offloaded to disk has its weight on `meta` until its forward streams it in: time a stand-in of the
    # same shape and dtype (the product's cost does not depend on the values).
    weights = {tuple(m.weight.shape): m.weight for m in layers if m.weight.device.type == "cpu"}
    for shape, m in {tuple(m.weight.shape): m for m in layers}.items():
        if shape not in weights:
            weights[shape] = torch.randn(shape, dtype=m.weight.dtype)
    cells = {}
    with torch.no_grad():
        for r in rows:
            for shape in shapes:
                w, x = weights[shape], torch.randn(r, shape[1], dtype=weights[shape].dtype)
                reps = min(shapes[shape], 8)  # a few products per timing: one alone is too short to time well
                cells["linear", "stock", r, shape] = lambda w=w, x=x, reps=reps: [F.linear(x, w) for _ in range(reps)]
                cells["linear", "thin", r, shape] = lambda w=w, x=x, reps=reps: [(w @ x.t()).t().contiguous()
                                                                                 for _ in range(reps)]

        rounds: list[dict[tuple, float]] = []  # this attempt's totals per (form, rows), round by round

        def run_round(i: int) -> dict[tuple, float]:
            keys = list(cells)
            if i % 2:  # each pair side by side, and each form first in every other round
                keys = [keys[j ^ 1] for j in range(len(keys))]
            times = timed_round({key: cells[key] for key in keys}, timer)
            totals: dict[tuple, float] = {}
            for (_, form, r, shape), t in times.items():
                totals["linear", form, r] = totals.get(("linear", form, r), 0.0) + t * shapes[shape] / min(
                    shapes[shape], 8)
            if i == 0:
                rounds.clear()
            rounds.append(totals)
            # What is compared is each round's pair, timed side by side: load that slows both forms cancels out.
            ratios = {("linear", "thin / stock", r): totals["linear", "thin", r] / totals["linear", "stock", r]
                      for r in rows}
            ratios.update({("linear", "thin / stock", r, shape): times["linear", "thin", r, shape]
                           / times["linear", "stock", r, shape] for r in rows for shape in shapes})
            return ratios

        def absolute() -> dict[tuple, float]:
            return {key: statistics.median(t[key] for t in rounds) for key in rounds[0]}

        def check(ratios):
            medians = absolute()
            best = {r: min(medians["linear", "stock", r], medians["linear", "thin", r]) for r in rows}
            for r in rows:
                problem = _out_of_bounds(best[r], r, best[min(rows)], f"the faster form over {r} rows")
                if problem:
                    return problem
            return None

        chosen: dict[int, bool] = {}

        def same_choice(samples):  # the ratio may wander: a row count is chosen where every middle round chose it
            chosen.clear()
            chosen.update({key[2:]: _middle(ratios)[1] <= margin for key, ratios in samples.items()})
            return None

        timed_round(cells, lambda key, fn: fn())  # warm-up
        measurement = measure_repeated(run_round, repeats, check, attempts, agree=same_choice)
        medians = absolute()
    stock = {r: medians["linear", "stock", r] for r in rows}
    thin = {r: medians["linear", "thin", r] for r in rows}
    ratio = {r: measurement.medians["linear", "thin / stock", r] for r in rows}
    faster = tuple(r for r in rows if chosen.get((r,), False))
    by_shape = {shape: tuple(r for r in rows if chosen.get((r, shape), False)) for shape in shapes}
    details = {"linear_ms": {str(r): [round(1000 * stock[r], 3), round(1000 * thin[r], 3)] for r in rows},
               "linear_thin_over_stock": {str(r): round(ratio[r], 3) for r in rows},
               "linear_thin_over_stock_by_shape": {
                   "x".join(map(str, shape)): {str(r): round(measurement.medians["linear", "thin / stock", r, shape], 3)
                                               for r in rows} for shape in shapes},
               "linear_attempts": measurement.attempts}
    return faster, details, measurement.problem, by_shape


def packed_linear_supported(weight: torch.Tensor) -> bool:
    """Whether oneDNN can multiply by `weight` in a packed layout here: a float32 CPU weight, torch built with
    oneDNN."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered once into oneDNN's blocked layout (a copy, opaque: only `packed_linear` reads it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, W, bias)` with `W` packed by `pack_linear_weight`: the product runs without repacking the
    weight, which is what the stock call spends most of its time on at a few rows."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def measure_packed_linear(model, rows: tuple[int, ...], margin: float, forms: dict[tuple[int, int], list[bool]],
                          repeats: int = 5, timer: Timer | None = None, attempts: int = ATTEMPTS
                          ) -> tuple[dict[tuple[int, int], tuple[int, ...]], dict, str | None]:
    """Times each weight shape of the model's float32 CPU linear layers over `rows` input rows in the packed form
    (`packed_linear`) against the form chosen without it (`forms`: shape -> `thin_row_table`, thin where True),
    side by side in each round. Returns, per shape, the row counts where the packed form took at most `margin` of
    the other's time in every middle round (empty where it never did), the timings, and why they are not to be
    trusted (None when they are). Measured on an AMD EPYC with MKL: 2-3x faster for SmolLM2's LM head from 1 row,
    about 2x for its layers over 2-8 rows."""
    from ..runners.model_runner import input_device

    layers = [m for m in model.modules() if thin_linear_candidate(m) and packed_linear_supported(m.weight)
              and getattr(m, "_hf_hook", None) is None]  # an offloaded layer's weight is streamed in per forward
    if input_device(model).type != "cpu" or not layers:
        return {}, {}, None
    timer = timer or wall_timer(torch.device("cpu"))
    shapes = Counter(tuple(m.weight.shape) for m in layers)
    weights = {tuple(m.weight.shape): m.weight for m in layers}
    cells = {}
    with torch.no_grad():
        for shape in shapes:
            w = weights[shape].detach()
            packed = pack_linear_weight(w)
            table = forms.get(shape, [])
            for r in rows:
                x = torch.randn(r, shape[1], dtype=w.dtype)
                reps = min(shapes[shape], 8)
                thin = r < len(table) and table[r]
                cells["packed", "packed", r, shape] = lambda p=packed, x=x, reps=reps: [
                    packed_linear(x, p, None) for _ in range(reps)]
                cells["packed", "chosen", r, shape] = (
                    (lambda w=w, x=x, reps=reps: [(w @ x.t()).t().contiguous() for _ in range(reps)]) if thin else
                    (lambda w=w, x=x, reps=reps: [F.linear(x, w) for _ in range(reps)]))

        def run_round(i: int) -> dict[tuple, float]:
            keys = list(cells)
            if i % 2:  # each pair side by side, and each form first in every other round
                keys = [keys[j ^ 1] for j in range(len(keys))]
            times = timed_round({key: cells[key] for key in keys}, timer)
            return {("packed", "packed / chosen", r, shape): times["packed", "packed", r, shape]
                    / times["packed", "chosen", r, shape] for r in rows for shape in shapes}

        chosen: dict[tuple, bool] = {}

        def same_choice(samples):  # a row count is chosen where every middle round chose it
            chosen.clear()
            chosen.update({key[2:]: _middle(ratios)[1] <= margin for key, ratios in samples.items()})
            return None

        timed_round(cells, lambda key, fn: fn())  # warm-up
        measurement = measure_repeated(run_round, repeats, None, attempts, agree=same_choice)
    by_shape = {shape: tuple(r for r in rows if chosen.get((r, shape), False)) for shape in shapes}
    details = {"linear_packed_over_chosen_by_shape": {
        "x".join(map(str, shape)): {str(r): round(measurement.medians["packed", "packed / chosen", r, shape], 3)
                                    for r in rows} for shape in shapes}}
    return by_shape, details, measurement.problem


# A speculator's drafts ----------------------------------------------------------------------------------------------
def draft_sample(model, speculator, ids: torch.Tensor, k: int, max_new_tokens: int) -> tuple[float, float]:
    """One short greedy call at batch 1 and constant k: `(ms per drafted token, ms per verify step)`, as the
    engine timed them."""
    m = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, speculator=speculator,
                       num_speculative_tokens=k, speculative_schedule="constant", max_new_tokens=max_new_tokens,
                       return_dict_in_generate=True).speculative_metrics
    return 1000 * m.draft_time_s / max(m.num_draft_tokens, 1), 1000 * m.verify_time_s / max(m.num_steps, 1)


def measure_draft_cost(model, speculator, step_cost, k: int = 4, max_new_tokens: int = 24, prompt_tokens: int = 64,
                       repeats: int = 3, attempts: int = ATTEMPTS, sample=None) -> tuple[float, dict, str | None]:
    """A speculator's cost per drafted token in plain steps, from its own proposals in `repeats` short calls (a
    random prompt). Each call's drafting is divided by the same call's verify forwards (of k + 1 tokens, priced at
    `step_cost.relative(1, k + 1)` plain steps), so a load that changed since the step cost was measured cancels
    out. Returns `(cost, timings, why it is not to be trusted or None)`."""
    from ..runners.model_runner import input_device

    sample = sample or draft_sample
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(min(vocab, 1000), (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to(input_device(model))
    sample(model, speculator, ids, k, 4)  # warm-up
    verify_steps = float(step_cost.relative(1, torch.tensor(k + 1.0, dtype=torch.float64),
                                            prompt_tokens + max_new_tokens // 2))
    timings = {"draft_ms_per_token": [], "verify_ms_per_step": []}

    def run_round(i: int) -> dict[tuple, float]:
        draft_ms, verify_ms = sample(model, speculator, ids, k, max_new_tokens)
        timings["draft_ms_per_token"].append(round(draft_ms, 3))
        timings["verify_ms_per_step"].append(round(verify_ms, 3))
        return {("draft",): draft_ms / verify_ms * verify_steps}

    def check(medians):
        if not medians[("draft",)] >= 0.0:
            return f"a negative or undefined draft cost ({medians[('draft',)]})"
        return None

    measurement = measure_repeated(run_round, repeats, check, attempts)
    cost = measurement.medians[("draft",)]
    details = {**timings, "verify_steps": round(verify_steps, 3), "attempts": measurement.attempts}
    return cost, details, measurement.problem
