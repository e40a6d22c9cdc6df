"""Measured costs: what a target forward and a draft token cost on this host, measured once and cached.

A profile is measured once per (device, model configuration, dtype, CPU threads, torch version) by `calibrate` (the
`hf-specdec calibrate` command; `run`, `bench` and the demo call it at start) and stored as JSON under
`$HF_SPECDEC_CACHE/calibration` (default `~/.cache/hf_specdec/calibration`). It holds:
- the target's step cost (`StepCost.measure`), which adaptive k prices verification with;
- each speculator's cost per drafted token, timed from its own proposals in a short speculative call and divided by
  the target's plain step, so a quantized or small draft, or a head, is priced by what it costs here;
- the row counts at which this host's BLAS runs a linear layer faster as `(W @ x.T).T` than as `F.linear` (MKL over
  2-3 rows; benchmarks/small_row_linear.py). `host_linear` computes our forwards' linear layers that way.

`generate(..., speculator=...)` uses the cached profile of its target when there is one (`speculative_calibration=
False`, or `HF_SPECDEC_CALIBRATION=off`, uses the static defaults instead) and falls back to `DEFAULT_STEP_COST` and
the speculator's parameter-count estimate. A `generate` call never times anything: it only reads the file, so
seeded calls are reproducible. Adaptive k's choices (which change how many random numbers a sampled call draws)
depend on the prompts, the acceptance seen so far and the profile, and the profile is fixed until `calibrate` is run
again. To pin a seeded run across re-calibrations, pass `speculative_step_cost=` or `speculative_calibration=False`.
A corrupt or foreign file, or one whose step cost breaks the physical bounds of measure.py, is ignored with a
warning (and rewritten by the next `calibrate`).

A busy host measures itself busy, so each measurement is interleaved, repeated and bounded (measure.py). A step cost
still untrustworthy after `attempts` passes is not cached (calls keep the static defaults: better the old guess
than one that switches drafting off on this host until someone recalibrates), nor is such a draft cost (the draft
is priced by its size); an untrustworthy small-row linear timing keeps the stock form. Each is logged at WARNING with
the reason. Profiles are not refreshed from a call's own step timings: that would make one seeded call's choices
depend on how fast an earlier call ran.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from .adaptive import DEFAULT_STEP_COST, StepCost
from .measure import (
    ATTEMPTS, Timer, check_step_cost, measure_draft_cost, measure_packed_linear, measure_step_cost,
    measure_thin_linear, pack_linear_weight, packed_linear, packed_linear_supported, thin_linear_candidate,
)
from ..runners.model_runner import input_device

logger = logging.getLogger("hf_specdec")

# 2: measured as measure.py says; 3: linear rows up to 64; 4: the linear form chosen per weight shape; 5: the packed
# form
FORMAT, VERSION = "hf_specdec-calibration", 5
# Rows of a linear layer's input timed both ways; a count between two takes the choice made at the lower, and past
# the last the stock form stays. A CPU step's linear layers see one row per token fed (a server's batch of 16 rows
# verifying 2 drafts each: 48), its LM head one per position that needs logits.
LINEAR_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
LINEAR_MARGIN = 0.8  # `(W @ x.T).T` must take at most this fraction of F.linear's time to be used
PACKED_MARGIN = 0.85  # the packed form must take at most this fraction of the other form's time to be used
PROBE_REPEATS = 9  # one-token forwards timed first: if they disagree, the host is too busy to measure
# After a measurement found this host's timing unsteady, calls that calibrate on their own (`hf-specdec run`, `serve`,
# the demo) do not try it again for this long: on a busy host each try costs up to minutes and is rejected again.
# `hf-specdec calibrate` always tries.
UNSTEADY_RETRY_S = 6 * 3600


@dataclass(frozen=True)
class Profile:
    """One host's measured costs for one model.

    Attributes:
        key: what the measurement depends on (`profile_key`).
        step_cost: the target's forward cost.
        thin_linear_rows: input row counts at which `(W @ x.T).T` beat `F.linear` (empty: never).
        linear_rows: the row counts measured; a count between two takes the choice made at the lower one
            (`thin_linear`).
        thin_linear_shapes: the same choice for each weight shape measured (`"out x in"` -> row counts, empty where
            thin never won), which is what applies to layers of those shapes: an LM head's weight and the layers'
            may want different forms. A layer of a shape not measured (a draft model's) takes `thin_linear_rows`.
        packed_linear_shapes: per weight shape, the row counts (between measured ones as for thin) at which the
            weight packed once for oneDNN (`measure.packed_linear`) beat the form chosen above; it takes precedence
            there. Float32 CPU layers only; a shape not named never takes it.
        draft_costs: per speculator (`speculator_key`), the cost of one drafted token relative to a plain step.
        details: what was measured, for people (timings, seconds taken).
    """

    key: dict
    step_cost: StepCost
    thin_linear_rows: tuple[int, ...] = ()
    draft_costs: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    linear_rows: tuple[int, ...] = ()
    thin_linear_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    packed_linear_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "key": self.key,
                "step_cost": {"per_row": self.step_cost.per_row, "points": [list(p) for p in self.step_cost.points],
                              "per_context_token": self.step_cost.per_context_token},
                "thin_linear_rows": list(self.thin_linear_rows), "linear_rows": list(self.linear_rows),
                "thin_linear_shapes": {k: list(v) for k, v in self.thin_linear_shapes.items()},
                "packed_linear_shapes": {k: list(v) for k, v in self.packed_linear_shapes.items()},
                "draft_costs": self.draft_costs,
                "details": self.details}

    @classmethod
    def from_json(cls, data: dict, key: dict) -> Profile:
        """Raises `ValueError` unless `data` is a profile of this format and version for exactly `key`."""
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError("not an hf_specdec calibration profile of this version")
        if data.get("key") != key:
            raise ValueError("measured for another device, model, dtype or thread count")
        cost = data["step_cost"]
        step_cost = StepCost(per_row=float(cost["per_row"]), per_context_token=float(cost["per_context_token"]),
                             points=tuple((float(n), float(t)) for n, t in cost["points"]))
        problem = check_step_cost(step_cost)
        if problem is not None:
            raise ValueError(problem)
        draft_costs = {str(k): float(v) for k, v in data.get("draft_costs", {}).items()}
        if not all(v >= 0.0 for v in draft_costs.values()):
            raise ValueError("negative draft cost")
        rows = tuple(int(r) for r in data.get("thin_linear_rows", ()))
        measured = tuple(int(r) for r in data.get("linear_rows", ()))
        shapes = {str(k): tuple(int(r) for r in v) for k, v in data.get("thin_linear_shapes", {}).items()}
        packed = {str(k): tuple(int(r) for r in v) for k, v in data.get("packed_linear_shapes", {}).items()}
        return cls(key, step_cost, rows, draft_costs, dict(data.get("details", {})), measured, shapes, packed)


def enabled() -> bool:
    """Whether `generate` uses cached profiles (`HF_SPECDEC_CALIBRATION=off` turns it off)."""
    return os.environ.get("HF_SPECDEC_CALIBRATION", "on").lower() not in ("0", "off", "false", "no")


def thin_linear_enabled() -> bool:
    """Whether `host_linear` may switch linear layers to another form than `F.linear` (`HF_SPECDEC_THIN_LINEAR=off`
    stops it: neither `(W @ x.T).T` nor the packed form)."""
    return os.environ.get("HF_SPECDEC_THIN_LINEAR", "on").lower() not in ("0", "off", "false", "no")


def packed_linear_enabled() -> bool:
    """Whether `host_linear` may use the packed form where the profile chose it (`HF_SPECDEC_PACKED_LINEAR=off`
    stops it alone)."""
    return thin_linear_enabled() and os.environ.get("HF_SPECDEC_PACKED_LINEAR", "on").lower() not in (
        "0", "off", "false", "no")


# Keys -------------------------------------------------------------------------------------------------------------
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{device.type}:{name}"


def _module_fingerprint(module: torch.nn.Module) -> str:
    """A digest of what a module's cost depends on: its class, configuration and parameters' types, dtypes and
    shapes (not their values), so a quantized copy differs from the original and a retrained one does not."""
    config = getattr(module, "config", None)
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if isinstance(config, dict):  # names, paths and library versions do not change the cost
        config = {k: v for k, v in config.items() if not k.startswith("_") and k not in (
            "transformers_version", "name_or_path", "dtype", "torch_dtype", "architectures")}
    params = Counter((type(p).__name__, str(p.dtype), tuple(p.shape)) for p in module.parameters())
    text = json.dumps([type(module).__name__, config, sorted(map(list, params.items()))], sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def profile_key(model) -> dict:
    """What a target's profile depends on: device, model configuration and parameters, dtype, threads, torch, and
    for a model placed by accelerate (`device_map`) the placement, since offloaded weights stream every forward."""
    device = input_device(model)  # not model.device: `meta` for a model offloaded to disk
    key = {"device": _device_name(device), "model": _module_fingerprint(model), "dtype": str(model.dtype),
           "threads": torch.get_num_threads() if device.type == "cpu" else None, "torch": torch.__version__}
    if getattr(model, "hf_device_map", None):
        key["placement"] = {name: str(place) for name, place in model.hf_device_map.items()}
    return key


def offloaded(model) -> bool:
    """Whether some of a model's weights live on disk or in host memory while it computes on an accelerator."""
    places = {str(p) for p in (getattr(model, "hf_device_map", None) or {}).values()}
    return "disk" in places or ("cpu" in places and input_device(model).type != "cpu")


def speculator_key(speculator) -> str | None:
    """A digest of a speculator's class and modules; None for one that runs no module (n-gram lookup)."""
    modules = speculator.modules()
    if not modules:
        return None
    return hashlib.sha256(json.dumps([type(speculator).__name__, *map(_module_fingerprint, modules)]).encode()
                          ).hexdigest()[:24]


# The cache --------------------------------------------------------------------------------------------------------
def profile_path(model):
    from ..models import cache_dir

    digest = hashlib.sha256(json.dumps(profile_key(model), sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "calibration" / f"{digest}.json"


_loaded: dict[tuple, Profile | None] = {}  # (path, mtime, size) -> profile, so a call reads the file at most once


def load_profile(model) -> Profile | None:
    """The cached profile for `model` on this host, or None. A file that cannot be read as this model's profile is
    ignored with a warning (once per file version)."""
    path = profile_path(model)
    try:
        stat = path.stat()
    except OSError:
        return None
    memo = (str(path), stat.st_mtime_ns, stat.st_size)
    if memo not in _loaded:
        try:
            _loaded[memo] = Profile.from_json(json.loads(path.read_text()), profile_key(model))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
            logger.warning(f"ignoring the calibration profile {path}: {error}; `hf-specdec calibrate` (or "
                           "hf_specdec.costs.calibration.calibrate(model)) measures it again")
            _loaded[memo] = None
    return _loaded[memo]


def save_profile(model, profile: Profile):
    """Writes `profile` as `model`'s cached profile (atomically) and returns its path."""
    path = profile_path(model)
    _write_atomically(path, json.dumps(profile.to_json(), indent=1))
    return path


def _write_atomically(path, text: str) -> None:
    """Writes `text` to `path` through a temporary file beside it: a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(text)
    partial.replace(path)


# What a call uses -------------------------------------------------------------------------------------------------
def adaptive_costs(model, speculator, step_cost: StepCost | None = None, use_profile: bool = True
                   ) -> tuple[StepCost, float, str]:
    """Adaptive k's `(step cost, draft cost per token, where they came from)` for a call: an explicit `step_cost`
    first, then the cached profile, then the static defaults. Reads, never measures."""
    profile = load_profile(model) if use_profile and enabled() else None
    sources = []
    if step_cost is not None:
        sources.append("the step cost passed as speculative_step_cost")
    elif profile is not None:
        step_cost = profile.step_cost
        sources.append(f"the step cost measured on this host ({profile_path(model)})")
    else:
        # Offloaded weights stream in every forward whatever its width: nearly flat, as on an accelerator.
        kind = "cuda" if offloaded(model) else input_device(model).type
        step_cost = DEFAULT_STEP_COST.get(kind, DEFAULT_STEP_COST["cuda"])
        what = "offloaded weights (flat)" if offloaded(model) else kind
        sources.append(f"the static default step cost for {what} (`hf-specdec calibrate` measures this host's)")
    key = speculator_key(speculator)
    if key is None:
        draft_cost = speculator.relative_cost(model)
    elif profile is not None and key in profile.draft_costs:
        draft_cost = profile.draft_costs[key]
        sources.append("the draft cost measured on this host")
    else:
        draft_cost = speculator.relative_cost(model)
        sources.append("a draft cost estimated from parameter counts")
    return step_cost, draft_cost, ", ".join(sources)


_reported: set[tuple] = set()  # (model, speculator class, cost source) already warned about in this process


def report_idle(policy, model, speculator, cost_source: str) -> None:
    """Logs, at WARNING the first time per model, speculator class and cost source (INFO after that), why adaptive
    k kept drafting off for most of a call, and how to force drafting."""
    explanation = policy.idle_explanation()
    if explanation is None:
        return
    key = (_module_fingerprint(model), type(speculator).__name__, cost_source)
    level = logging.INFO if key in _reported else logging.WARNING
    _reported.add(key)
    logger.log(level, f"{type(speculator).__name__}: {explanation} (costs from {cost_source}). The output is "
               "still exact; pass speculative_schedule='constant' to draft num_speculative_tokens every step anyway.")


@contextmanager
def host_linear(model, speculator=None, use_profile: bool = True):
    """For the duration, `model`'s and the speculator's linear layers run as `(W @ x.T).T`, or with their weight
    packed for oneDNN, for the input row counts where the cached profile found that faster (`thin_linear`); nothing
    changes without a profile."""
    profile = load_profile(model) if use_profile and enabled() and thin_linear_enabled() else None
    packed = profile.packed_linear_shapes if profile is not None and packed_linear_enabled() else {}
    if not packed:  # copies kept from earlier calls are not used now: free them
        clear_packed_weights(model)
    if profile is None or not (profile.thin_linear_rows or any(profile.thin_linear_shapes.values())
                               or any(packed.values())):
        yield
        return
    modules = [model, *(speculator.modules() if speculator is not None else [])]
    with thin_linear(modules, profile.thin_linear_rows, profile.linear_rows or None,
                     profile.thin_linear_shapes or None, packed or None):
        yield


STOCK, THIN, PACKED = 0, 1, 2  # a linear layer's forms (`thin_linear`'s tables)


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
    (`measure.packed_linear`, the copy kept between blocks), before any thin choice."""
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


# Measuring --------------------------------------------------------------------------------------------------------
def _unsteady_path(model):
    return profile_path(model).with_suffix(".unsteady.json")


def recently_unsteady(model, what: str) -> float | None:
    """When (Unix time) measuring `what` (`"step"`, or a speculator's key) last found this host's timing unsteady, if
    within `UNSTEADY_RETRY_S`; else None."""
    try:
        when = json.loads(_unsteady_path(model).read_text()).get(what)
    except (OSError, ValueError, AttributeError):
        return None
    return when if isinstance(when, (int, float)) and 0 <= time.time() - when < UNSTEADY_RETRY_S else None


def _note_unsteady(model, what: str, failed: bool) -> None:
    """Records (or, after a trusted measurement, clears) that measuring `what` found the timing unsteady."""
    path = _unsteady_path(model)
    try:
        notes = json.loads(path.read_text())
        notes = notes if isinstance(notes, dict) else {}
    except (OSError, ValueError):
        notes = {}
    if failed:
        notes[what] = time.time()
    elif notes.pop(what, None) is None:
        return
    try:
        _write_atomically(path, json.dumps(notes))
    except OSError as error:  # a read-only cache: the next call tries again, no harm
        logger.debug(f"could not note the calibration outcome in {path}: {error}")


def _distrust(what: str, problem: str, fallback: str) -> None:
    logger.warning(f"hf_specdec calibrate: {what} is not trustworthy ({problem}), so {fallback}. Is the host busy? "
                   "`hf-specdec calibrate --force` on a quiet host measures it again.")


def calibrate(model, speculators=(), force: bool = False, rows: tuple[int, ...] = (1, 4, 16),
              tokens: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12), contexts: tuple[int, ...] = (64, 256),
              repeats: int = 5, linear_rows: tuple[int, ...] = LINEAR_ROWS, progress=None,
              timer: Timer | None = None, attempts: int = ATTEMPTS, retry: bool = True) -> Profile | None:
    """Returns `model`'s profile on this host, measuring what the cache lacks (everything with `force`): the small-row
    linear form, the step cost (with that form in use), and each of `speculators`' draft cost. Each is measured as
    `measure.py` says (interleaved, repeated, bounded): a step cost that stays untrustworthy is not cached (None is
    returned and calls keep the static defaults), nor is such a draft cost (the draft is priced by its size); an
    untrustworthy linear timing keeps the stock form. Each fallback is logged at WARNING with its reason. The global
    random state is left as it was. `progress`: a function taking a message, called before each measurement;
    `timer`: what times a forward or a product (`measure.Timer`; tests pass made-up timings). With `retry=False`,
    what was found unsteady in the last `UNSTEADY_RETRY_S` is not measured again (`force` measures anyway)."""
    say = progress or (lambda message: None)
    profile = None if force else load_profile(model)

    def skipped(what: str, name: str) -> bool:
        when = None if retry or force else recently_unsteady(model, what)
        if when is not None:
            say(f"not measuring {name}: {(time.time() - when) / 60:.0f} min ago this host's timing was unsteady "
                f"(`hf-specdec calibrate` measures it now)")
        return when is not None

    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []), torch.no_grad():
        if profile is None:
            if skipped("step", "the step cost"):
                return None
            start = time.perf_counter()
            say("checking that one-token forwards take a steady time")
            _, probe = measure_step_cost(model, (1,), (1,), contexts[:1], PROBE_REPEATS, timer, attempts=1)
            if probe.problem is not None:  # a busy host: the whole grid would take long and be rejected
                _distrust("this host's timing now", probe.problem, "nothing is measured or cached and calls keep "
                          "the static default costs")
                _note_unsteady(model, "step", True)
                return None
            say(f"measuring linear layers over {', '.join(map(str, linear_rows))} rows")
            thin_rows, details, problem, by_shape = measure_thin_linear(model, linear_rows, LINEAR_MARGIN, repeats,
                                                                        timer, attempts)
            if problem is not None:
                _distrust("the small-row linear timing", problem, "linear layers keep their stock form")
                thin_rows, by_shape = (), {}
            if not thin_linear_enabled():
                thin_rows, by_shape = (), {}
            shapes = {shape_key(shape): rows for shape, rows in by_shape.items()}
            packed = {}
            if packed_linear_enabled():
                forms = {shape: thin_row_table(rows, linear_rows) for shape, rows in by_shape.items()}
                by_shape_packed, packed_details, problem = measure_packed_linear(
                    model, linear_rows, PACKED_MARGIN, forms, repeats, timer, attempts)
                details.update(packed_details)
                if problem is not None:
                    _distrust("the packed linear timing", problem, "linear layers keep their unpacked forms")
                else:
                    packed = {shape_key(shape): rows for shape, rows in by_shape_packed.items()}
            say(f"measuring target forwards (batch {', '.join(map(str, rows))})")
            with thin_linear([model], thin_rows, linear_rows, shapes, packed or None):
                step_cost, measurement = measure_step_cost(model, rows, tokens, contexts, repeats, timer, attempts)
            if measurement.problem is not None:
                _distrust("the step cost measured now", measurement.problem,
                          "nothing is cached and calls keep the static default costs")
                _note_unsteady(model, "step", True)
                return None
            details.update(seconds=round(time.perf_counter() - start, 1), step_attempts=measurement.attempts)
            profile = Profile(profile_key(model), step_cost, thin_rows, {}, details, tuple(linear_rows), shapes,
                              packed)
            save_profile(model, profile)
            _note_unsteady(model, "step", False)
        for spec in speculators:
            if not callable(getattr(spec, "modules", None)):
                raise TypeError(f"calibrate takes speculator objects, got {type(spec).__name__}; turn a name or a "
                                "draft model into one with hf_specdec.resolve_speculator")
            key = speculator_key(spec)
            if key is None or (key in profile.draft_costs and not force):
                continue
            if skipped(key, f"{type(spec).__name__}'s drafts"):
                continue
            say(f"measuring {type(spec).__name__}'s drafts")
            cost, timings, problem = measure_draft_cost(model, spec, profile.step_cost, attempts=attempts)
            _note_unsteady(model, key, problem is not None)
            if problem is not None:
                _distrust(f"{type(spec).__name__}'s draft cost", problem, "it is priced by its parameter count")
                continue
            # A head is cast to the target's dtype when a call begins, which changes its key: file it under both.
            keys = dict.fromkeys([key, speculator_key(spec)])
            profile = replace(profile, draft_costs={**profile.draft_costs, **{k: round(cost, 4) for k in keys}},
                              details={**profile.details, f"draft {key}": {"speculator": type(spec).__name__,
                                                                            **timings}})
            save_profile(model, profile)
    return profile


def describe(profile: Profile | None) -> str:
    """A few lines saying what a profile holds, in plain steps."""
    if profile is None:
        return "  no profile cached: calls use the static default costs"
    cost = profile.step_cost
    lines = []
    for rows in (1, 4, 16):
        relative = [float(cost.relative(rows, torch.tensor(float(q)), rows * 128)) for q in (2, 3, 4, 6)]
        lines.append(f"  batch {rows}: a forward of 2 / 3 / 4 / 6 tokens per row costs "
                     f"{' / '.join(f'{r:.2f}' for r in relative)} plain steps (128 cached tokens per row)")
    def spans(rows) -> str:
        out, start = [], None
        for n, thin in enumerate(thin_row_table(rows, profile.linear_rows or None) + [False]):
            if thin and start is None:
                start = n
            elif not thin and start is not None:
                out.append(f"{start}" if n - 1 == start else f"{start}-{n - 1}")
                start = None
        return ", ".join(out) or "no"

    if profile.thin_linear_shapes:
        for shape, rows in sorted(profile.thin_linear_shapes.items()):
            if rows:
                lines.append(f"  linear layers of weight {shape} as (W @ x.T).T at {spans(rows)} input rows")
        lines.append(f"  other shapes (a speculator's) as (W @ x.T).T at {spans(profile.thin_linear_rows)} input rows")
    else:
        lines.append(f"  linear layers as (W @ x.T).T at {spans(profile.thin_linear_rows)} input rows")
    for shape, rows in sorted(profile.packed_linear_shapes.items()):
        if rows:
            lines.append(f"  linear layers of weight {shape} packed for oneDNN at {spans(rows)} input rows (before "
                         "the above)")
    for key, value in profile.draft_costs.items():
        name = profile.details.get(f"draft {key}", {}).get("speculator", key)
        lines.append(f"  {name} ({key[:8]}): a drafted token costs {value:.3f} plain steps")
    return "\n".join(lines)
