"""The LM head over the positions rows need, against every row's `num_logits` (a packed verify in which one row
verifies many drafts beside rows feeding one token): `ModelRunner.forward(logit_counts=)` on and off, side by side.

    python benchmarks/packed_logits.py --rows 32 --drafts 10 --repeats 7
"""

import argparse
import statistics
import time

import torch

from hf_specdec.runners.support import check_model_supported
from hf_specdec.runners.model_runner import ModelRunner, paged_attention
from hf_specdec.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--drafts", type=int, default=10, help="drafts of the one row that verifies")
    parser.add_argument("--context", type=int, default=250, help="tokens cached per row")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    check_model_supported(model, "target model")
    vocab = model.config.vocab_size
    counts = [1] * (args.rows - 1) + [args.drafts + 1]
    rows = list(range(args.rows))
    ids = torch.randint(vocab, (args.rows, max(counts)))
    times = {"every row's num_logits": [], "each row's own (logit_counts)": []}
    with torch.no_grad(), paged_attention(model):
        runner = ModelRunner(model)
        for row in rows:
            runner.add_sequence(row)
        runner.forward(rows, torch.randint(vocab, (args.rows, args.context)), [args.context] * args.rows, 1)
        for i in range(args.repeats + 1):
            for name in (list(times) if i % 2 else list(times)[::-1]):  # alternate which goes first
                start = time.perf_counter()
                runner.forward(rows, ids, counts, num_logits=args.drafts + 1,
                               logit_counts=[c for c in counts] if name.startswith("each") else None)
                elapsed = time.perf_counter() - start
                for row in rows:
                    runner.rollback(row, args.context)
                if i:  # the first round warms up
                    times[name].append(elapsed)
    base = statistics.median(times["every row's num_logits"])
    for name, values in times.items():
        print(f"{name}: median {1000 * statistics.median(values):.1f} ms ({base / statistics.median(values):.2f}x)")


if __name__ == "__main__":
    main()
