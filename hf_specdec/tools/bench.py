"""`hf-specdec bench`: plain generate, transformers' assisted generation and hf_specdec, side by side in one process.

For every workload (grounded, open chat, or json: extraction constrained by a JSON schema per request) and batch
size, each configuration runs on the same prompts: at batch 1 every prompt of the workload alone, one after the other
(a sample is their summed time), at larger batches one ragged batch cycling through the prompts. Repeats are interleaved across configurations so machine noise hits them
alike (each repeat starting one configuration later), and medians are reported. Definitions:
- speedup: the median over repeats of plain generate's latency over the configuration's in the same repeat (paired
  ratios: the host's slow spells, which move a call's time by 10-20% on a shared 2-core machine, hit both sides of
  most pairs); `speedup_of_medians` in the JSON is the ratio of the two medians. The table shows the lowest and
  highest repeat's ratio beside each median (`speedup_range`, `speedup_over_off_range`).
- vs off: the same paired ratio against "hf_specdec off" (`speculator="off"`: hf_specdec's engine with no drafts),
  which every run includes: speedup = the engine's gain (off over plain generate) x speculation's own gain (vs off).
- vs static: the same paired ratio against plain `generate(cache_implementation="static")`, transformers' fastest
  plain path on CUDA (it compiles its decode step), run by default on CUDA (`--static-baseline` elsewhere).
- first call: each configuration's first call on the first prompt group, timed apart before the repeats (with an
  empty cache it includes measuring this host, `measure s`), against the second call on the same group.
- tokens/s: new tokens of the batch / end-to-end latency.
- TTFT: latency of the same call with `max_new_tokens=1` (prefill + first token), the fastest of three such calls.
- TPOT: (latency - TTFT) / (new tokens per row - 1).
- ideal speedup: tokens emitted per row per target forward (a row counted in the forwards it took part in),
  discounted by drafting cost (the draft's size relative to the target's, per drafted token): what speculation would
  give if a verify cost the same as a plain decode step. The fraction achieved (speedup / ideal) shows the overhead
  left on the table.
- propose ms/step: the speculator's proposing time over all steps, those that drafted nothing included.
- draft ms/token: its proposing time in the steps that drafted, per drafted token of a row (one draft forward at
  batch 1); draft/target: that time over plain generate's TPOT in the same run, the draft's measured relative cost.
  Quantized drafts (`--draft-quantization`) are compared on this and on acceptance.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from unittest import mock

import torch

from ..decode.speculator import Speculator
from ..extraction import PROMPTS as EXTRACTION_PROMPTS
from ..extraction import SCHEMAS as EXTRACTION_SCHEMAS
from ..structured.grammar import Grammar
from ..workloads import GROUNDED, OPEN_CHAT, chat_inputs

WORKLOADS = {"grounded": list(GROUNDED.values()), "open_chat": list(OPEN_CHAT.values()), "json": EXTRACTION_PROMPTS}
# The json workload: each row constrained by its request's schema. Its baseline is plain generate with xgrammar's
# own transformers processor; "hf_specdec grammar" (forced tokens only) runs beside the chosen speculators.
CONSTRAINED = {"json": EXTRACTION_SCHEMAS}
TTFT_CALLS = 3  # one-token calls per group and repeat; their fastest is the TTFT sample
OFF = "hf_specdec off"  # the engine without drafts: what every speculator's own gain is measured against
STATIC = "plain generate, static cache"  # transformers' own compiled decode on CUDA


@dataclass
class Config:
    name: str
    kwargs: dict = field(default_factory=dict)
    batch_one_only: bool = False  # transformers' assisted generation refuses batch size > 1
    draft_cost: float = 0.0  # drafting one token relative to a target step
    env: dict = field(default_factory=dict)  # environment variables set for its calls (HF_SPECDEC_PACKED=0)


@dataclass
class Result:
    workload: str
    batch_size: int
    config: str
    tokens_per_s: float
    ttft_s: float
    tpot_s: float | None  # None where the host's noise outweighed the decode (reported)
    latency_s: float
    new_tokens: int
    speedup: float = 1.0
    identical: bool | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    tokens_per_target_forward: float | None = None
    ideal_speedup: float | None = None
    fraction_of_ideal: float | None = None
    draft_ms_per_token: float | None = None  # proposing time of the steps that drafted, per drafted token and row
    draft_to_target: float | None = None
    speedup_of_medians: float | None = None  # median plain latency / median latency (the speedup before pairing)
    speedup_over_off: float | None = None  # paired, against "hf_specdec off" (speculation's own gain)
    # The lowest and highest of the paired ratios over the repeats, beside their medians (`speedup`,
    # `speedup_over_off`): how far this host's noise moved them, against which a floor near 1 is read.
    speedup_range: tuple[float, float] | None = None
    speedup_over_off_range: tuple[float, float] | None = None
    propose_ms_per_step: float | None = None  # all proposing time over the steps, those that drafted nothing too
    speedup_over_static: float | None = None  # paired, against plain generate with a static cache (where it ran)
    first_call_s: float | None = None  # the configuration's first call on the first group, before any repeat
    second_call_s: float | None = None  # the call right after it, on the same group
    first_measure_s: float | None = None  # of the first call: measuring this host's costs (an empty cache)


def build_configs(model, speculators: dict, k: int, draft_costs: dict, schedule: str = "adaptive",
                  assisted: bool = True, trees: tuple = (), tree_depth: int = 5,
                  uncalibrated: bool = False, padded: bool = False, static: bool = False,
                  compile_switch: str | None = None) -> list[Config]:
    """`compile_switch`: `"compiled"` (a CPU, where steps run eagerly by default) or `"eager"` (CUDA, where they are
    compiled by default) also runs "hf_specdec off" and every speculator the other way (`runners/graphed.py`)."""
    configs = [Config("plain generate")]
    if static:  # transformers' fastest plain path on CUDA: a static cache, and generate compiles itself
        configs.append(Config(STATIC, dict(cache_implementation="static")))
    configs.append(Config(OFF, dict(speculator="off")))
    switched = {"HF_SPECDEC_COMPILE": "1" if compile_switch == "compiled" else "0"}
    if compile_switch:
        configs.append(Config(f"{OFF} {compile_switch}", dict(speculator="off"), env=switched))
    if assisted:
        configs.append(Config("transformers prompt lookup", dict(prompt_lookup_num_tokens=k), batch_one_only=True))
        for name, spec in speculators.items():
            if not isinstance(spec, (str, Speculator)):  # transformers can only assist with a draft model
                configs.append(Config(f"transformers assisted ({name})", dict(assistant_model=spec),
                                      batch_one_only=True))
    for name, spec in speculators.items():
        if spec == "off":  # always run, as OFF
            continue
        configs.append(Config(f"hf_specdec {name}", dict(speculator=spec, num_speculative_tokens=k,
                                                         speculative_schedule=schedule),
                              draft_cost=draft_costs.get(name, 0.0)))
        if compile_switch:
            configs.append(Config(f"hf_specdec {name} {compile_switch}", dict(configs[-1].kwargs),
                                  draft_cost=draft_costs.get(name, 0.0), env=switched))
        if uncalibrated:  # the same without this host's profile: static costs, stock linear layers
            configs.append(Config(f"hf_specdec {name} uncalibrated", dict(configs[-1].kwargs,
                                  speculative_calibration=False), draft_cost=draft_costs.get(name, 0.0)))
        if padded:  # the same with every step padded to its widest row (no packed layout)
            configs.append(Config(f"hf_specdec {name} padded", dict(configs[-1].kwargs),
                                  draft_cost=draft_costs.get(name, 0.0), env={"HF_SPECDEC_PACKED": "0"}))
        for nodes, branching in trees if getattr(spec, "supports_trees", False) else ():
            configs.append(Config(f"hf_specdec {name} tree {nodes}x{branching} depth {tree_depth}", dict(
                speculator=spec, num_speculative_tokens=tree_depth, speculative_tree_nodes=nodes,
                speculative_tree_branching=branching), draft_cost=draft_costs.get(name, 0.0)))
    return configs


def run_bench(model, tokenizer, speculators: dict, batch_sizes=(1, 4, 16), workloads=("grounded", "open_chat"),
              max_new_tokens: int = 128, k: int = 10, repeats: int = 3, progress: bool = True,
              schedule: str = "adaptive", assisted: bool = True, trees: tuple = (),
              tree_depth: int = 5, uncalibrated: bool = False, padded: bool = False,
              on_group=None, static: bool | None = None, compare_compile: bool = False) -> list[Result]:
    """Runs every configuration; returns one `Result` per (workload, batch size, configuration).

    `schedule` is hf_specdec's `speculative_schedule`; `assisted=False` leaves out transformers' own speculation.
    `trees`: `(nodes, branching)` draft-tree shapes, each also run, `tree_depth` deep, by every speculator that
    drafts trees. `static` (default: on CUDA) adds transformers' `generate` with a static cache (which it compiles on
    CUDA), and every speedup over it. `uncalibrated=True` also runs each hf_specdec configuration with `speculative_calibration=False`,
    `padded=True` with every step padded to its widest row (`HF_SPECDEC_PACKED=0`), `compare_compile=True` with its
    steps compiled on a CPU (eager on CUDA, where compiled is the default). `on_group(results)` is called
    with the results so far after each (workload, batch size) (the CLI saves them, so a run stopped part-way keeps
    what it measured).
    """
    from tqdm.auto import tqdm

    draft_costs = {
        n: s.relative_cost(model) if isinstance(s, Speculator) else s.num_parameters() / model.num_parameters()
        for n, s in speculators.items() if not isinstance(s, str)
    }
    static = model.device.type == "cuda" if static is None else static
    switch = ("eager" if model.device.type == "cuda" else "compiled") if compare_compile else None
    configs = build_configs(model, speculators, k, draft_costs, schedule, assisted, trees, tree_depth, uncalibrated,
                            padded, static, switch)
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {sorted(WORKLOADS)}")
    plan = [(w, b) for w in workloads for b in batch_sizes]
    per_workload = {w: _workload_configs(configs, w, k, schedule) for w in workloads}
    total = sum(len([c for c in per_workload[w] if b == 1 or not c.batch_one_only]) for w, b in plan) * (repeats + 1)
    bar = tqdm(total=total, disable=not progress, desc="bench")
    results = []
    for workload, batch_size in plan:
        prompts = WORKLOADS[workload]
        if batch_size == 1:  # every prompt of the workload, one call each
            picks = [[i] for i in range(len(prompts))]
        else:  # one ragged batch, prompts cycling through the workload
            picks = [[i % len(prompts) for i in range(batch_size)]]
        groups = [(chat_inputs(tokenizer, [prompts[i] for i in pick]).to(model.device),
                   _constraint(workload, pick, tokenizer)) for pick in picks]
        active = [c for c in per_workload[workload] if batch_size == 1 or not c.batch_one_only]
        results += _measure(model, groups, active, workload, batch_size, max_new_tokens, repeats, bar)
        if on_group is not None:
            on_group(results)
    bar.close()
    return results


def _workload_configs(configs: list[Config], workload: str, k: int, schedule: str) -> list[Config]:
    """The configurations a workload runs: a constrained one leaves out transformers' assisted generation (it
    cannot take a grammar) and adds `speculator="grammar"`."""
    if workload not in CONSTRAINED:
        return configs
    kept = [c for c in configs if not c.batch_one_only]
    if not any(c.kwargs.get("speculator") == "grammar" for c in kept):
        kept.append(Config("hf_specdec grammar", dict(speculator="grammar", speculative_schedule=schedule)))
    return kept


def _constraint(workload: str, picks: list[int], tokenizer) -> dict:
    """`generate` arguments constraining a constrained workload's rows (one grammar per row)."""
    if workload not in CONSTRAINED:
        return {}

    return dict(grammar=[Grammar.json_schema(CONSTRAINED[workload][i]) for i in picks], tokenizer=tokenizer)


def paired(reference: list[float], latencies: list[float]) -> list[float]:
    """Per repeat, the reference configuration's latency over this one's: the speedup in that repeat."""
    return [r / t for r, t in zip(reference, latencies)]


def _measure(model, groups, configs, workload, batch_size, max_new_tokens, repeats, bar) -> list[Result]:
    """Times each configuration on `groups`, `(inputs, extra generate arguments)` pairs run one after the other (a
    sample is their summed latency)."""
    pad = model.generation_config.pad_token_id

    def call(config, group, n):
        inputs, extra = group
        with mock.patch.dict(os.environ, config.env):
            start = time.perf_counter()
            out = model.generate(**inputs, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                                 **extra, **config.kwargs)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)  # the timing must include the last kernels
            return time.perf_counter() - start, out

    latencies = {c.name: [] for c in configs}
    ttfts = {c.name: [] for c in configs}
    outputs = {}
    first = {}
    # The first call of each configuration, timed apart: as a user meets it (with an empty cache it measures this
    # host first), then a second call on the same group. Then warm-up: on CUDA a full-length call per group
    # (Triton compiles a kernel variant per query-length bucket as steps meet them, 9 s in one float32 call on an
    # H200), elsewhere a short one.
    warm_tokens = max_new_tokens if model.device.type == "cuda" else 4
    for config in configs:
        (first_s, out), (second_s, _) = call(config, groups[0], max_new_tokens), call(config, groups[0], max_new_tokens)
        metrics = getattr(out, "speculative_metrics", None)
        first[config.name] = (first_s, second_s, metrics.measure_time_s if metrics is not None else None)
        for group in groups:
            call(config, group, 1)
            call(config, group, warm_tokens)
        bar.update(1)
    for repeat in range(repeats):
        # Each repeat starts one configuration later, so none always runs right after another.
        for config in configs[repeat % len(configs):] + configs[:repeat % len(configs)]:
            # TTFT: the fastest of three one-token calls per group (a call is short, so one slow spell of the host
            # would otherwise outweigh the whole decode and put TPOT below zero).
            ttfts[config.name].append(sum(min(call(config, group, 1)[0] for _ in range(TTFT_CALLS))
                                          for group in groups))
            timed = [call(config, group, max_new_tokens) for group in groups]
            latencies[config.name].append(sum(t for t, _ in timed))
            outputs[config.name] = [out for _, out in timed]
            bar.update(1)
    references = [out.sequences for out in outputs[configs[0].name]]
    base_latency = statistics.median(latencies[configs[0].name])
    base = latencies[configs[0].name]
    off, static = latencies.get(OFF), latencies.get(STATIC)
    results = []
    for config in configs:
        outs = outputs[config.name]
        latency, ttft = statistics.median(latencies[config.name]), statistics.median(ttfts[config.name])
        widths = [inputs["input_ids"].shape[1] for inputs, _ in groups]
        per_row = [out.sequences.shape[1] - w for out, w in zip(outs, widths)]  # longest row of each call
        new_tokens = sum(int((out.sequences[:, w:] != pad).sum()) if batch_size > 1 else n
                         for out, w, n in zip(outs, widths, per_row))
        # Speedup: the median over repeats of plain generate's latency over this one's in the same repeat (pairs
        # timed minutes apart at most, so a slow spell of the host hits both sides of most pairs).
        ratios = paired(base, latencies[config.name])
        decode = latency - ttft
        if decode <= 0:
            print(f"bench: {config.name} at batch {batch_size}: the one-token calls took longer than the full calls "
                  f"(TTFT {ttft:.3f} s, latency {latency:.3f} s), TPOT not reported; the host is too noisy for "
                  "this few new tokens, raise --repeats or --max-new-tokens")
        result = Result(workload, batch_size, config.name, new_tokens / latency, ttft / len(groups),
                        decode / max(sum(per_row) - len(groups), 1) if decode > 0 else None, latency, new_tokens,
                        statistics.median(ratios),
                        all(torch.equal(out.sequences, ref) for out, ref in zip(outs, references)),
                        speedup_of_medians=base_latency / latency, speedup_range=(min(ratios), max(ratios)))
        if off is not None:
            over_off = paired(off, latencies[config.name])
            result.speedup_over_off = statistics.median(over_off)
            result.speedup_over_off_range = (min(over_off), max(over_off))
        if static is not None:
            result.speedup_over_static = statistics.median(paired(static, latencies[config.name]))
        result.first_call_s, result.second_call_s, result.first_measure_s = first[config.name]
        metrics = [getattr(out, "speculative_metrics", None) for out in outs]
        if metrics[0] is not None:
            # Each row counted in the steps it took part in: at a batch, rows that finish before the longest one
            # are not fed in the steps after.
            row_steps = sum(m.num_row_steps for m in metrics)
            drafted = sum(m.num_draft_tokens for m in metrics)
            accepted = sum(m.num_accepted_tokens for m in metrics)
            drafts = sum(m.num_drafts for m in metrics)
            emitted = sum(m.num_emitted_tokens for m in metrics)
            result.acceptance_rate = accepted / drafted if drafted else 0.0
            result.mean_acceptance_length = (1 + accepted / drafts) if drafts else 1.0
            per_forward = emitted / max(row_steps, 1)
            drafted_per_forward = drafted / max(row_steps, 1)
            result.tokens_per_target_forward = per_forward
            result.ideal_speedup = per_forward / (1 + config.draft_cost * drafted_per_forward)
            result.fraction_of_ideal = result.speedup / result.ideal_speedup
            result.propose_ms_per_step = 1000 * sum(m.draft_time_s for m in metrics) / max(
                sum(m.num_steps for m in metrics), 1)
            if drafted:
                # Steps that drafted nothing (a lookup without a match, adaptive k keeping drafting off) are left out:
                # their proposing time is no drafted token's cost (`propose_ms_per_step` shows it).
                draft_time = sum(m.drafting_time_s for m in metrics)
                result.draft_ms_per_token = 1000 * draft_time * batch_size / drafted
                if results[0].tpot_s:
                    result.draft_to_target = result.draft_ms_per_token / (1000 * results[0].tpot_s)
        results.append(result)
    return results


def environment() -> dict:
    import transformers

    return {"machine": platform.machine(), "processor": platform.processor(), "cpus": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def save(results: list[Result], path_json: str, path_png: str | None, meta: dict) -> None:
    written = f"{path_json}.partial"  # then moved over the file: a run stopped mid-write keeps the last whole one
    with open(written, "w") as f:
        json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=2)
    os.replace(written, path_json)
    if path_png:
        plot(results, path_png)


def plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r.workload for r in results})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        rows = [r for r in results if r.workload == workload]
        configs = list(dict.fromkeys(r.config for r in rows))
        sizes = sorted({r.batch_size for r in rows})
        width = 0.8 / len(configs)
        for i, config in enumerate(configs):
            xs = [j + i * width for j, b in enumerate(sizes) if any(r.config == config and r.batch_size == b
                                                                     for r in rows)]
            ys = [r.speedup for b in sizes for r in rows if r.config == config and r.batch_size == b]
            ax.bar(xs, ys, width, label=config)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [f"batch {b}" for b in sizes])
        ax.set_ylabel("speedup over plain generate")
        ax.set_title(workload)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def fmt(value, spec: str) -> str:
    """`value` formatted by `spec`, or "-" where it was not measured."""
    return "-" if value is None else format(value, spec)


def spread(bounds: tuple[float, float] | None) -> str:
    """` (low-high)` of a ratio's repeats, or nothing where they agree to two decimals or were not measured."""
    if bounds is None or f"{bounds[0]:.2f}" == f"{bounds[1]:.2f}":
        return ""
    return f" ({bounds[0]:.2f}-{bounds[1]:.2f})"


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table: a header row, its rule, then one line per row."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + " --- |" * len(header),
                      *("| " + " | ".join(row) + " |" for row in rows)])


def table(results: list[Result]) -> str:
    """A markdown table of the results."""
    header = ["workload", "batch", "configuration", "tokens/s", "speedup", "vs off", "TTFT s", "TPOT ms", "acceptance",
              "mean acc. len", "propose ms/step", "draft ms/token", "draft/target", "ideal", "of ideal",
              "first call s", "second call s", "measure s", "vs static", "identical"]
    return markdown_table(header, [[
        r.workload, str(r.batch_size), r.config, f"{r.tokens_per_s:.1f}",
        f"{r.speedup:.2f}x{spread(r.speedup_range)}",
        fmt(r.speedup_over_off, ".2f") + spread(r.speedup_over_off_range), f"{r.ttft_s:.3f}",
        fmt(r.tpot_s and 1000 * r.tpot_s, ".1f"), fmt(r.acceptance_rate, ".2f"), fmt(r.mean_acceptance_length, ".2f"),
        fmt(r.propose_ms_per_step, ".1f"), fmt(r.draft_ms_per_token, ".1f"),
        fmt(r.draft_to_target, ".2f"), fmt(r.ideal_speedup, ".2f"), fmt(r.fraction_of_ideal, ".0%"),
        fmt(r.first_call_s, ".2f"), fmt(r.second_call_s, ".2f"), fmt(r.first_measure_s, ".2f"),
        fmt(r.speedup_over_static, ".2f"), "yes" if r.identical else "no"] for r in results])
