"""This host's costs for a model: measured once, cached, and read by every call.

A profile is measured per (device, model configuration, dtype, CPU threads, torch version) and stored as JSON under
`$HF_SPECDEC_CACHE/calibration` (default `~/.cache/hf_specdec/calibration`; profile.py). It holds:
- the target's step cost (step_cost.py), which adaptive k prices verification with;
- each model speculator's cost per drafted token, timed from its own proposals (draft_cost.py) and divided by the
  target's plain step, so a quantized or small draft, or a head, is priced by what it costs here;
- per linear weight shape, the row counts at which this host runs the product faster as `(W @ x.T).T` or with the
  weight packed for oneDNN than as `F.linear` (linear_forms.py); `host_linear` swaps those forms in for a call.

No command has to run first: the first call that finds no profile (`ensure_profile`) measures a short grid before
its first step (`FIRST_CALL_GRID`, a few seconds for a 135M model on 2 cores) and caches it; `hf-specdec calibrate`
(`calibrate`) measures a finer grid. A call never changes its profile while it runs and reads it before its first
step, so seeded calls reproduce, the first included (measuring leaves the global random state as it was).
`generate(speculative_calibration=False)` or `HF_SPECDEC_CALIBRATION=off` use the static defaults
(`DEFAULT_STEP_COST`, drafts priced by parameter count) and measure nothing; `HF_SPECDEC_CALIBRATION=cached` uses a
cached profile but never measures one. A corrupt or foreign file, or one whose step cost breaks the physical bounds
of timing.py, is ignored with a warning and measured again.

A busy host measures itself busy, so each measurement is interleaved, repeated and bounded (timing.py). A step cost
still untrustworthy is not cached: the profile keeps the linear forms, timed apart, without it, calls price
verification with the static default, and calls that measure on their own try the step cost again after
`UNSTEADY_RETRY_S`. Such a draft cost is not cached either (the draft is priced by its size), and an untrustworthy
linear timing keeps the stock form. Each is logged at WARNING with the reason.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import torch

from ..runners.model_runner import input_device
from .draft_cost import measure_draft_cost
from .linear_forms import (
    FUSED_MARGIN,
    LINEAR_MARGIN,
    LINEAR_ROWS,
    PACKED_MARGIN,
    measure_packed_linear,
    measure_thin_linear,
    packed_linear_enabled,
    shape_key,
    thin_linear,
    thin_linear_enabled,
    thin_row_table,
)
from .linear_weights import clear_packed_weights
from .profile import (
    Profile,
    load_profile,
    module_fingerprint,
    note_unsteady,
    offloaded,
    profile_key,
    profile_path,
    recently_unsteady,
    save_profile,
    speculator_key,
)
from .step_cost import DEFAULT_STEP_COST, HOST_FORMS_CPU_STEP_COST, StepCost, measure_step_cost
from .timing import ATTEMPTS, Timer

logger = logging.getLogger("hf_specdec")

PROBE_REPEATS = 7  # one-token forwards timed first: if they disagree, the host is too busy to measure
# ... in this many tries: a hiccup in the first (two slow forwards of seven on a 2-core EPYC, 58 against 85 ms, seen in
# a first call on 2026-12-07) must not leave a host on the static defaults for `UNSTEADY_RETRY_S`. Each try costs
# seven one-token forwards (0.4 s for SmolLM2-135M on 2 cores); a host busy through all three is not measured.
PROBE_ATTEMPTS = 3


def enabled() -> bool:
    """Whether `generate` uses this host's profiles (`HF_SPECDEC_CALIBRATION=off` turns it off: static defaults)."""
    return os.environ.get("HF_SPECDEC_CALIBRATION", "on").lower() not in ("0", "off", "false", "no")


def measures_first_call() -> bool:
    """Whether a call with no profile measures one (`HF_SPECDEC_CALIBRATION=cached` uses cached profiles only)."""
    return enabled() and os.environ.get("HF_SPECDEC_CALIBRATION", "on").lower() != "cached"


# What a call uses -------------------------------------------------------------------------------------------------
# What the first call on a new host, model, dtype and thread count measures before its first step: every linear weight
# shape over a few row counts in each form, and target forwards of 1 row x 1, 2 and 3 tokens (batch 1's verifies) and
# of 16 rows x 1 and 2 tokens (wide batches' verifies: priced from forwards of at most 16 tokens, a 16-row verify cost
# 20-40% more than the curve's extrapolation said, docs/benchmarks.md), the 16-row verify timed ragged, as verifies
# come (`step_cost.verify_counts`). The forwards run over 32 cached tokens a row, reserved rather than computed
# (`step_cost.fill_context`: 0.5 s less). Not timed at 4 rows: the curve is one function of the tokens fed, and 4 rows
# x 1 token costs no more than 1 row x 3, so the fit pooled the two and priced one row's 2-draft verify at 1.22 plain
# steps against 1.26 (n-gram on grounded prompts at batch 1 ran 4% slower, paired), while batch 4's verifies came out
# no faster (docs/benchmarks.md). Four repeats: the check leaves the lowest and the highest out (with three it leaves
# none, and one slow repeat rejected the step cost on a quiet host).
# The thin form is timed up to 4 rows only (the packed form at every count, against the stock one where thin was not
# timed): past 4 rows it never beat the packed form on the hosts measured. Six rows are timed because a count between
# two timed ones takes the lower one's choice, and a batch-1 verify of 5 drafts feeds 6: with 4 and 8 timed, 6 rows
# took the thin form there, whose time grows with rows (SmolLM2's 211 products at 6 rows, forward order: 40.1 ms thin,
# 25.1 ms packed); n-gram on grounded prompts ran 5.7% faster with 6 timed (paired, AMD EPYC, docs/benchmarks.md).
# Measuring took 3.9-4.1 s (four fresh profiles; 4.4-4.9 s with the contexts prefilled). One row's verifies are timed
# at 3 tokens rather than 4: on an AMD EPYC a forward's cost steps up from 2 tokens to 3 and hardly moves from 3 to 6
# (35.1, 43.7, 44.2 and 48.0 ms for 2, 3, 5 and 6 tokens in a decode), so a curve through 2 and 4 priced 3 tokens at
# 1.10 plain steps against 1.24 and verified two drafts where one paid more; the head on open chat ran 3.7% faster
# with 3 timed (paired). A model speculator's draft cost is timed over calls of 6 new tokens (the head's first call:
# 1.3 s of measuring against 2.3-2.6 s over 12; it priced a drafted token at 0.079-0.082 plain steps against
# 0.076-0.077, three pairs, docs/benchmarks.md).
# Three rows are timed too (2026-11-30): taking two rows' choice, thin, a 1-row verify of 2 drafts (3 tokens) cost
# 42.8 ms against 38.5 ms with 3 timed (the packed form won there for the LM head and the MLP), 4 rows 41.4 against
# 38.2, a plain step 34 ms either way (SmolLM2, AMD EPYC, one-off script; docs/benchmarks.md).
FIRST_CALL_GRID = dict(rows=(1, 16), tokens={1: (1, 2, 3), 16: (1, 2)}, contexts=(32,), repeats=4,
                       linear_rows=(1, 2, 3, 4, 6, 8, 16), thin_rows=(1, 2, 3, 4), attempts=1, draft_tokens=6)


def ensure_profile(model, speculator=None, use_profile: bool = True) -> Profile | None:
    """The profile a call uses, measured now when this host has none for `model` yet (its first call on this host,
    model, dtype and thread count), so that no command has to run first. The measurement is short
    (`FIRST_CALL_GRID`), runs before the call's first step, leaves the global random state as it was and is cached,
    so every call, the first included, runs with one profile fixed before it starts. A model speculator's draft cost
    is measured too where the cache lacks it. Nothing is measured with `use_profile=False`
    (`generate(speculative_calibration=False)`) or `HF_SPECDEC_CALIBRATION=off`, for a model offloaded to disk or
    the CPU (its forwards stream weights: the flat static default fits), on a rank of a tensor-parallel run, or
    within `UNSTEADY_RETRY_S` of finding this host's timing unsteady; with `HF_SPECDEC_CALIBRATION=cached` only a
    cached profile is used. One INFO line says what was measured and where it is cached."""
    if not (use_profile and enabled()):
        return None
    profile = load_profile(model)
    if getattr(_measuring, "active", False):  # the calls `calibrate` times its drafts with
        return profile
    missing_draft = (speculator is not None and speculator_key(speculator) is not None
                     and (profile is None or speculator_key(speculator) not in profile.draft_costs))
    missing_step = profile is None or profile.step_cost is None
    if (not missing_step and not missing_draft) or offloaded(model) or not measures_first_call() or _sharded():
        return profile
    start = time.perf_counter()
    measured = calibrate(model, [speculator] if missing_draft else [], retry=False, **FIRST_CALL_GRID)
    seconds = time.perf_counter() - start
    if measured is not None and measured != profile:
        parts = []
        if profile is None:
            parts.append("this host's linear-layer forms")
        if measured.step_cost is not None and (profile is None or profile.step_cost is None):
            parts.append("step cost" if parts else "this host's step cost")
        if missing_draft and speculator_key(speculator) in measured.draft_costs:
            parts.append(f"{type(speculator).__name__}'s draft cost")
        what = " and ".join(parts) or "nothing steadily"
        logger.info(f"hf_specdec measured {what} for {type(model).__name__} in {seconds:.1f} s; cached in "
                    f"{profile_path(model)} (HF_SPECDEC_CALIBRATION=off or speculative_calibration=False skips "
                    "this; `hf-specdec calibrate` measures a finer grid)")
    return measured if measured is not None else profile


def adaptive_costs(model, speculator, step_cost: StepCost | None = None, use_profile: bool = True
                   ) -> tuple[StepCost, float, str]:
    """Adaptive k's `(step cost, draft cost per token, where they came from)` for a call: an explicit `step_cost`
    first, then the cached profile, then the static defaults. Reads, never measures."""
    profile = load_profile(model) if use_profile and enabled() else None
    sources = []
    if step_cost is not None:
        sources.append("the step cost passed as speculative_step_cost")
    elif profile is not None and profile.step_cost is not None:
        step_cost = profile.step_cost
        sources.append(f"the step cost measured on this host ({profile_path(model)})")
    else:
        step_cost, what = static_step_cost(model, profile)
        why = ", this host's timing of it not trustworthy when measured" if profile is not None else ""
        sources.append(f"the static default step cost for {what}{why} (`hf-specdec calibrate` measures this host's)")
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


def static_step_cost(model, profile: Profile | None = None) -> tuple[StepCost, str]:
    """The step cost a call prices verification with where none was measured, and what it stands for: on a CPU, the
    curve timed with the linear forms the call runs (`profile`'s, where it holds this host's: `host_linear`; else
    the stock ones)."""
    # Offloaded weights stream in every forward whatever its width: nearly flat, as on an accelerator.
    kind = "cuda" if offloaded(model) else input_device(model).type
    step_cost = DEFAULT_STEP_COST.get(kind, DEFAULT_STEP_COST["cuda"])
    if kind == "cpu":  # CPUs differ widely in what a multi-token forward costs: assume a dear one
        if _host_forms(profile)[0]:
            return HOST_FORMS_CPU_STEP_COST.pessimistic(), ("cpu with this host's linear forms, verification priced "
                                                            "at twice its extra cost")
        return step_cost.pessimistic(), "cpu, verification priced at twice its extra cost"
    return step_cost, "offloaded weights (flat)" if offloaded(model) else kind


def _host_forms(profile: Profile | None, compiled: str | None = None) -> tuple[bool, dict, dict]:
    """Whether a call with `profile` (steps `compiled` as `host_linear` takes it) runs any linear layer in this host's
    forms, and the packed shapes and fused groups it packs."""
    if profile is None or not thin_linear_enabled() or compiled == "frozen":
        return False, {}, {}
    packing = packed_linear_enabled() and not compiled
    packed = profile.packed_linear_shapes if packing else {}
    fused = profile.fused_linear_groups if packing else {}
    runs = bool(profile.thin_linear_rows or any(profile.thin_linear_shapes.values()) or any(packed.values())
                or any(fused.values()))
    return runs, packed, fused


_reported: set[tuple] = set()  # (model, speculator class, cost source) already warned about in this process


def report_idle(policy, model, speculator, cost_source: str) -> None:
    """Logs, at WARNING the first time per model, speculator class and cost source (INFO after that), why adaptive
    k kept drafting off for most of a call, and how to force drafting."""
    explanation = policy.idle_explanation()
    if explanation is None:
        return
    key = (module_fingerprint(model), type(speculator).__name__, cost_source)
    level = logging.INFO if key in _reported else logging.WARNING
    _reported.add(key)
    logger.log(level, f"{type(speculator).__name__}: {explanation} (costs from {cost_source}). The output is "
               "still exact; pass speculative_schedule='constant' to draft num_speculative_tokens every step anyway.")


@contextmanager
def host_linear(model, speculator=None, use_profile: bool = True, compiled: str | None = None):
    """For the duration, `model`'s and the speculator's linear layers run as `(W @ x.T).T`, or with their weight
    packed for oneDNN, for the input row counts where the cached profile found that faster (`thin_linear`); nothing
    changes without a profile. `compiled` (as `decode.engine.compiled` says): `"compiled"`, steps run compiled
    (`runners/graphed.py`), which cannot take the packed copy (an opaque oneDNN tensor inductor does not lower), so
    the packed form is left out; `"frozen"`, the compiled graph holds the weights and chooses each product's kernel
    itself (`graphed.CPU_OPTIONS`), so every layer stays `F.linear`."""
    profile = (load_profile(model) if use_profile and enabled() and thin_linear_enabled() and compiled != "frozen"
               else None)
    runs, packed, fused = _host_forms(profile, compiled)
    if not packed and not fused:  # copies kept from earlier calls are not used now: free them
        clear_packed_weights(model)
    if not runs:
        yield
        return
    modules = [model, *(speculator.modules() if speculator is not None else [])]
    with thin_linear(modules, profile.thin_linear_rows, profile.linear_rows or None,
                     profile.thin_linear_shapes or None, packed or None, fused or None):
        yield


def _distrust(what: str, problem: str, fallback: str) -> None:
    logger.warning(f"hf_specdec calibrate: {what} is not trustworthy ({problem}), so {fallback}. Is the host busy? "
                   "`hf-specdec calibrate --force` on a quiet host measures it again.")


def calibrate(model, speculators=(), force: bool = False, rows: tuple[int, ...] = (1, 4, 16),
              tokens: tuple[int, ...] | dict[int, tuple[int, ...]] = (1, 2, 3, 4, 6, 8, 12),
              contexts: tuple[int, ...] = (64, 256), repeats: int = 5, linear_rows: tuple[int, ...] = LINEAR_ROWS,
              progress=None, timer: Timer | None = None, attempts: int = ATTEMPTS, retry: bool = True,
              draft_tokens: int = 24, thin_rows: tuple[int, ...] | None = None) -> Profile | None:
    """Returns `model`'s profile on this host, measuring what the cache lacks (everything with `force`): the small-row
    linear form, the step cost (with that form in use), and each of `speculators`' draft cost. Each is measured as
    `timing.py` says (interleaved, repeated, bounded): a step cost that stays untrustworthy is not cached (the
    profile keeps the linear forms without it, and calls price verification with the static default), nor is such a
    draft cost (the draft is priced by its size; no draft is timed without a trusted step cost to price it against);
    an untrustworthy linear timing keeps the stock form. None is returned when nothing was cached: the host's timing
    was unsteady from the start. Each fallback is logged at WARNING with its reason. The global
    random state is left as it was. `progress`: a function taking a message, called before each measurement;
    `timer`: what times a forward or a product (`timing.Timer`; tests pass made-up timings). With `retry=False`,
    what was found unsteady in the last `UNSTEADY_RETRY_S` is not measured again (`force` measures anyway).
    `tokens`: the new tokens per row of the forwards timed, at every row count in `rows`, or a dict giving them per row
    count. `draft_tokens`: the length of the short calls a draft cost is timed over. `thin_rows`: the row counts among
    `linear_rows` the thin form is timed at (default: all; past the last, and where not timed, the stock form)."""
    if thin_rows is not None and not set(thin_rows) <= set(linear_rows):
        raise ValueError(f"thin_rows {tuple(thin_rows)} must be among linear_rows {tuple(linear_rows)}, the row counts "
                         "the linear forms are chosen at; add them to linear_rows or leave them out")
    _measuring.active, outer = True, getattr(_measuring, "active", False)
    try:
        return _calibrate(model, speculators, force, rows, tokens, contexts, repeats, linear_rows, progress, timer,
                          attempts, retry, draft_tokens, linear_rows if thin_rows is None else thin_rows)
    finally:
        _measuring.active = outer


def _sharded() -> bool:
    """Whether this process is one rank of several (tensor parallelism): ranks timing on their own could choose
    different retries and fall out of step in their collectives, so they measure nothing on a first call."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


_measuring = threading.local()  # set while `calibrate` runs: the generate calls timing drafts measure nothing


def _calibrate(model, speculators, force, rows, tokens, contexts, repeats, linear_rows, progress, timer, attempts,
               retry, draft_tokens, thin_timed) -> Profile | None:
    say = progress or (lambda message: None)
    profile = None if force else load_profile(model)

    def skipped(what: str, name: str) -> bool:
        when = None if retry or force else recently_unsteady(model, what)
        if when is not None:
            say(f"not measuring {name}: {(time.time() - when) / 60:.0f} min ago this host's timing was unsteady "
                f"(`hf-specdec calibrate` measures it now)")
        return when is not None

    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []), torch.no_grad():
        if profile is None or profile.step_cost is None:
            if skipped("step", "the step cost"):
                return profile
            start = time.perf_counter()
            say("checking that one-token forwards take a steady time")
            _, probe = measure_step_cost(model, (1,), (1,), contexts[:1], PROBE_REPEATS, timer,
                                         attempts=PROBE_ATTEMPTS)
            if probe.problem is not None:  # a busy host: the whole grid would take long and be rejected
                _distrust("this host's timing now", probe.problem, "nothing is measured or cached and calls keep "
                          "the static default costs")
                note_unsteady(model, "step", True)
                return profile
            if profile is None:
                forms, details = _measure_forms(model, linear_rows, thin_timed, repeats, timer, attempts, say)
            else:  # the forms are cached: only the step cost is measured again
                forms = (profile.linear_rows, profile.thin_linear_rows, profile.thin_linear_shapes,
                         profile.packed_linear_shapes, profile.fused_linear_groups)
                details = dict(profile.details)
            measured_rows, thin_rows, shapes, packed, fused = forms
            say(f"measuring target forwards (batch {', '.join(map(str, rows))})")
            packing = packed_linear_enabled()
            with thin_linear([model], thin_rows if thin_linear_enabled() else (), measured_rows or None,
                             shapes if thin_linear_enabled() else None, (packed or None) if packing else None,
                             (fused or None) if packing else None):
                step_cost, measurement = measure_step_cost(model, rows, tokens, contexts, repeats, timer, attempts)
            if measurement.problem is not None:
                kept = " (the linear-layer forms measured are cached)" if profile is None else ""
                _distrust("the step cost measured now", measurement.problem, "it is not cached and calls price "
                          f"verification with the static default costs{kept}")
                step_cost = None
            details.update(seconds=round(time.perf_counter() - start, 1), step_attempts=measurement.attempts)
            profile = Profile(profile_key(model), step_cost, thin_rows, profile.draft_costs if profile else {},
                              details, tuple(measured_rows), shapes, packed, fused)
            save_profile(model, profile)
            note_unsteady(model, "step", step_cost is None)
        for spec in speculators:
            if not callable(getattr(spec, "modules", None)):
                raise TypeError(f"calibrate takes speculator objects, got {type(spec).__name__}; turn a name or a "
                                "draft model into one with hf_specdec.resolve_speculator")
            key = speculator_key(spec)
            if key is None or (key in profile.draft_costs and not force):
                continue
            if skipped(key, f"{type(spec).__name__}'s drafts"):
                continue
            if profile.step_cost is None:
                say(f"not measuring {type(spec).__name__}'s drafts: they are priced against the step cost, which "
                    "was not measured steadily")
                continue
            say(f"measuring {type(spec).__name__}'s drafts")
            cost, timings, problem = measure_draft_cost(model, spec, profile.step_cost, attempts=attempts,
                                                        max_new_tokens=draft_tokens)
            note_unsteady(model, key, problem is not None)
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


def _measure_forms(model, linear_rows, thin_timed, repeats, timer, attempts, say):
    """Times the linear layers' forms (linear_forms.py): `((linear rows, thin rows, thin rows per shape, packed rows
    per shape, fused rows per group), details)`; a form whose timing is not trustworthy is left out."""
    say(f"measuring linear layers over {', '.join(map(str, linear_rows))} rows")
    thin_rows, details, problem, by_shape = measure_thin_linear(model, thin_timed, LINEAR_MARGIN, repeats, timer,
                                                                attempts)
    if problem is not None:
        _distrust("the small-row linear timing", problem, "linear layers keep their stock form")
        thin_rows, by_shape = (), {}
    if not thin_linear_enabled():
        thin_rows, by_shape = (), {}
    shapes = {shape_key(shape): rows for shape, rows in by_shape.items()}
    packed, fused = {}, {}
    if packed_linear_enabled():
        forms = {shape: thin_row_table(rows, linear_rows) for shape, rows in by_shape.items()}
        by_shape_packed, packed_details, problem, by_group = measure_packed_linear(
            model, linear_rows, PACKED_MARGIN, forms, repeats, timer, attempts, FUSED_MARGIN)
        details.update(packed_details)
        if problem is not None:
            _distrust("the packed linear timing", problem, "linear layers keep their unpacked forms")
        else:
            packed = {shape_key(shape): rows for shape, rows in by_shape_packed.items()}
            fused = by_group
    return (tuple(linear_rows), thin_rows, shapes, packed, fused), details


def describe(profile: Profile | None) -> str:
    """A few lines saying what a profile holds, in plain steps."""
    if profile is None:
        return "  no profile cached: calls use the static default costs"
    cost = profile.step_cost
    lines = [] if cost is not None else ["  no step cost: its timing was not trustworthy, so calls price verification "
                                         "with the static default (`hf-specdec calibrate` measures it again)"]
    for rows in ((1, 4, 16) if cost is not None else ()):
        relative = [float(cost.relative(rows, torch.tensor(float(q)), rows * 128)) for q in (2, 3, 4, 6)]
        lines.append(f"  batch {rows}: a forward of 2 / 3 / 4 / 6 tokens per row costs "
                     f"{' / '.join(f'{r:.2f}' for r in relative)} plain steps (128 cached tokens per row)")
    def spans(rows, beyond: bool = False) -> str:
        out, start = [], None
        for n, thin in enumerate(thin_row_table(rows, profile.linear_rows or None, beyond) + [False]):
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
            lines.append(f"  linear layers of weight {shape} packed for oneDNN at {spans(rows, True)} input rows (before "
                         "the above)")
    for key, rows in sorted(profile.fused_linear_groups.items()):
        if rows:
            lines.append(f"  sibling linear layers of weights {key} as one packed product at {spans(rows, True)} input rows "
                         "(before the above)")
    for key, value in profile.draft_costs.items():
        name = profile.details.get(f"draft {key}", {}).get("speculator", key)
        lines.append(f"  {name} ({key[:8]}): a drafted token costs {value:.3f} plain steps")
    return "\n".join(lines)
