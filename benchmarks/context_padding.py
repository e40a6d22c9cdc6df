"""How much of a CPU attention step is padding: over an in-process replay of bench-serve's requests (speculation
off), the rows' context lengths at every step, and the gathered context area (rows x the longest context) against
the real one (the sum of the contexts), and against the best split of the rows into two length groups.

    python benchmarks/context_padding.py [--requests 32] [--rate 4]
"""

import argparse

import torch

import serve_replay
from hf_specdec.models import DEFAULT_MODEL, load_model
from hf_specdec.cache.paged import PagedKVCache
from hf_specdec.tools.serve_bench import workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seen = []
    plan_step = PagedKVCache.plan_step

    def recorded(self, seq_ids, starts, num_tokens, device, tree=None, packed=False):
        seen.append([s + n for s, n in zip(starts, num_tokens)])
        return plan_step(self, seq_ids, starts, num_tokens, device, tree, packed)

    PagedKVCache.plan_step = recorded
    try:
        model, tokenizer = load_model(DEFAULT_MODEL)
        _, _, line = serve_replay.run(model, tokenizer, "off", workload(tokenizer, args.requests), args.rate, 32)
    finally:
        PagedKVCache.plan_step = plan_step
    print(line)
    padded = real = two = 0
    for contexts in seen:
        if len(contexts) < 2:
            continue
        contexts = sorted(contexts)
        n, longest = len(contexts), contexts[-1]
        padded += n * longest
        real += sum(contexts)
        two += min(i * contexts[i - 1] + (n - i) * longest for i in range(1, n + 1))
    print(f"{len(seen)} steps; gathered area / real {padded / real:.2f}; best two length groups / real {two / real:.2f}")


if __name__ == "__main__":
    main()
