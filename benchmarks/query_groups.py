"""A ragged step's attention in one padded group against two (`paged_cache.query_groups`): rows feeding one token
beside one row verifying a draft (`[2, 1, 1, ...]`) or two rows verifying two (`[3, 3, 1, ...]`), through
hf_specdec's paged runner for SmolLM2-135M-Instruct on the PyTorch attention path, at several batch sizes and
contexts. Whole forwards, medians of `--repeats`, the two ways interleaved.

    python benchmarks/query_groups.py [--rows 4,8,20,30] [--contexts 250,600] [--repeats 7] [--threads 2]
"""

import argparse
import statistics
import time

import torch

import hf_specdec.paged_cache as paged_cache
from hf_specdec.model_runner import ModelRunner, paged_attention
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
    vocab = model.config.vocab_size
    rule = paged_cache.query_groups
    print("| context | rows | counts | one group ms | two groups ms | two/one | rule splits |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with torch.no_grad(), paged_attention(model):
        for context in (int(c) for c in args.contexts.split(",")):
            for rows in (int(r) for r in args.rows.split(",")):
                runner = ModelRunner(model, num_blocks=rows * (context + 64) // 16 + 8, packed=True)
                for seq in range(rows):
                    runner.add_sequence(seq)
                runner.forward(list(range(rows)), torch.randint(vocab, (rows, context)), [context] * rows, 1)
                for counts in ([2] + [1] * (rows - 1), [3, 3] + [1] * (rows - 2)):
                    times = {False: [], True: []}
                    for repeat in range(args.repeats + 1):
                        for split in ((False, True) if repeat % 2 else (True, False)):
                            paged_cache.query_groups = two_groups if split else (lambda c: None)
                            ids = torch.randint(vocab, (rows, max(counts)))
                            start = time.perf_counter()
                            runner.forward(list(range(rows)), ids, counts, max(counts), logit_counts=counts)
                            elapsed = time.perf_counter() - start
                            for seq in range(rows):
                                runner.rollback(seq, context)
                            if repeat:  # the first round warms up
                                times[split].append(elapsed)
                    paged_cache.query_groups = rule
                    one, two = (1000 * statistics.median(times[s]) for s in (False, True))
                    shown = f"[{', '.join(map(str, counts[:3]))}, ...]"
                    print(f"| {context} | {rows} | {shown} | {one:.1f} | {two:.1f} | {two / one:.2f} | "
                          f"{'yes' if rule(counts) is not None else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
