"""The forms a linear layer's product can take on a CPU, measured per weight shape and swapped in for our forwards."""

from __future__ import annotations

import logging
import os
import statistics
from collections import Counter
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..runners.model_runner import input_device
from .linear_weights import (
    _FUSED,
    _PACKED,
    _fused_weights,
    _FusedGroup,
    _packed_weights,
    _prune_packed,
    _weight_identity,
    group_key,
    linear_groups,
    pack_linear_weight,
    packed_linear,
    packed_linear_supported,
    shape_key,
    thin_linear_candidate,
)
from .timing import ATTEMPTS, LINEAR_FLOOR, Timer, measure_repeated, middle, out_of_bounds, timed_round, wall_timer

logger = logging.getLogger("hf_specdec")

STOCK, THIN, PACKED = 0, 1, 2  # a linear layer's forms (`thin_linear`'s tables)


# The small-row linear form ------------------------------------------------------------------------------------------
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
    `[vocab, hidden]` weight from 2 rows up, and slower for the layers' at 6-12 rows. One row runs as two
    (`thin_product`)."""

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
                cells["linear", "thin", r, shape] = lambda ws=thin, x=x: [thin_product(w, x) for w in ws]

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
    # A shape takes the thin form where its own rounds chose it, and also where the pooled timing did and its own
    # median ratio does not say thin is slower: a small weight's products are short, and its ratio alone wanders
    # across the margin (SmolLM2's 192x576 at one row: 0.69, 0.74 and 0.86 of the stock form's time in three
    # profiles measured on one AMD EPYC; where it fell past the margin, the q/k/v layers took another form, and
    # decoding with speculation off was 3.7% slower).
    by_shape = {shape: tuple(r for r in rows if chosen.get((r, shape), False) or (
        r in faster and measurement.medians["linear", "thin / stock", r, shape] <= 1.0)) for shape in shapes}
    details = {"linear_ms": {str(r): [round(1000 * stock[r], 3), round(1000 * thin[r], 3)] for r in rows},
               "linear_thin_over_stock": {str(r): round(ratio[r], 3) for r in rows},
               "linear_thin_over_stock_by_shape": {
                   "x".join(map(str, shape)): {str(r): round(measurement.medians["linear", "thin / stock", r, shape], 3)
                                               for r in rows} for shape in shapes},
               "linear_attempts": measurement.attempts}
    return faster, details, measurement.problem, by_shape


def measure_packed_linear(model, rows: tuple[int, ...], margin: float, forms: dict[tuple[int, int], list[bool]],
                          repeats: int = 5, timer: Timer | None = None, attempts: int = ATTEMPTS,
                          fused_margin: float | None = None
                          ) -> tuple[dict[tuple[int, int], tuple[int, ...]], dict, str | None, dict[str, tuple[int, ...]]]:
    """Times the model's float32 CPU linear layers over `rows` input rows in the packed form (`packed_linear`)
    against the form chosen without it (`forms`: shape -> `thin_row_table`, thin where True), and each group of
    sibling layers that read one input (`linear_groups`: q/k/v, gate/up) as one packed product against its members
    apart. Returns, per shape, the row counts where the packed form took at most `margin` of the other's time in
    every middle round (empty where it never did), the timings, why they are not to be trusted (None when they
    are), and per group (`group_key`) the row counts where its one product took at most `fused_margin` of its
    members' best forms (none measured without `fused_margin`).

    Each form is timed as a forward meets its layers: one pass over a few decoder blocks in the model's order (each
    form over blocks of its own, `cold_weights`), every product timed alone and summed per shape. Timed shape by
    shape instead, eight products of one shape back to back, the forms compared differently from a forward: on an
    AMD EPYC the packed form of SmolLM2's down projection at one row took 0.77-0.86 of `F.linear`'s time there and
    0.68 in a forward's order. Measured there: 2-3x faster for the LM head from 1 row, about 2x for the layers over
    2-8 rows, and one q/k/v product at 0.79-0.86 of the three apart at one row."""

    named = [(name, m) for name, m in model.named_modules() if thin_linear_candidate(m)
             and packed_linear_supported(m.weight) and getattr(m, "_hf_hook", None) is None]
    if input_device(model).type != "cpu" or not named:
        return {}, {}, None, {}
    timer = timer or wall_timer(torch.device("cpu"))
    layers = [m for _, m in named]
    shapes = Counter(tuple(m.weight.shape) for m in layers)
    present = {id(m) for m in layers}
    groups = [g for g in linear_groups([model]) if all(id(m) in present for m in g)] if fused_margin else []
    kinds = ("packed", "chosen", "fused") if groups else ("packed", "chosen")
    block = {id(m): _block_index(name) for name, m in named}
    blocks = sorted({b for b in block.values() if b is not None})
    # The packed and the chosen form each over blocks of their own; the one product of each group over the packed
    # form's blocks, the others there packed too, as a call would run them (the chosen form's pass between the two
    # reads more than a CPU's caches hold, so those weights come from memory again), the LM head left out.
    own = cold_weights(blocks, 2) if blocks else [[], []]
    sequences = {kind: [m for m in layers if block[id(m)] is None or block[id(m)] in own[k]]
                 for k, kind in enumerate(kinds[:2])}
    if groups:
        sequences["fused"] = [m for m in sequences["packed"] if block[id(m)] is not None or not blocks]
    grouped = {id(m): g for g in groups for m in g}
    cells: dict[tuple[str, int], list[tuple[object, object]]] = {}
    with torch.no_grad():
        # The model's own layers, packed as a call packs them (`_packed_weights` keeps the copies, so a call that then
        # packs this shape does not pack them again; those of shapes no call packs are dropped below).
        copies = _packed_weights(sequences["packed"])
        in_fused = {id(m) for m in sequences.get("fused", [])}
        fused_copies = _fused_weights([g for g in groups if id(g[0]) in in_fused])
        where = {id(m): i for i, m in enumerate(sequences["packed"])}
        for r in rows:
            inputs = {width: torch.randn(r, width, dtype=layers[0].weight.dtype)
                      for width in {m.in_features for m in layers}}
            packed = [(tuple(m.weight.shape), _product(m, PACKED, inputs[m.in_features], copies.get(id(m))))
                      for m in sequences["packed"]]
            cells["packed", r] = packed
            cells["chosen", r] = [(tuple(m.weight.shape), _product(m, _chosen_form(forms, m, r), inputs[m.in_features]))
                                  for m in sequences["chosen"]]
            if groups:
                fused = []
                for m in sequences["fused"]:  # each group's one product where its first member stands
                    g = grouped.get(id(m))
                    if g is None:
                        fused.append(packed[where[id(m)]])
                    elif m is g[0] and id(m) in fused_copies:
                        fused.append((group_key(g), _product(m, PACKED, inputs[m.in_features],
                                                             fused_copies[id(m)][0])))
                cells["fused", r] = fused
        counts = {(kind, r, what): n for (kind, r), items in cells.items()
                  for what, n in Counter(what for what, _ in items).items()}
        group_keys = {group_key(g): g for g in groups}

        def run_round(i: int) -> dict[tuple, float]:
            totals: dict[tuple, float] = {}
            for r in rows:  # each form's pass side by side with the others', the order turned every other round
                for kind in (kinds if i % 2 == 0 else kinds[::-1]):  # the chosen form's pass always in the middle
                    for position, (what, fn) in enumerate(cells[kind, r]):
                        t = timer(("packed", kind, r, what, position), fn)
                        totals[kind, r, what] = totals.get((kind, r, what), 0.0) + t
            each = {key: t / counts[key] for key, t in totals.items()}  # per product
            ratios = {("packed", "packed / chosen", r, shape): each["packed", r, shape] / each["chosen", r, shape]
                      for r in rows for shape in shapes if ("chosen", r, shape) in each and ("packed", r, shape) in each}
            for key, g in group_keys.items():
                for r in rows:
                    if ("fused", r, key) in each:
                        apart = sum(min(each.get(("packed", r, s), float("inf")), each.get(("chosen", r, s), float(
                            "inf"))) for s in (tuple(m.weight.shape) for m in g))
                        ratios["packed", "fused / apart", r, key] = each["fused", r, key] / apart
            return ratios

        chosen_rows: dict[tuple, bool] = {}

        def same_choice(samples):  # a row count is chosen where every middle round chose it
            chosen_rows.clear()
            chosen_rows.update({key[1:]: middle(ratios)[1] <= (margin if key[1] == "packed / chosen" else fused_margin)
                                for key, ratios in samples.items()})
            return None

        for items in cells.values():  # warm-up
            for _, fn in items:
                fn()
        measurement = measure_repeated(run_round, repeats, None, attempts, agree=same_choice)
    trusted = measurement.problem is None
    by_shape = {shape: tuple(r for r in rows if trusted and chosen_rows.get(("packed / chosen", r, shape), False))
                for shape in shapes}
    by_group = {key: tuple(r for r in rows if trusted and chosen_rows.get(("fused / apart", r, key), False))
                for key in group_keys}
    # Copies made for timing a shape or group that no call packs: freed now.
    for m in layers:
        if not by_shape[tuple(m.weight.shape)]:
            _PACKED.pop(m, None)
    for g in groups:
        if not by_group[group_key(g)]:
            _FUSED.pop(g[0], None)
    details = {"linear_packed_over_chosen_by_shape": {
        "x".join(map(str, shape)): {str(r): round(measurement.medians["packed", "packed / chosen", r, shape], 3)
                                    for r in rows if ("packed", "packed / chosen", r, shape) in measurement.medians}
        for shape in shapes}}
    if group_keys:
        details["linear_fused_over_apart_by_group"] = {
            key: {str(r): round(measurement.medians["packed", "fused / apart", r, key], 3) for r in rows
                  if ("packed", "fused / apart", r, key) in measurement.medians} for key in group_keys}
    return by_shape, details, measurement.problem, by_group


def _chosen_form(forms: dict, m: torch.nn.Linear, rows: int) -> int:
    table = forms.get(tuple(m.weight.shape), [])
    return THIN if rows < len(table) and table[rows] else STOCK


def _product(m: torch.nn.Linear, form: int, x: torch.Tensor, packed: torch.Tensor | None = None):
    """A timing's product of `x` by `m`'s weight in `form` (PACKED: by `packed`, or packed on each call without)."""
    w = m.weight.detach()
    if form == PACKED:
        if packed is None:
            return lambda: packed_linear(x, pack_linear_weight(w), None)
        return lambda: packed_linear(x, packed, None)
    if form == THIN:
        return lambda: thin_product(w, x)
    return lambda: F.linear(x, w)


def _block_index(name: str) -> int | None:
    """The decoder block a module belongs to, by the first number in its qualified name (`model.layers.12.mlp` ->
    12); None outside any (an LM head)."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


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


# The packed form must take at most this fraction of the other form's time to be used. Timed in a forward's order it
# still looks less of a gain than it is in one (SmolLM2's down projection at one row on an AMD EPYC: 0.82 timed, 0.69
# in a decode step under the profiler), and every middle round must pass.
PACKED_MARGIN = 0.9


FUSED_MARGIN = 0.9  # a group's one product must take at most this fraction of its members' apart to be used


def thin_linear_enabled() -> bool:
    """Whether `host_linear` may switch linear layers to another form than `F.linear` (`HF_SPECDEC_THIN_LINEAR=off`
    stops it: neither `(W @ x.T).T` nor the packed form)."""
    return os.environ.get("HF_SPECDEC_THIN_LINEAR", "on").lower() not in ("0", "off", "false", "no")


def packed_linear_enabled() -> bool:
    """Whether `host_linear` may use the packed form where the profile chose it (`HF_SPECDEC_PACKED_LINEAR=off`
    stops it alone)."""
    return thin_linear_enabled() and os.environ.get("HF_SPECDEC_PACKED_LINEAR", "on").lower() not in (
        "0", "off", "false", "no")


def thin_product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for `x` `[rows, in]` as `(W @ x.T).T`, laid out row-major again. One row is computed as
    two (the row twice, the first result kept): `W @ x.T` of one column runs the matrix-vector kernel `F.linear`
    runs, of two the matrix kernel, which streams the weight faster. On an AMD EPYC with MKL, SmolLM2-135M's 211
    products at one row took 19.3 ms this way, against 26.3 ms packed for oneDNN and 44.8 ms through `F.linear`
    (forward order, medians of 12; docs/benchmarks.md). Each row's result is computed alone, so the first one is the
    row's own whatever the second."""
    if x.shape[0] == 1:
        return (weight @ torch.cat([x, x]).t())[:, :1].t().contiguous()
    return (weight @ x.t()).t().contiguous()


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
        y = thin_product(linear.weight, x.reshape(-1, x.shape[-1]))
        if linear.bias is not None:
            y += linear.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return forward


def thin_row_table(rows, measured=None, beyond: bool = False) -> list[bool]:
    """`table[n]`: whether an input of n rows takes the thin form. Without `measured`, exactly the counts in `rows`;
    with it (the counts timed, `rows` those where thin won), a count between two measured ones takes the choice made
    at the lower, and past the last measured count the stock form stays, unless `beyond` (the packed form's tables):
    then the choice made at the last measured count holds up to four times that count, within `LINEAR_ROWS`. The
    first call measures up to 16 rows, and a batch of 16 verifying drafts feeds 32-48: on an AMD EPYC the packed form
    took 0.66 of `F.linear`'s time at 32 rows and 0.76 at 48, in a forward's order; with the stock form past 16 rows
    (and a step cost measured with the packed form), n-gram and the head ran at 0.66-0.94x speculation off at batch
    16."""
    chosen = frozenset(rows)
    if not measured:
        return [n in chosen for n in range(max(chosen, default=0) + 1)]
    measured = sorted(measured)
    table = []
    for n in range(measured[-1] + 1):
        below = [m for m in measured if m <= n]
        table.append(bool(below) and below[-1] in chosen)
    if beyond and table and table[-1]:
        table += [True] * (max(min(4 * measured[-1], LINEAR_ROWS[-1]) + 1 - len(table), 0))
    return table


def _packed_above_thin(forms: list[int], measured) -> list[int]:
    """`forms` (a `thin_linear` table) with each count between two measured ones, the lower taking the thin form and
    the upper the packed one, taking the packed form too. The thin form's time grows with its rows (the matrix kernel
    gets a column per row) while the packed form's hardly does at a few rows, so where packed won at the upper count
    it wins between: SmolLM2's 211 products on an AMD EPYC, thin / packed, at 4 rows 26.7 / 26.5 ms, at 5 33.7 /
    27.7, at 6 40.1 / 25.1 (docs/benchmarks.md)."""
    counts = sorted(m for m in (measured or ()) if m < len(forms))
    out = list(forms)
    for low, high in zip(counts, counts[1:]):
        if forms[low] == THIN and forms[high] == PACKED:
            out[low + 1:high] = [PACKED] * (high - low - 1)
    return out


@contextmanager
def thin_linear(modules, rows, measured=None, shapes: dict | None = None, packed: dict | None = None,
                fused: dict | None = None):
    """Within the block, every plain `torch.nn.Linear` (full-precision weight, computed on the CPU) inside `modules`
    computes inputs of `rows` rows as `(W @ x.T).T` (with `measured`, the row counts timed: counts between them as
    `thin_row_table` says); restored on exit. Quantized or wrapped layers are left alone. A layer under an accelerate
    hook (`device_map`, offload) keeps its hook: the hook's inner forward is the one switched, so the weights it
    streams in are the ones multiplied. With `shapes` (`"out x in"` -> row counts), a layer whose weight's shape is
    named takes that shape's counts instead (`rows` stay for the others). With `packed` (the same mapping), a float32
    layer of a named shape, not under a hook, computes those row counts with its weight packed for oneDNN
    (`packed_linear`, the copy kept between blocks), before any thin choice. With `fused` (group key, `group_key`
    -> row counts), each group of sibling layers (`linear_groups`) of a named key computes those row counts as one
    packed product (`_FusedGroup`), before any other choice."""
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
            chosen = thin_row_table(packed[key], measured, beyond=True) if pack else []
            tables[key, pack] = _packed_above_thin(
                [PACKED if n < len(chosen) and chosen[n] else THIN if n < len(thin) and thin[n] else STOCK
                 for n in range(max(len(thin), len(chosen)))], measured)
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
        if fused:
            ours = {id(module) for module, _, _ in patched}
            groups = [g for g in linear_groups(modules) if any(fused.get(group_key(g), ()))
                      and not any("forward" in vars(m) and id(m) not in ours for m in g)]
            copies = _fused_weights(groups)
            for g in groups:
                if id(g[0]) not in copies:
                    continue
                group = _FusedGroup(g, thin_row_table(fused[group_key(g)], measured, beyond=True),
                                    *copies[id(g[0])])
                for index, module in enumerate(g):
                    own = vars(module).get("forward") or (lambda x, m=module: F.linear(x, m.weight, m.bias))
                    if id(module) not in ours:
                        patched.append((module, "forward", None))
                    module.forward = group.forward(index, own)
        yield
    finally:
        for module, name, original in patched:
            if original is None:
                delattr(module, name)
            else:
                setattr(module, name, original)
