"""The forms a linear layer's product can take on a CPU, measured per weight shape and swapped in for our forwards."""

from __future__ import annotations

import logging
import os
import statistics
import weakref
from collections import Counter
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..runners.model_runner import input_device
from .timing import ATTEMPTS, LINEAR_FLOOR, Timer, measure_repeated, middle, out_of_bounds, timed_round, wall_timer

logger = logging.getLogger("hf_specdec")

STOCK, THIN, PACKED = 0, 1, 2  # a linear layer's forms (`thin_linear`'s tables)


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

    layers = [m for m in model.modules() if thin_linear_candidate(m)]
    device = input_device(model)  # not model.device: `meta` when the first weights live on disk
    if device.type != "cpu" or not layers:
        return (), {}, None, {}
    timer = timer or wall_timer(device)
    shapes = Counter(tuple(m.weight.shape) for m in layers)
    # A layer offloaded to disk has its weight on `meta` until its forward streams it in: time a stand-in of the
    # same shape and dtype (the product's cost does not depend on the values).
    weights: dict[tuple, list[torch.Tensor]] = {}
    for m in layers:
        if m.weight.device.type == "cpu":
            weights.setdefault(tuple(m.weight.shape), []).append(m.weight.detach())
    for shape, m in {tuple(m.weight.shape): m for m in layers}.items():
        if shape not in weights:
            weights[shape] = [torch.randn(shape, dtype=m.weight.dtype)]
    cells = {}
    with torch.no_grad():
        for r in rows:
            for shape in shapes:
                x = torch.randn(r, shape[1], dtype=weights[shape][0].dtype)
                stock, thin = cold_weights(weights[shape], 2)
                cells["linear", "stock", r, shape] = lambda ws=stock, x=x: [F.linear(x, w) for w in ws]
                cells["linear", "thin", r, shape] = lambda ws=thin, x=x: [(w @ x.t()).t().contiguous() for w in ws]

        rounds: list[dict[tuple, float]] = []  # this attempt's totals per (form, rows), round by round

        def run_round(i: int) -> dict[tuple, float]:
            keys = list(cells)
            if i % 2:  # each pair side by side, and each form first in every other round
                keys = [keys[j ^ 1] for j in range(len(keys))]
            times = timed_round({key: cells[key] for key in keys}, timer)
            totals: dict[tuple, float] = {}
            for (_, form, r, shape), t in times.items():
                totals["linear", form, r] = totals.get(("linear", form, r), 0.0) + t * shapes[shape] / len(
                    cold_weights(weights[shape], 2)[0])
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
                problem = out_of_bounds(best[r], r, best[min(rows)], f"the faster form over {r} rows", LINEAR_FLOOR)
                if problem:
                    return problem
            return None

        chosen: dict[int, bool] = {}

        def same_choice(samples):  # the ratio may wander: a row count is chosen where every middle round chose it
            chosen.clear()
            chosen.update({key[2:]: middle(ratios)[1] <= margin for key, ratios in samples.items()})
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

    layers = [m for m in model.modules() if thin_linear_candidate(m) and packed_linear_supported(m.weight)
              and getattr(m, "_hf_hook", None) is None]  # an offloaded layer's weight is streamed in per forward
    if input_device(model).type != "cpu" or not layers:
        return {}, {}, None
    timer = timer or wall_timer(torch.device("cpu"))
    shapes = Counter(tuple(m.weight.shape) for m in layers)
    by_shape_layers: dict[tuple, list[torch.nn.Linear]] = {}
    for m in layers:
        by_shape_layers.setdefault(tuple(m.weight.shape), []).append(m)
    cells = {}
    with torch.no_grad():
        for shape in shapes:
            packed_layers, other_layers = cold_weights(by_shape_layers[shape], 2)
            # The model's own layers, packed as a call packs them (`_packed_weights` keeps the copies, so a call that
            # then packs this shape does not pack them again; `clear_packed_weights` drops those it does not use).
            copies = _packed_weights(packed_layers)
            packed = [copies[id(m)] for m in packed_layers] if copies else [
                pack_linear_weight(m.weight) for m in packed_layers]
            others = [m.weight.detach() for m in other_layers]
            table = forms.get(shape, [])
            for r in rows:
                x = torch.randn(r, shape[1], dtype=others[0].dtype)
                thin = r < len(table) and table[r]
                cells["packed", "packed", r, shape] = lambda ps=packed, x=x: [packed_linear(x, p, None) for p in ps]
                cells["packed", "chosen", r, shape] = (
                    (lambda ws=others, x=x: [(w @ x.t()).t().contiguous() for w in ws]) if thin else
                    (lambda ws=others, x=x: [F.linear(x, w) for w in ws]))

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
            chosen.update({key[2:]: middle(ratios)[1] <= margin for key, ratios in samples.items()})
            return None

        timed_round(cells, lambda key, fn: fn())  # warm-up
        measurement = measure_repeated(run_round, repeats, None, attempts, agree=same_choice)
    by_shape = {shape: tuple(r for r in rows if chosen.get((r, shape), False)) for shape in shapes}
    for shape, chosen_rows in by_shape.items():  # copies made for timing a shape no call packs: freed now
        if not chosen_rows or measurement.problem is not None:
            for m in by_shape_layers[shape]:
                _PACKED.pop(m, None)
    details = {"linear_packed_over_chosen_by_shape": {
        "x".join(map(str, shape)): {str(r): round(measurement.medians["packed", "packed / chosen", r, shape], 3)
                                    for r in rows} for shape in shapes}}
    return by_shape, details, measurement.problem


COLD_PRODUCTS = 8  # products per timing of one weight shape and form: one alone is too short to time well


def cold_weights(items: list, forms: int) -> list[list]:
    """For each of `forms` forms timed side by side, up to `COLD_PRODUCTS` of a shape's weights (or layers), each
    form's its own where the model has enough: in a forward every product reads its weight from memory (a model's
    weights are far larger than a CPU's caches), so a timing that multiplied one weight over and over, or by the
    weights the other form just read, would time products out of cache, where the forms compare differently (on an
    AMD EPYC, the packed form of a 576x576 weight at one row: 1.2x slower than `F.linear` in cache, 1.8x faster from
    memory)."""
    count = min(len(items), COLD_PRODUCTS)
    return [[items[(f * count + j) % len(items)] for j in range(count)] for f in range(forms)]


# Rows of a linear layer's input timed both ways; a count between two takes the choice made at the lower, and past
# the last the stock form stays. A CPU step's linear layers see one row per token fed (a server's batch of 16 rows
# verifying 2 drafts each: 48), its LM head one per position that needs logits.
LINEAR_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


LINEAR_MARGIN = 0.8  # `(W @ x.T).T` must take at most this fraction of F.linear's time to be used


PACKED_MARGIN = 0.85  # the packed form must take at most this fraction of the other form's time to be used


def thin_linear_enabled() -> bool:
    """Whether `host_linear` may switch linear layers to another form than `F.linear` (`HF_SPECDEC_THIN_LINEAR=off`
    stops it: neither `(W @ x.T).T` nor the packed form)."""
    return os.environ.get("HF_SPECDEC_THIN_LINEAR", "on").lower() not in ("0", "off", "false", "no")


def packed_linear_enabled() -> bool:
    """Whether `host_linear` may use the packed form where the profile chose it (`HF_SPECDEC_PACKED_LINEAR=off`
    stops it alone)."""
    return thin_linear_enabled() and os.environ.get("HF_SPECDEC_PACKED_LINEAR", "on").lower() not in (
        "0", "off", "false", "no")


def _thin_forward(linear: torch.nn.Linear, forms: list[int], packed: torch.Tensor | None = None,
                  fallback: list[bool] | None = None):
    """`linear`'s forward in the form `forms[rows]` says. Where that is PACKED but the packed copy cannot stand for
    the weight now (the weight replaced or changed in place since, an input that is not float32, gradients wanted:
    oneDNN's product has no backward), the thin choice `fallback` applies."""
    identity = _weight_identity(linear.weight) if packed is not None else None

    def forward(x):
        n = x.numel() // max(x.shape[-1], 1) if x.dim() else len(forms)
        form = forms[n] if n < len(forms) else STOCK
        if form == PACKED:
            if (x.dtype == torch.float32 and _weight_identity(linear.weight) == identity
                    and not (torch.is_grad_enabled() and (x.requires_grad or linear.weight.requires_grad))):
                return packed_linear(x if x.is_contiguous() else x.contiguous(), packed, linear.bias)
            form = THIN if fallback is not None and n < len(fallback) and fallback[n] else STOCK
        if form != THIN:
            return F.linear(x, linear.weight, linear.bias)
        # The same product, another BLAS call shape; laid out row-major again, as the stock form's output is (the
        # next ops on a transposed layout cost more than the copy: q and o projections at 32 rows took a SmolLM2
        # forward from 236 to 396 ms here).
        y = (linear.weight @ x.reshape(-1, x.shape[-1]).t()).t().contiguous()
        if linear.bias is not None:
            y += linear.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return forward


# Packed weights kept between calls (packing SmolLM2-135M's layers takes about 1.5 s here, longer than many calls):
# layer -> (what identifies its weight's contents, the packed copy). An in-place change of the weight bumps its
# version and the layer is packed again.
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weight_identity(weight: torch.Tensor) -> tuple:
    """What tells a weight's contents apart, cheaply: its data, version, shape, dtype and device. A change made
    through `weight.data` bumps no version: after one, `clear_packed_weights` (or a new weight tensor)."""
    return weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, weight.device


def clear_packed_weights(model: torch.nn.Module | None = None) -> None:
    """Drops the packed copies kept for `model`'s layers (every model's with None): their memory is freed and the
    next call packs again from the weights as they are then."""
    if model is None:
        _PACKED.clear()
        return
    for m in model.modules():
        _PACKED.pop(m, None)


def _prune_packed(modules) -> None:
    """Drops kept copies that no longer stand for their layer's weight (replaced, changed in place, cast, moved), so
    they do not hold memory."""
    for root in modules:
        for m in root.modules():
            entry = _PACKED.get(m)
            if entry is not None and (not isinstance(getattr(m, "weight", None), torch.Tensor)
                                      or entry[0] != _weight_identity(m.weight)):
                del _PACKED[m]


def _packed_weights(layers: list[torch.nn.Linear]) -> dict[int, torch.Tensor]:
    """The packed copy of each layer's weight (`id(layer)` -> copy), packing those not kept yet (layers sharing one
    weight share one copy), unless the copies would take more than half the memory available now (then none: a
    warning says so and the layers keep the other forms)."""
    missing = [m for m in layers if m not in _PACKED or _PACKED[m][0] != _weight_identity(m.weight)]
    kept = {entry[0]: entry[1] for entry in _PACKED.values()}
    distinct = {_weight_identity(m.weight): m.weight for m in missing if _weight_identity(m.weight) not in kept}
    need = sum(w.numel() * w.element_size() for w in distinct.values())
    if need:
        import psutil

        available = psutil.virtual_memory().available
        if need > available / 2:
            logger.warning(f"linear layers keep their unpacked forms: packing their weights needs {need / 2**30:.1f} "
                           f"GiB, more than half the {available / 2**30:.1f} GiB available now")
            return {}
    for m in missing:
        identity = _weight_identity(m.weight)
        if identity not in kept:
            kept[identity] = pack_linear_weight(m.weight)
        _PACKED[m] = (identity, kept[identity])
    return {id(m): _PACKED[m][1] for m in layers}


def thin_row_table(rows, measured=None) -> list[bool]:
    """`table[n]`: whether an input of n rows takes the thin form. Without `measured`, exactly the counts in `rows`;
    with it (the counts timed, `rows` those where thin won), a count between two measured ones takes the choice made
    at the lower, and past the last measured count the stock form stays."""
    chosen = frozenset(rows)
    if not measured:
        return [n in chosen for n in range(max(chosen, default=0) + 1)]
    measured = sorted(measured)
    table = []
    for n in range(measured[-1] + 1):
        below = [m for m in measured if m <= n]
        table.append(bool(below) and below[-1] in chosen)
    return table


def shape_key(weight_shape) -> str:
    """A linear weight's shape as profiles name it: `"out x in"`."""
    return "x".join(str(int(n)) for n in weight_shape)


@contextmanager
def thin_linear(modules, rows, measured=None, shapes: dict | None = None, packed: dict | None = None):
    """Within the block, every plain `torch.nn.Linear` (full-precision weight, computed on the CPU) inside `modules`
    computes inputs of `rows` rows as `(W @ x.T).T` (with `measured`, the row counts timed: counts between them as
    `thin_row_table` says); restored on exit. Quantized or wrapped layers are left alone. A layer under an accelerate
    hook (`device_map`, offload) keeps its hook: the hook's inner forward is the one switched, so the weights it
    streams in are the ones multiplied. With `shapes` (`"out x in"` -> row counts), a layer whose weight's shape is
    named takes that shape's counts instead (`rows` stay for the others). With `packed` (the same mapping), a float32
    layer of a named shape, not under a hook, computes those row counts with its weight packed for oneDNN
    (`packed_linear`, the copy kept between blocks), before any thin choice."""
    tables = {}

    thins = {}

    def thin_table(module) -> list[bool]:
        key = shape_key(module.weight.shape)
        if key not in thins:
            thins[key] = thin_row_table(rows if shapes is None or key not in shapes else shapes[key], measured)
        return thins[key]

    def table(module) -> list[int]:
        key = shape_key(module.weight.shape)
        hooked = getattr(module, "_hf_hook", None) is not None
        pack = (packed is not None and key in packed and not hooked and packed_linear_supported(module.weight))
        if (key, pack) not in tables:
            thin = thin_table(module)
            chosen = thin_row_table(packed[key], measured) if pack else []
            tables[key, pack] = [PACKED if n < len(chosen) and chosen[n] else THIN if n < len(thin) and thin[n]
                                 else STOCK for n in range(max(len(thin), len(chosen)))]
        return tables[key, pack]

    patched = []
    try:
        _prune_packed(modules)
        candidates = [m for m in {id(m): m for root in modules for m in root.modules()}.values()
                      if thin_linear_candidate(m) and any(table(m))]
        weights = _packed_weights([m for m in candidates if PACKED in table(m)])
        for module in candidates:
            forms, thin = table(module), thin_table(module)
            if PACKED in forms and id(module) not in weights:  # not packed after all (memory): the other forms
                forms = [THIN if t else STOCK for t in thin]
                if not any(forms):
                    continue
            hooked = getattr(module, "_hf_hook", None) is not None and "_old_forward" in vars(module)
            name = "_old_forward" if hooked else "forward"
            if not hooked and "forward" in vars(module):  # someone else's wrapper: leave it
                continue
            patched.append((module, name, vars(module).get(name)))
            setattr(module, name, _thin_forward(module, forms, weights.get(id(module)), thin))
        yield
    finally:
        for module, name, original in patched:
            if original is None:
                delattr(module, name)
            else:
                setattr(module, name, original)
