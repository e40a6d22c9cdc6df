"""A ragged step's attention in one padded group against two (`paged_cache.query_groups`): rows feeding one token
beside one row verifying a draft (`[2, 1, 1, ...]`) or two rows verifying two (`[3, 3, 1, ...]`), through
hf_specdec's paged runner for SmolLM2-135M-Instruct on the PyTorch attention path, at several batch sizes and
contexts. Whole forwards, medians of `--repeats`, the two ways interleaved.

    python benchmarks/query_groups.py [--rows 4,8,20,30] [--contexts 250,600] [--repeats 7] [--threads 2]
"""

import argparse
import statistics

import torch

import hf_specdec.cache.paged as paged_cache
from _forwards import filled_runner, timed_forwards  # benchmarks/, this script's folder
from hf_specdec.runners.model_runner import paged_attention
from hf_specdec.models import DEFAULT_MODEL, load_model


def two_groups(counts: list[int]):
    """Always split: the rows at the shortest width in one group, the others at the longest in another."""
    widths = sorted(counts)
    if widths[0] == widths[-1]:
        return None
    return widths[0], [i for i, c in enumerate(counts) if c > widths[0]], widths[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="4,8,20,30")
    parser.add_argument("--contexts", default="250,600")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(DEFAULT_MODEL)
    rule = paged_cache.query_groups
    print("| context | rows | counts | one group ms | two groups ms | two/one | rule splits |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with torch.no_grad(), paged_attention(model):
        for context in (int(c) for c in args.contexts.split(",")):
            for rows in (int(r) for r in args.rows.split(",")):
                runner = filled_runner(model, rows, context)
                for counts in ([2] + [1] * (rows - 1), [3, 3] + [1] * (rows - 2)):
                    def use(split):
                        paged_cache.query_groups = two_groups if split else (lambda c: None)
                    times = timed_forwards(runner, context, {False: (counts, lambda: use(False)),
                                                             True: (counts, lambda: use(True))}, args.repeats)
                    paged_cache.query_groups = rule
                    one, two = (1000 * statistics.median(times[s]) for s in (False, True))
                    shown = f"[{', '.join(map(str, counts[:3]))}, ...]"
                    print(f"| {context} | {rows} | {shown} | {one:.1f} | {two:.1f} | {two / one:.2f} | "
                          f"{'yes' if rule(counts) is not None else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
