"""Decode steps over rows of very different contexts, with the PyTorch path's context groups and without
(`paged_cache.context_groups`; docs/benchmarks.md, "Context groups"): per mix of context lengths, the median time
of a forward feeding one token per row, SmolLM2-135M on the CPU, the two settings alternating step by step.

    python benchmarks/context_groups.py [--steps 12] [--threads 2]
"""

import argparse
import statistics
import time

import torch

from hf_specdec.runners.model_runner import ModelRunner, paged_attention
from hf_specdec.models import DEFAULT_MODEL, load_model
from hf_specdec.cache.paged import CONTEXT_SPLIT_MIN, context_groups

MIXES = {
    "1 x 2000 + 6 x 300": [2000] + [300] * 6,
    "1 x 4000 + 15 x 300": [4000] + [300] * 15,
    "2 x 1500 + 20 x 400": [1500] * 2 + [400] * 20,
    "1 x 2000 + 2 x 300": [2000, 300, 300],
    "1 x 1000 + 12 x 500": [1000] + [500] * 12,
    "1 x 800 + 24 x 300": [800] + [300] * 24,
    "1 x 600 + 3 x 200": [600] + [200] * 3,
    "1 x 1200 + 4 x 200": [1200] + [200] * 4,
    "1 x 400 + 7 x 150": [400] + [150] * 7,
    "8 x 300 + 8 x 500": [300] * 8 + [500] * 8,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(DEFAULT_MODEL)
    vocab = model.config.vocab_size
    print(f"CONTEXT_SPLIT_MIN = {CONTEXT_SPLIT_MIN}")
    with torch.no_grad(), paged_attention(model):
        for name, lengths in MIXES.items():
            runners = {}
            for split in (False, None):
                runner = ModelRunner(model, block_size=16, num_blocks=64)
                runner.cache.context_split = split
                rows = list(range(len(lengths)))
                for row, n in enumerate(lengths):  # the contexts, a prompt per row
                    runner.add_sequence(row)
                    runner.forward([row], torch.randint(2, vocab, (1, n)), [n], num_logits=1)
                runners[split] = runner
            times = {False: [], None: []}
            for step in range(args.steps + 1):
                ids = torch.randint(2, vocab, (len(lengths), 1))
                for split, runner in runners.items():
                    start = time.perf_counter()
                    runner.forward(rows, ids, [1] * len(rows), num_logits=1)
                    if step:  # the first step of each warms up
                        times[split].append(time.perf_counter() - start)
                    for row in rows:
                        runner.rollback(row, runner.length(row) - 1)
            one, two = statistics.median(times[False]), statistics.median(times[None])
            taken = context_groups(lengths) is not None
            print(f"{name}: one group {1e3 * one:.1f} ms, {'two groups' if taken else 'rule keeps one'} "
                  f"{1e3 * two:.1f} ms ({one / two:.2f}x)", flush=True)
            if not taken:  # what two groups would have done
                import hf_specdec.cache.paged as paged_cache

                saved, paged_cache.CONTEXT_SPLIT_MIN = paged_cache.CONTEXT_SPLIT_MIN, 0
                forced = []
                try:
                    for _ in range(args.steps):
                        ids = torch.randint(2, vocab, (len(lengths), 1))
                        start = time.perf_counter()
                        runners[None].forward(rows, ids, [1] * len(rows), num_logits=1)
                        forced.append(time.perf_counter() - start)
                        for row in rows:
                            runners[None].rollback(row, runners[None].length(row) - 1)
                finally:
                    paged_cache.CONTEXT_SPLIT_MIN = saved
                print(f"    forced two groups: {1e3 * statistics.median(forced):.1f} ms "
                      f"({one / statistics.median(forced):.2f}x)", flush=True)


if __name__ == "__main__":
    main()
