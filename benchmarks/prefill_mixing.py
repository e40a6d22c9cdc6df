"""Newcomers' prefill beside the others' verify: one packed step, or a step of its own?

Through hf_specdec's own runner and paged cache (SmolLM2-135M-Instruct): `--running` rows with `--context` cached
tokens each verify `--k` drafts while one newcomer feeds a `--prompt`-token prompt. Timed side by side, interleaved,
after rolling the cache back each time:
- mixed, grouped: one packed step; the PyTorch attention pads the running rows and the newcomer separately
  (`paged_cache.query_groups`), as the engine does;
- mixed, one group: the same step with the attention padded to the prompt for every row (as before the groups);
- separate: the newcomer's prefill step, then the running rows' verify step.
Medians of `--repeats`.

    python benchmarks/prefill_mixing.py [--running 11] [--context 150] [--prompt 200] [--k 3] [--repeats 7]
"""

import argparse
import statistics
import time
from unittest import mock

import torch

from hf_specdec.cache import paged as paged_cache
from hf_specdec.runners.support import check_model_supported
from hf_specdec.runners.model_runner import ModelRunner, paged_attention
from hf_specdec.models import DEFAULT_MODEL, load_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--running", type=int, default=11)
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(DEFAULT_MODEL)
    check_model_supported(model, "target model")  # the packed trial: the engine takes packed steps after it
    vocab, running, newcomer, width = model.config.vocab_size, list(range(args.running)), args.running, args.k + 1
    layers = (0, model.config.num_hidden_layers // 2, model.config.num_hidden_layers)  # as an EAGLE-3 head reads
    g = torch.Generator().manual_seed(0)

    def ids(rows: int, q: int) -> torch.Tensor:
        return torch.randint(2, vocab, (rows, q), generator=g)

    with torch.no_grad(), paged_attention(model):
        runner = ModelRunner(model)
        for row in running + [newcomer]:
            runner.add_sequence(row)
        for row in running:
            runner.forward([row], ids(1, args.context), [args.context], num_logits=1)

        def timed(run) -> float:
            start = time.perf_counter()
            run()
            elapsed = time.perf_counter() - start
            for row in running:
                runner.rollback(row, args.context)
            runner.rollback(newcomer, 0)
            return elapsed

        def mixed():
            runner.forward(running + [newcomer], ids(args.running + 1, args.prompt),
                           [width] * args.running + [args.prompt], num_logits=width, output_hidden_states=layers)

        def one_group():
            with mock.patch.object(paged_cache, "query_groups", lambda *a: None):
                mixed()

        def separate():
            runner.forward([newcomer], ids(1, args.prompt), [args.prompt], num_logits=1, output_hidden_states=layers)
            runner.forward(running, ids(args.running, width), [width] * args.running, num_logits=width,
                           output_hidden_states=layers)

        ways = {"mixed, grouped": mixed, "mixed, one group": one_group, "separate steps": separate}
        times = {name: [] for name in ways}
        for run in ways.values():
            timed(run)  # warm-up
        for _ in range(args.repeats):
            for name, run in ways.items():
                times[name].append(timed(run))
    base = statistics.median(times["separate steps"])
    print(f"{args.running} running rows ({args.context} cached tokens each) verifying {args.k} drafts, one newcomer "
          f"with a {args.prompt}-token prompt, medians of {args.repeats}:")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:17s} {1000 * median:6.0f} ms  ({median / base:.2f}x separate steps)")


if __name__ == "__main__":
    main()
