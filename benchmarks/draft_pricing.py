"""What a loaded server's drafts really cost, against what adaptive k believed when it chose them.

Replays `hf-specdec bench-serve`'s requests through `ServingEngine` in this process (as `serve_replay.py` does) and
records every step the policy observes: rows `B`, tokens fed `N`, cached tokens `C`, draft tokens fed and accepted,
the time of the target's forward and verify, and the relative cost the policy priced the step at. Then it fits the
run's own steps by least squares,

    t = a + b * B + c_draft * drafts + c_other * (N - B - drafts) + d * C + o * [drafted]

(a draft token and a prompt token fed beside the batch priced apart) and reports, over the steps with drafts:
what their drafts cost by the fit (`c_draft * drafts + o`), what the accepted tokens were worth (each at the step's
plain time per row), and what the policy predicted the drafting would cost. A policy that prices drafts right loses
no time on them; one that underprices them drafts where it loses. Last, controlled forwards (plain, and with 2 or 8
draft tokens, at 4, 12 and 24 rows of 300 cached tokens) against the relative costs the policy ended the run with.

    python benchmarks/draft_pricing.py --configs ngram,eagle
    python benchmarks/draft_pricing.py --curve   # the controlled forwards only, against the step cost's prices

`--model`, `--dtype`, `--threads`: the target (default SmolLM2-135M-Instruct, its own dtype, 2 threads).
"""

import argparse
import statistics

import _common  # benchmarks/, this script's folder
import numpy as np
import torch
from _forwards import filled_runner, timed_forwards
from serve_replay import replay

from hf_specdec.tools.speculator_args import speculator_from_spec as _speculator
from hf_specdec.serving.engine import ServingEngine


def record(model, tokenizer, name: str, requests, rate: float, max_batch_size: int):
    """Every observed step of one run of speculator `name`, the run's tokens/s and its policy."""
    spec, *options = name.split("-")
    engine = ServingEngine(model, tokenizer, _speculator(spec, model, tokenizer, model_name=model.config._name_or_path),
                           max_batch_size=max_batch_size, max_queue=len(requests), schedule="adaptive")
    policy = engine.step.policy
    for option in options:
        if option == "never":
            policy.min_gain = float("inf")
        elif option.startswith("margin"):
            policy.min_gain = float(option[len("margin"):])
        else:
            raise SystemExit(f"unknown option {option!r}: use -never or -marginX")
    steps, seen = [], [0]
    observe = policy.measured.observe

    def observed(rows, tokens_fed, context, draft_tokens, seconds):
        accepted = engine.metrics.num_accepted_tokens - seen[0]
        seen[0] = engine.metrics.num_accepted_tokens
        believed = None
        if policy.measured.ready and draft_tokens:  # what the policy's model said the drafts cost, in plain steps
            believed = float(policy.measured.relative(rows, torch.tensor(1 + draft_tokens / rows), context))
        steps.append(dict(rows=rows, fed=tokens_fed, context=context, drafts=draft_tokens, accepted=accepted,
                          drafted=draft_tokens > 0, seconds=seconds, believed=believed,
                          predicted=predicted.pop() if predicted else None))
        predicted.clear()
        observe(rows, tokens_fed, context, draft_tokens, seconds)

    policy.measured.observe = observed
    choose_rows, predicted = policy.choose_rows, []

    def chose(rows, available, classes=None, context=0.0, record=True):
        ks = choose_rows(rows, available, classes, context, record)
        rates = policy.acceptance(rows, classes)
        # Expected accepted drafts: a row's j-th is accepted with chance p^j, times the policy's calibration.
        c = policy.calibration
        predicted.append(sum(float((c * rates[i] ** torch.arange(1, k + 1, dtype=torch.float64)).clamp(max=1).sum())
                             for i, k in enumerate(ks)))
        return ks

    policy.choose_rows = chose
    streams, wall = replay(engine, requests, rate)
    return steps, sum(len(s.request.output_ids) for s in streams) / wall, policy


def controlled(model, policy, rows_list=(4, 12, 24), drafts_list=(2, 8), context: int = 300, repeats: int = 5):
    """Whole forwards through the paged runner at `rows` rows of `context` cached tokens each, plain and with
    `drafts` draft tokens (2 per row on the first rows), timed interleaved (medians), against what `policy` (an
    `AdaptiveK`, or a `StepCost`) says such a step costs relative to a plain one."""
    price = policy._relative if hasattr(policy, "_relative") else policy.relative_costs
    from hf_specdec.runners.model_runner import paged_attention

    with torch.no_grad(), paged_attention(model):
        for rows in rows_list:
            runner = filled_runner(model, rows, context)
            variants = {0: ([1] * rows, None)}
            for d in drafts_list:
                variants[d] = ([3 if i < d // 2 else 1 for i in range(rows)], None)
            times = timed_forwards(runner, context, variants, repeats)
            plain = statistics.median(times[0])
            cells = []
            for d in drafts_list:
                believed = float(price(rows, np.float64(1 + d / rows), float(rows * context)))
                cells.append(f"{d} drafts x{statistics.median(times[d]) / plain:.3f} (priced x{believed:.3f})")
            print(f"  rows {rows}, {context} cached each: plain {1e3 * plain:.0f} ms; " + "; ".join(cells))


def fit(steps: list[dict]) -> torch.Tensor:
    x = torch.tensor([[1.0, s["rows"], s["drafts"], s["fed"] - s["rows"] - s["drafts"], s["context"],
                       float(s["drafted"])] for s in steps], dtype=torch.float64)
    y = torch.tensor([s["seconds"] * 1e3 for s in steps], dtype=torch.float64)
    ridge = 1e-3 * torch.eye(x.shape[1], dtype=torch.float64)
    return torch.linalg.solve(x.T @ x + ridge, x.T @ y)


def report(name: str, steps: list[dict], speed: float) -> None:
    a, b, c_draft, c_other, d, o = fit(steps).tolist()
    print(f"\n{name}: {speed:.1f} tokens/s, {len(steps)} steps; fit: {a:.1f} ms + {b:.2f} ms/row + {c_draft:.2f} ms/draft "
          f"token + {c_other:.2f} ms/other token fed + {d * 1e3:.2f} ms/1000 cached + {o:.1f} ms when drafting")
    slowest = sorted(steps, key=lambda s: -s["seconds"])[:3]
    print("  slowest steps: " + "; ".join(f"{s['rows']} rows, {s['fed']} fed ({s['drafts']} drafts), "
                                          f"{1e3 * s['seconds']:.0f} ms" for s in slowest))
    drafting = [s for s in steps if s["drafted"]]
    if not drafting:
        print("  no step drafted")
        return
    lost = worth = 0.0
    ratios = []
    for s in drafting:
        plain = a + b * s["rows"] + c_other * (s["fed"] - s["rows"] - s["drafts"]) + d * s["context"]
        cost = c_draft * s["drafts"] + o  # what the drafts added, by the fit
        lost += cost
        worth += s["accepted"] * plain / s["rows"]  # each accepted token saves a row's share of a plain step
        if s["believed"] is not None:
            # The policy's relative cost of the step against the fit's: (plain + cost) / plain.
            ratios.append(((plain + cost) / plain) / s["believed"])
    by_rows = {}
    for s in drafting:
        by_rows.setdefault(min(s["rows"] // 8, 3), []).append(s)
    print(f"  {len(drafting)} steps drafted {sum(s['drafts'] for s in drafting)} tokens, "
          f"{sum(s['accepted'] for s in drafting)} accepted; drafts cost {lost / 1e3:.2f} s by the fit, "
          f"the accepted tokens were worth {worth / 1e3:.2f} s")
    if ratios:
        print(f"  fitted / believed relative cost of drafting steps: median {statistics.median(ratios):.3f} "
              f"(p10 {sorted(ratios)[len(ratios) // 10]:.3f}, p90 {sorted(ratios)[9 * len(ratios) // 10]:.3f})")
    for group, rows in sorted(by_rows.items()):
        label = ["1-7", "8-15", "16-23", "24+"][group]
        drafts, accepted = sum(s["drafts"] for s in rows), sum(s["accepted"] for s in rows)
        expected = sum(s["predicted"] or 0.0 for s in rows)
        print(f"  rows {label}: {len(rows)} steps, {drafts} drafted, {accepted} accepted "
              f"({accepted / max(drafts, 1):.2f}; the policy expected {expected:.1f} accepted)")


def profile(model, rows: int, context: int = 300, forwards: int = 5) -> None:
    """Self CPU time per forward of the ops that take the most, in plain forwards and in forwards where the first
    row verifies 2 drafts (a second attention group), under the PyTorch profiler."""
    from hf_specdec.runners.model_runner import paged_attention

    with torch.no_grad(), paged_attention(model):
        runner = filled_runner(model, rows, context)
        for name, counts in (("plain", [1] * rows), ("one row verifying 2 drafts", [3] + [1] * (rows - 1))):
            timed_forwards(runner, context, {name: (counts, None)}, 2)  # warm up
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                timed_forwards(runner, context, {name: (counts, None)}, forwards - 1)  # + its warm-up: `forwards`
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:6]
            print(f"{name}, {rows} rows: " + "; ".join(
                f"{e.key} {e.self_cpu_time_total / 1e3 / forwards:.1f} ms ({e.count // forwards} calls)" for e in ops)
                + " a forward")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="ngram,eagle")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--max-batch-size", type=int, default=32)
    _common.add_model_args(parser, options=("model", "dtype", "threads"))  # the controlled forwards are on the CPU
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="only a PyTorch profile of plain forwards against forwards where one row verifies 2 "
                             "drafts, at ROWS rows of 300 cached tokens: each op's time per forward")
    parser.add_argument("--curve", action="store_true",
                        help="only the controlled forwards (4-24 rows, 2-16 drafts) against the step cost adaptive k "
                             "starts from (this host's profile, else the static default)")
    args = parser.parse_args()
    model, tokenizer = _common.load(args)
    if args.profile:
        profile(model, args.profile)
        return
    if args.curve:
        from hf_specdec.costs.calibration import adaptive_costs
        from hf_specdec.speculators import NgramSpeculator

        step_cost, _, source = adaptive_costs(model, NgramSpeculator())
        print(f"step cost: {source}")
        controlled(model, step_cost, rows_list=(4, 8, 12, 16, 24), drafts_list=(2, 4, 8, 16), repeats=7)
        return
    requests = _common.serve_requests(tokenizer, args.requests)
    for name in args.configs.split(","):
        steps, speed, policy = record(model, tokenizer, name, requests, args.rate, args.max_batch_size)
        report(name, steps, speed)
        params = policy.measured.params
        print("  the policy's measured cost at the end (s, m, w, o): " + ", ".join(f"{p:.2f}" for p in params))
        controlled(model, policy)


if __name__ == "__main__":
    main()
