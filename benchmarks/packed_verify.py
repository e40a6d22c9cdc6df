"""The packed verify against the padded one: what a ragged step costs each way.

A verify step where rows feed different numbers of tokens (n-gram lookup: rows with a match feed their drafts, the
others one token) runs either padded (`[rows, widest]`, every row as wide as the widest) or packed (one stream of
the rows' real tokens, `paged_cache.PackedLayout`). This times both through hf_specdec's paged runner for
SmolLM2-135M-Instruct, side by side and interleaved, over `--context` cached tokens per row. Each case names how many
rows feed `k + 1` tokens (the rest feed 1). Medians of `--repeats`.

    python benchmarks/packed_verify.py [--batch-sizes 4,16] [--k 5] [--context 256] [--repeats 9] [--threads 2]
"""

import argparse
import statistics
import time

import torch

from hf_specdec.runners.support import check_model_supported
from hf_specdec.runners.model_runner import ModelRunner, paged_attention
from hf_specdec.models import DEFAULT_MODEL, load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="4,16")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(DEFAULT_MODEL)
    check_model_supported(model, "target model")
    print(f"packed trial passed: {model._hf_specdec_packable}")
    vocab = model.config.vocab_size
    print(f"| batch | rows drafting {args.k} | tokens padded | tokens packed | padded ms | packed ms | packed/padded |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with torch.no_grad(), paged_attention(model):
        for rows in (int(b) for b in args.batch_sizes.split(",")):
            runners = {}
            for packed in (False, True):
                runner = runners[packed] = ModelRunner(model, num_blocks=rows * (args.context + 64) // 16 + 8,
                                                       packed=packed)
                for seq in range(rows):
                    runner.add_sequence(seq)
                runner.forward(list(range(rows)), torch.randint(vocab, (rows, args.context)), [args.context] * rows,
                               1)
            for drafting in sorted({1, rows // 4, rows // 2, rows - 1}):
                counts = [args.k + 1] * drafting + [1] * (rows - drafting)
                ids = torch.randint(vocab, (rows, args.k + 1))
                times = {False: [], True: []}
                for repeat in range(args.repeats + 1):
                    for packed in ((False, True) if repeat % 2 else (True, False)):
                        runner = runners[packed]
                        start = time.perf_counter()
                        runner.forward(list(range(rows)), ids, counts, args.k + 1)
                        elapsed = time.perf_counter() - start
                        for seq in range(rows):
                            runner.rollback(seq, args.context)
                        if repeat:  # the first round warms up
                            times[packed].append(elapsed)
                padded, packed = (1000 * statistics.median(times[p]) for p in (False, True))
                print(f"| {rows} | {drafting} | {rows * (args.k + 1)} | {sum(counts)} | {padded:.1f} | {packed:.1f} "
                      f"| {packed / padded:.2f} |")


if __name__ == "__main__":
    main()
