"""Newcomers' prefill beside the others' verify: one padded forward, or a step of its own?

The engine feeds a step as `[rows, q]` right-aligned rows (padded to the widest), so a newcomer's prompt in the same
forward as the running rows' verify makes every row as wide as that prompt. This times, side by side and
interleaved, the two ways for SmolLM2-135M-Instruct: one `[running + 1, prompt]` forward against a `[1, prompt]`
forward plus a `[running, k + 1]` one. Medians of `--repeats`.

    python benchmarks/prefill_mixing.py [--running 7] [--prompt 200] [--k 3] [--repeats 7]
"""

import argparse
import statistics
import time

import torch

from hf_specdec.models import DEFAULT_MODEL, load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--running", type=int, default=7)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(DEFAULT_MODEL)
    vocab = model.config.vocab_size

    def forward(rows: int, q: int) -> float:
        ids = torch.randint(0, vocab, (rows, q))
        start = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=args.k + 1)
        return time.perf_counter() - start

    mixed, separate = [], []
    forward(1, 8)
    for _ in range(args.repeats):
        mixed.append(forward(args.running + 1, args.prompt))
        separate.append(forward(1, args.prompt) + forward(args.running, args.k + 1))
    m, s = statistics.median(mixed), statistics.median(separate)
    print(f"{args.running} running rows verifying {args.k} drafts, one newcomer with a {args.prompt}-token prompt: "
          f"one padded forward {1000 * m:.0f} ms, prefill step + verify step {1000 * s:.0f} ms ({m / s:.1f}x)")


if __name__ == "__main__":
    main()
