"""A host's measured costs for one model, cached as JSON under $HF_SPECDEC_CACHE/calibration."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..models import cache_dir
from ..runners.model_runner import input_device
from .step_cost import StepCost, check_step_cost

logger = logging.getLogger("hf_specdec")

# 2: timed as timing.py says; 3: linear rows up to 64; 4: the linear form chosen per weight shape; 5: the packed
# form; 6: the packed form timed in a forward's order, and sibling layers as one product; 7: one row's thin form
# computed as two rows (`thin_product`), timed; 8: a shape takes the pooled thin choice unless its own ratio is above 1,
# and the first call times 6 rows; 9: several rows' verifies timed ragged, in regions of the pool, the curve the nearest
# non-decreasing one, and a cost per cached token only where contexts varied
FORMAT, VERSION = "hf_specdec-calibration", 9


# After a measurement found this host's timing unsteady, calls that measure on their own (a first call, `hf-specdec
# run`, `serve`, the demo) do not try it again for this long. A first call's try on a busy host costs its probe (three
# tries of seven one-token forwards, 1.2 s for SmolLM2-135M on 2 cores) or the short grid (4 s), under 0.5% of the
# interval; six hours (as until 2026-12-07) left a host that met one noisy moment on the static defaults all day.
# `hf-specdec calibrate` always tries.
UNSTEADY_RETRY_S = 15 * 60


@dataclass(frozen=True)
class Profile:
    """One host's measured costs for one model.

    Attributes:
        key: what the measurement depends on (`profile_key`).
        step_cost: the target's forward cost; None where its timing was not trustworthy (a busy moment, or a
            forward whose cost breaks timing.py's bounds), so calls price verification with the static default
            until a later call or `hf-specdec calibrate` measures it again. The linear forms, timed apart, stay.
        thin_linear_rows: input row counts at which `(W @ x.T).T` beat `F.linear` (empty: never).
        linear_rows: the row counts measured; a count between two takes the choice made at the lower one
            (`thin_linear`).
        thin_linear_shapes: the same choice for each weight shape measured (`"out x in"` -> row counts, empty where
            thin never won), which is what applies to layers of those shapes: an LM head's weight and the layers'
            may want different forms. A layer of a shape not measured (a draft model's) takes `thin_linear_rows`.
        packed_linear_shapes: per weight shape, the row counts (between measured ones as for thin) at which the
            weight packed once for oneDNN (`linear_weights.packed_linear`) beat the form chosen above; it takes precedence
            there. Float32 CPU layers only; a shape not named never takes it.
        fused_linear_groups: per group of sibling layers that read one input (`linear_weights.group_key`: q/k/v,
            gate/up), the row counts at which computing them as one packed product beat computing them apart; it
            takes precedence over the forms above there.
        draft_costs: per speculator (`speculator_key`), the cost of one drafted token relative to a plain step.
        details: what was measured, for people (timings, seconds taken).
    """

    key: dict
    step_cost: StepCost | None
    thin_linear_rows: tuple[int, ...] = ()
    draft_costs: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    linear_rows: tuple[int, ...] = ()
    thin_linear_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    packed_linear_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    fused_linear_groups: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "key": self.key,
                "step_cost": None if self.step_cost is None else {
                    "per_row": self.step_cost.per_row, "points": [list(p) for p in self.step_cost.points],
                    "per_context_token": self.step_cost.per_context_token},
                "thin_linear_rows": list(self.thin_linear_rows), "linear_rows": list(self.linear_rows),
                "thin_linear_shapes": {k: list(v) for k, v in self.thin_linear_shapes.items()},
                "packed_linear_shapes": {k: list(v) for k, v in self.packed_linear_shapes.items()},
                "fused_linear_groups": {k: list(v) for k, v in self.fused_linear_groups.items()},
                "draft_costs": self.draft_costs,
                "details": self.details}

    @classmethod
    def from_json(cls, data: dict, key: dict) -> Profile:
        """Raises `ValueError` unless `data` is a profile of this format and version for exactly `key`."""
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError("not an hf_specdec calibration profile of this version")
        if data.get("key") != key:
            raise ValueError("measured for another device, model, dtype or thread count")
        cost, step_cost = data["step_cost"], None
        if cost is not None:
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
        fused = {str(k): tuple(int(r) for r in v) for k, v in data.get("fused_linear_groups", {}).items()}
        return cls(key, step_cost, rows, draft_costs, dict(data.get("details", {})), measured, shapes, packed, fused)


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


def module_fingerprint(module: torch.nn.Module) -> str:
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
    key = {"device": _device_name(device), "model": module_fingerprint(model), "dtype": str(model.dtype),
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
    return hashlib.sha256(json.dumps([type(speculator).__name__, *map(module_fingerprint, modules)]).encode()
                          ).hexdigest()[:24]


# The cache --------------------------------------------------------------------------------------------------------
def profile_path(model):
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


def note_unsteady(model, what: str, failed: bool) -> None:
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
