"""bench-serve's requests through the serving engine's scheduler on a virtual clock: the real model, the real drafts
and the real adaptive k, but every step lasts what a fixed cost model says, so runs are deterministic and a policy
change is compared without this host's drift (±8-15% between identical runs,
docs/log/2026-11-28-benchmarks-history.md).

A step of B rows over C cached tokens feeding P prompt tokens and D drafts lasts
`fixed + per_row * B + per_context * C + per_prompt * P + per_draft * D + draft_step * [D > 0]` ms, plus
`lookup` ms for n-gram's lookup on every step, the drafts' part scaled by `min(1, B / draft_knee)` (a CPU's
matrix kernels at a few rows are bound by reading the weights, and a few more tokens cost little there; default 1:
no scaling). The other defaults are this CPU's SmolLM2 figures (docs/log/2026-11-28-benchmarks-history.md: whole
forwards at 4-28 rows over 300 cached tokens, by the retired `token_rows.py`, docs/log/2026-11-28-retired-benchmarks.md;
drafts at 3-7 ms a token; prefill ~1.5 ms a token).
The policy times its steps on the same clock (`MeasuredStepCost`, `DraftReturns`), so it learns these costs (the
lookup's passes before the step's own timing starts: it is paid by every step alike).
Requests arrive at `--rate` per second of virtual time; the throughput is tokens over the virtual time from the first
arrival to the last answer. An EAGLE head's forwards cost `--head-forward` ms each plus `--head-token` ms per token
they run (defaults 0: set them from a profile of this host's head; here about 4.5 ms and 0.078 ms, the second from
catch-ups of 3-1378 states timed in a served run).

    python benchmarks/serve_sim.py --configs off,ngram,ngram-unchecked,eagle,eagle-unchecked --head-forward 4

`--weight-power P` weighs rows by the work they have left to the power P (`AdaptiveK.WEIGHT_POWER`).

Small changes of policy move which requests share which steps, and that moves the throughput by a percent or two
either way on its own (a deterministic but chaotic system); `--seeds N` runs each configuration N times, the exact
schedule and then arrivals moved a little (seeded), and reports the median of the per-seed ratios with their range.

Configurations as `serve_replay.py`'s (`off`, a speculator, and its options: `-unchecked`, `-never`, `-flat`, ...).
"""

import argparse
import statistics
import types
from contextlib import ExitStack

import _common  # benchmarks/, this script's folder
import torch
from serve_replay import configured

from hf_specdec.decode import step as step_module
from hf_specdec.costs.adaptive import AdaptiveK
from hf_specdec.costs.calibration import host_linear
from hf_specdec.runners.dense import runner_attention
from hf_specdec.decode.requests import Request


class Clock:
    now = 0.0

    def perf_counter(self) -> float:
        return self.now


def simulate(model, tokenizer, name: str, requests, rate: float, costs: argparse.Namespace, max_batch_size: int,
             seed: int = 0):
    engine = configured(model, tokenizer, name, len(requests), max_batch_size)  # serve_replay's options
    spec, policy = name.split("-")[0], engine.step.policy
    off = spec == "off"
    clock = Clock()
    target = engine.target
    forward = target.forward

    def timed_forward(rows, input_ids, num_fed, *args, logit_counts=None, **kwargs):
        b, fed = len(rows), sum(num_fed)
        drafts = sum(logit_counts) - b if logit_counts is not None else 0
        context = sum(target.length(r) for r in rows)
        ms = (costs.fixed + costs.per_row * b + costs.per_context * context + costs.per_prompt * (fed - b - drafts)
              + (costs.per_draft * drafts + costs.draft_step * (drafts > 0)) * min(1.0, b / costs.draft_knee))
        clock.now += ms / 1e3
        return forward(rows, input_ids, num_fed, *args, logit_counts=logit_counts, **kwargs)

    target.forward = timed_forward
    lookup = costs.lookup / 1e3 if spec == "ngram" and not off else 0.0
    head = getattr(engine.speculator, "head", None)
    if head is not None and (costs.head_forward or costs.head_token):  # a head's forward (drafting, or reading
        # committed states): a fixed part and one per token it runs (padding included)
        def head_cost(module, args, kwargs):
            clock.now += (costs.head_forward + costs.head_token * kwargs["input_ids"].numel()) / 1e3

        head.register_forward_pre_hook(head_cost, with_kwargs=True)
    scheduler = engine.scheduler
    call = scheduler.step

    def step():
        clock.now += lookup
        return call()

    step_module.time = types.SimpleNamespace(perf_counter=clock.perf_counter)
    with ExitStack() as stack:  # what the engine's thread sets up (`ServingEngine._run`), on this thread
        stack.enter_context(torch.no_grad())
        stack.enter_context(runner_attention(model))
        stack.enter_context(host_linear(model, engine.speculator, engine.calibration))
        engine.speculator.begin(model, engine.batch)
        stack.callback(engine.speculator.end)
        stack.callback(setattr, step_module, "time", __import__("time"))
        arrivals = [i / rate for i in range(len(requests))]
        if seed:  # each arrival moved by up to a tenth of the gap between arrivals, either way
            g = torch.Generator().manual_seed(seed)
            arrivals = sorted(max(0.0, a + (float(torch.rand((), generator=g)) - 0.5) * 0.2 / rate) for a in arrivals)
        pending = [Request(list(p), n) for p, n in requests]
        done_at, first_at, submitted = {}, {}, 0
        while len(done_at) < len(pending):
            while submitted < len(pending) and arrivals[submitted] <= clock.now:
                scheduler.add(pending[submitted])
                submitted += 1
            if not scheduler.has_work():
                clock.now = arrivals[submitted]
                continue
            for request, tokens, finished in step():
                if tokens and request.request_id not in first_at:
                    first_at[request.request_id] = clock.now
                if finished:
                    done_at[request.request_id] = clock.now
    tokens = sum(r.num_generated for r in pending)
    end = max(done_at.values())
    if costs.verbose:
        for i, (r, a) in enumerate(zip(pending, arrivals)):
            print(f"  request {i}: arrives {a:.2f} s, {r.num_generated} of {r.max_new_tokens} tokens, done "
                  f"{done_at[r.request_id]:.2f} s")
    m = engine.metrics
    ttft = sorted(first_at[r.request_id] - a for r, a in zip(pending, arrivals))
    returns = f"; returns {policy.returns.summary()}" if policy is not None and policy.returns is not None else ""
    return tokens / end, [r.output_ids for r in pending], (
        f"{name}: {tokens / end:.2f} tokens/s (virtual), {m.num_draft_tokens} drafted, {m.num_accepted_tokens} "
        f"accepted, TTFT p50 {ttft[len(ttft) // 2]:.2f} s{returns}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="off,ngram,ngram-unchecked")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--max-batch-size", type=int, default=32)
    _common.add_model_args(parser, options=("model", "dtype", "threads"))  # timed by the cost model, not a device
    for name, default in (("fixed", 66.0), ("per-row", 1.9), ("per-context", 0.00925), ("per-prompt", 1.5),
                          ("per-draft", 4.0), ("draft-step", 7.0), ("lookup", 1.2), ("head-forward", 0.0),
                          ("head-token", 0.0), ("draft-knee", 1.0)):
        parser.add_argument(f"--{name}", type=float, default=default, help=f"ms (default {default})")
    parser.add_argument("--verbose", action="store_true", help="each request's arrival, tokens and end")
    parser.add_argument("--seeds", type=int, default=1,
                        help="runs per configuration: the exact schedule, then arrivals each moved by up to a tenth "
                             "of their gap (seeded); reported: the median of the per-seed ratios")
    parser.add_argument("--weight-power", type=float, default=None,
                        help=f"AdaptiveK.WEIGHT_POWER for every configuration (default {AdaptiveK.WEIGHT_POWER})")
    args = parser.parse_args()
    if args.weight_power is not None:
        AdaptiveK.WEIGHT_POWER = args.weight_power
    model, tokenizer = _common.load(args)
    requests = _common.serve_requests(tokenizer, args.requests)
    reference, speeds = None, {}
    configs = args.configs.split(",")
    for seed in range(args.seeds):
        for name in configs:
            speed, answers, line = simulate(model, tokenizer, name, requests, args.rate, args, args.max_batch_size,
                                            seed)
            reference = answers if reference is None else reference
            speeds.setdefault(name, []).append(speed)
            print(f"seed {seed}: " * (args.seeds > 1) + line + ("" if answers == reference else "  ANSWERS DIFFER"),
                  flush=True)
    first = speeds[configs[0]]
    ratios = {n: [a / b for a, b in zip(s, first)] for n, s in speeds.items()}
    print(" | ".join(f"{n} {statistics.median(r):.3f}x" + (f" ({min(r):.3f}-{max(r):.3f})" if len(r) > 1 else "")
                     for n, r in ratios.items()))


if __name__ == "__main__":
    main()
