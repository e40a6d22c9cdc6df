"""What serving over HTTP costs: `hf-specdec bench-serve`'s requests through `hf-specdec serve` (a server process
driven by streamed `/v1/completions` from this one, as bench-serve does) and through `ServingEngine` in this process
(no HTTP, as benchmarks/serve_replay.py), the same configuration, alternating, `--rounds` times. Reports each run's
tokens/s and the median of the per-round ratios HTTP / in-process.

    python benchmarks/serve_http_cost.py [--config off] [--rounds 3] [--requests 32] [--rate 4] [--threads 2]
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_replay import run as run_in_process  # noqa: E402

from hf_specdec.models import DEFAULT_MODEL, load_model
from hf_specdec.tools.serve_bench import run_server, workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="off", help="'off' (k = 0) or a speculator name (ngram, eagle)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(DEFAULT_MODEL)
    requests = workload(tokenizer, args.requests)
    spec, k = ("ngram", 0) if args.config == "off" else (args.config, None)
    speeds = {"in-process": [], "http": []}
    for r in range(args.rounds):
        for kind in (("in-process", "http") if r % 2 == 0 else ("http", "in-process")):
            if kind == "http":
                result, _ = run_server(DEFAULT_MODEL, spec, k, requests, args.rate, args.max_batch_size, kind,
                                       args.threads)
                speed = result.tokens_per_s
            else:
                speed, _, _ = run_in_process(model, tokenizer, args.config, requests, args.rate, args.max_batch_size)
            speeds[kind].append(speed)
            print(f"round {r} {kind}: {speed:.1f} tokens/s", flush=True)
    ratios = [h / i for h, i in zip(speeds["http"], speeds["in-process"])]
    print(f"{args.config}: in-process {', '.join(f'{s:.1f}' for s in speeds['in-process'])}; HTTP "
          f"{', '.join(f'{s:.1f}' for s in speeds['http'])}; HTTP / in-process median {statistics.median(ratios):.3f} "
          f"({', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
