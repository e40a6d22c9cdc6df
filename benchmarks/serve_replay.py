"""`hf-specdec bench-serve`'s requests through `ServingEngine` in this process, without HTTP: what each serving
configuration does to throughput when nothing but the engine differs. Rounds rotate the order; each round's tokens/s
is divided by the first configuration's in the same round, and the median of those ratios is reported, with the
steps, drafted and accepted tokens and the fitted step cost (`MeasuredStepCost.params`: scale, prompt-token scale,
price of a draft token and fixed cost of a step with drafts, both in ms) of each run. Every run's answers are compared with the first run's.

Configurations: `off` (k = 0), or a speculator (`ngram`, `eagle`, ...) with optional suffixes: `-static` (adaptive k
without the measured step cost), `-noweight` (rows not weighed by the work they have left), `-never` (no draft ever
pays: the speculator's cost when it drafts nothing), `-uncalibrated` (expected gains not scaled by the drafts
accepted over expected), `-unchecked` (no return check: `returns.DraftReturns`), `-unread` (a model speculator's backlog, read before
drafting, left unpriced: `Speculator.unread`), `-grouped` (no token rows: a step verifying drafts pads or groups its rows' queries,
`layout.token_rows_pay`), `-unpacked` (no packed linear weights: `HF_SPECDEC_PACKED_LINEAR=off`; also with
`off`), `-marginX` (`min_gain` X, e.g. `ngram-margin1.25`), `-subsets` (an EAGLE head drafts for the rows `AdaptiveK.choose_drafters` picks: `draft_subsets`), `-flat` (a GPU's flat step-cost curve on every model of the policy: drafts look
free, as they did to the H100's policy).

    python benchmarks/serve_replay.py --configs off,ngram,ngram-noweight,ngram-static --rounds 3

`--device cuda --dtype bfloat16` runs it on a GPU (the warm-up's steps are left out of the step times); `--model`
another target (`eagle` then means the head shipped for it).

`--profile`: one run per configuration with every step under cProfile (the engine thread's `Step.__call__`): the
time spent in steps, the steps, and the functions taking the most time, with their cumulative time per step.

    python benchmarks/serve_replay.py --configs off,eagle-never --profile
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import _common  # benchmarks/, this script's folder

from hf_specdec.costs.step_cost import DEFAULT_STEP_COST, MeasuredStepCost
from hf_specdec.tools.speculator_args import speculator_from_spec as _speculator
from hf_specdec.cache.paged import PagedKVCache
from hf_specdec.costs.returns import DraftReturns
from hf_specdec.serving.engine import ServingEngine


def configured(model, tokenizer, name: str, num_requests: int, max_batch_size: int) -> ServingEngine:
    """A serving engine (not started) for configuration `name`: `off` or a speculator, with the module docstring's
    options."""
    spec, *options = name.split("-")
    off = spec == "off"
    engine = ServingEngine(model, tokenizer, _speculator("ngram" if off else spec, model, tokenizer,
                                                         model_name=model.config._name_or_path),  # as loaded
                           num_speculative_tokens=0 if off else None, max_batch_size=max_batch_size,
                           max_queue=num_requests, schedule="constant" if off else "adaptive")
    policy = engine.step.policy
    if off and set(options) - {"unpacked"}:
        raise SystemExit(f"{name!r}: speculation off takes no options but -unpacked")
    for option in options:
        if option == "static":
            policy.measured = None
        elif option == "noweight":
            engine.scheduler.weigh_rows = False
        elif option == "never":  # the speculator's whole path, no draft ever paying: its cost when idle
            policy.min_gain = float("inf")
        elif option == "uncalibrated":
            policy.calibrate = False
        elif option == "unchecked":
            policy.returns = None
        elif option == "unread":  # a model speculator's backlog left unpriced (`Speculator.unread`)
            policy.read_horizon = float("inf")
        elif option.startswith("margin"):
            policy.min_gain = float(option[len("margin"):])
        elif option == "subsets":  # a model speculator drafts for the rows adaptive k picks (`choose_drafters`)
            policy.draft_subsets = True
        elif option in ("flat", "unpacked"):  # applied below, or by `run`
            pass
        elif option == "grouped":  # no token rows: steps verifying drafts pad or group their rows' queries
            PagedKVCache.token_rows = False
        else:
            raise SystemExit(f"unknown option {option!r} in {name!r}: use -static, -noweight, -never, -uncalibrated, "
                             f"-unchecked, -unread, -grouped, -flat, -unpacked, -subsets or -marginX")
    if "flat" in options:
        flat = DEFAULT_STEP_COST["cuda"]
        policy.step_cost = flat
        policy.measured = MeasuredStepCost(flat) if policy.measured is not None else None
        policy.returns = DraftReturns(flat) if policy.returns is not None else None
    return engine


def run(model, tokenizer, name: str, requests, rate: float, max_batch_size: int) -> tuple[float, list, str]:
    """Tokens/s, the answers, and a line describing the run."""
    engine = configured(model, tokenizer, name, len(requests), max_batch_size)
    policy = engine.step.policy
    steps = []  # per step once serving (the warm-up's are left out): seconds, draft tokens verified, rows running
    step = engine.scheduler.step

    def counted():
        if not engine._ready.is_set():
            return step()
        drafted, start = engine.scheduler.metrics.num_draft_tokens, time.perf_counter()
        rows = len(engine.scheduler.running)
        events = step()
        steps.append((time.perf_counter() - start, engine.scheduler.metrics.num_draft_tokens - drafted, rows))
        return events

    engine.scheduler.step = counted
    unpacked = "unpacked" in name.split("-")[1:]
    saved = os.environ.get("HF_SPECDEC_PACKED_LINEAR")
    try:
        if unpacked:  # the engine reads it as it starts (`host_linear`)
            os.environ["HF_SPECDEC_PACKED_LINEAR"] = "off"
        streams, wall = replay(engine, requests, rate)
    finally:
        PagedKVCache.token_rows = None
        if unpacked:
            os.environ.pop("HF_SPECDEC_PACKED_LINEAR") if saved is None else os.environ.update(
                HF_SPECDEC_PACKED_LINEAR=saved)
    answers = [stream.request.output_ids for stream in streams]
    tokens = sum(len(a) for a in answers)
    m = engine.metrics
    fitted = policy.measured.params if policy is not None and policy.measured is not None else None
    fitted = "-" if fitted is None else ", ".join(f"{p:.2f}" for p in fitted)
    calibration = f", calibration {policy.calibration:.2f}" if policy is not None else ""
    if policy is not None and policy.returns is not None:
        calibration += f"; returns per band: {policy.returns.summary()}"
    line = (f"{name}: {tokens / wall:.1f} tokens/s ({wall:.1f} s), {len(steps)} steps, {m.num_draft_tokens} drafted, "
            f"{m.num_accepted_tokens} accepted, fitted cost (s, m, w, o) {fitted}{calibration}; {step_times(steps, m)}")
    return tokens / wall, answers, line


def step_times(steps, metrics) -> str:
    """Where a run's step time went: the median step with and without drafts, and per step on average the
    proposing (the speculator and adaptive k), the target's forward with the verify, and the scheduler's own work
    around the step (admission, retiring, streaming)."""
    if not steps:
        return "no steps"
    plain = [s for s, d, _ in steps if d == 0]
    drafting = [s for s, d, _ in steps if d > 0]
    total = sum(s for s, _, _ in steps)
    n = len(steps)
    medians = ", ".join(f"{label} {1e3 * statistics.median(group):.1f} ms x{len(group)}"
                        for label, group in (("plain", plain), ("drafting", drafting)) if group)
    return (f"steps: {medians}; per step propose {1e3 * metrics.draft_time_s / n:.1f} ms, forward+verify "
            f"{1e3 * metrics.verify_time_s / n:.1f} ms, scheduler "
            f"{1e3 * (total - metrics.draft_time_s - metrics.verify_time_s) / n:.1f} ms, "
            f"rows {statistics.mean(r for _, _, r in steps):.1f} on average")


def replay(engine: ServingEngine, requests, rate: float) -> tuple[list, float]:
    """Starts `engine`, submits `requests` (prompt ids, max tokens) at `rate` per second, reads every answer to its
    end and shuts the engine down: the streams and the seconds from the first submission to the last answer."""
    engine.start()
    streams, start = [], time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(requests):
        time.sleep(max(0.0, start + i / rate - time.perf_counter()))
        streams.append(engine.submit(prompt, max_tokens))
    for stream in streams:
        for _ in stream:
            pass
    wall = time.perf_counter() - start
    engine.shutdown()
    return streams, wall


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="off,ngram,ngram-static")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--max-batch-size", type=int, default=32)
    _common.add_model_args(parser)
    parser.add_argument("--profile", action="store_true", help="one run per configuration, its steps under cProfile")
    args = parser.parse_args()
    model, tokenizer = _common.load(args)
    requests = _common.serve_requests(tokenizer, args.requests)
    configs = args.configs.split(",")
    if args.profile:
        for name in configs:
            profile(model, tokenizer, name, requests, args.rate, args.max_batch_size)
        return
    speeds = {c: [] for c in configs}
    reference = None
    for r in range(args.rounds):
        for name in configs[r % len(configs):] + configs[:r % len(configs)]:
            speed, answers, line = run(model, tokenizer, name, requests, args.rate, args.max_batch_size)
            reference = answers if reference is None else reference
            print(line + ("" if answers == reference else "  ANSWERS DIFFER"), flush=True)
            speeds[name].append(speed)
    print(f"| configuration | tokens/s per round | vs {configs[0]} (median of per-round ratios) |")
    print("| --- | --- | --- |")
    for name in configs:
        ratios = [a / b for a, b in zip(speeds[name], speeds[configs[0]])]
        print(f"| {name} | {', '.join(f'{s:.1f}' for s in speeds[name])} | {statistics.median(ratios):.3f} "
              f"({', '.join(f'{x:.3f}' for x in ratios)}) |")


def profile(model, tokenizer, name: str, requests, rate: float, max_batch_size: int) -> None:
    """One run of `name` with each step (`Step.__call__`, in the engine thread) under one cProfile profile."""
    from hf_specdec.decode.step import Step

    profiler, call = cProfile.Profile(), Step.__call__
    Step.__call__ = lambda self, *a: profiler.runcall(call, self, *a)
    try:
        _, _, line = run(model, tokenizer, name, requests, rate, max_batch_size)
    finally:
        Step.__call__ = call
    stats = pstats.Stats(profiler, stream=io.StringIO())
    steps = next(v[0] for k, v in stats.stats.items() if k[2] == "__call__" and k[0].endswith("step.py"))
    print(f"{line}; {stats.total_tt:.2f} s in {steps} steps ({1000 * stats.total_tt / steps:.1f} ms a step)")
    stats.sort_stats("tottime").print_stats(15)
    print(stats.stream.getvalue())


if __name__ == "__main__":
    main()
