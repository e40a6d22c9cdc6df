"""Top-k's threshold on the PyTorch path: each row's k-th largest score from a full-vocabulary sort against from
`topk` of the largest k, at the serving engine's shapes (26 positions, SmolLM2's 49152-token vocabulary, k = 50).

    python benchmarks/topk_threshold.py [--rows 26] [--vocab 49152] [--k 50] [--threads 2]
"""
import argparse
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=26)
parser.add_argument("--vocab", type=int, default=49152)
parser.add_argument("--k", type=int, default=50)
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
torch.set_num_threads(args.threads)
scores = torch.randn(args.rows, args.vocab)
k = torch.full((args.rows,), args.k)
ways = {"sort": lambda: scores.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None]),
        "topk": lambda: scores.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])}
assert torch.equal(ways["sort"](), ways["topk"]())
for name, way in ways.items():
    for _ in range(3):
        way()
    start = time.perf_counter()
    for _ in range(20):
        way()
    print(f"{name}: {(time.perf_counter() - start) / 20 * 1000:.2f} ms")
