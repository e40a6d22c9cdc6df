"""One target forward by tokens fed, eager and compiled: what a decode step and a verify of 1, 2, ... drafts cost.

Rows of `--context` cached tokens each (random ones, prefilled) feed 1, 2, ... tokens in one forward, through
hf_specdec's packed runner. Eager: with this host's linear forms (the cached profile, as `generate` applies them; the
first call's measuring runs here if there is none). Compiled: the steps `HF_SPECDEC_COMPILE=1` compiles (on a CPU
with the weights frozen into the graph, `runners/graphed.py`), each width's first forward (its compile) left out.
Widths are timed interleaved, widest first, the order reversed every other repeat; medians in milliseconds.

    python benchmarks/forward_widths.py [--rows 1] [--context 400] [--widths 1,2,3,4,5,6,8,12] [--repeats 7]
        [--no-compile] [--model NAME] [--threads 2]

The table in docs/benchmarks.md, "With the weights frozen into the graph", is this script's output.
"""

import argparse
import statistics
import time

import _common  # benchmarks/, this script's folder
import torch
from _forwards import filled_runner

from hf_specdec.costs.calibration import ensure_profile, host_linear
from hf_specdec.runners.dense import runner_attention
from hf_specdec.runners.graphed import for_model, requested_settings


def timed(model, rows: int, context: int, widths: list[int], repeats: int, compiled: bool) -> dict[int, float]:
    """Median milliseconds of one forward per width."""
    # A real prefill, not `fill_context`'s reserved (zero) keys and values: over those the compiled step's logits
    # differed from the eager step's by up to 1e-4 of their largest (2e-6 after a prefill), and its trial could fail.
    runner = filled_runner(model, rows, context)
    seqs = list(range(rows))
    mode = None
    if compiled:
        settings = for_model(requested_settings(model.device), model)
        if settings is None:
            raise SystemExit(f"{type(model).__name__}'s steps cannot be compiled here (said above)")
        runner.use_graphs(settings)
        mode = "frozen" if settings.frozen else "compiled"
    times = {q: [] for q in widths}
    with host_linear(model, compiled=mode):
        for repeat in range(repeats + 1):  # the first round compiles (or warms up) each width
            for q in (widths if repeat % 2 else widths[::-1]):
                ids = torch.randint(model.config.vocab_size, (rows, q))
                start = time.perf_counter()
                runner.forward(seqs, ids, [q] * rows, q, logit_counts=[q] * rows)
                elapsed = time.perf_counter() - start
                for seq in seqs:
                    runner.rollback(seq, context)
                if repeat:
                    times[q].append(elapsed)
                elif compiled:
                    print(f"  width {q}: first forward (compile) {elapsed:.1f} s", flush=True)
    return {q: 1000 * statistics.median(t) for q, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common.add_model_args(parser)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--context", type=int, default=400, help="cached tokens per row")
    parser.add_argument("--widths", default="1,2,3,4,5,6,8,12", help="tokens fed per row, comma-separated")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true", help="time the eager forwards only")
    args = parser.parse_args()
    widths = sorted({int(w) for w in args.widths.split(",")})
    if not 1 <= widths[0] <= widths[-1] <= 64:  # `filled_runner` leaves 64 slots a row past the context
        parser.error(f"--widths must be between 1 and 64 tokens, got {args.widths}")
    model, _ = _common.load(args)
    results = {}
    with torch.no_grad(), runner_attention(model):
        ensure_profile(model)  # this host's linear forms, measured once if not cached
        results["eager, this host's linear forms"] = timed(model, args.rows, args.context, widths, args.repeats,
                                                           False)
        if not args.no_compile:
            import os

            os.environ["HF_SPECDEC_COMPILE"] = "1"
            results["compiled (HF_SPECDEC_COMPILE=1)"] = timed(model, args.rows, args.context, widths,
                                                               args.repeats, True)
    print(f"\n{args.rows} row(s), {args.context} cached tokens each, {torch.get_num_threads()} threads, "
          f"medians of {args.repeats}, ms")
    print("| tokens fed | " + " | ".join(str(q) for q in widths) + " |")
    print("| --- |" + " --- |" * len(widths))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[q]:.1f}" for q in widths) + " |")


if __name__ == "__main__":
    main()
