"""What padding a step's queries costs the PyTorch attention path: SDPA over SmolLM2-135M's attention shapes (9 query
heads, 3 key/value heads, head dim 64) for `--rows` rows against `--context` cached tokens, masked as the paged cache
masks, with q = 1, 2 and 3 queries per row, summed over the model's 30 layers. One row verifying a draft beside rows
feeding one token used to pad every row to q = 2 (`paged_cache.query_groups`). Medians of `--repeats`.

    python benchmarks/ragged_attention.py [--rows 20] [--context 256] [--repeats 7] [--threads 2]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=20)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers, heads, kv_heads, dim = 30, 9, 3, 64
    keys = torch.randn(args.rows, kv_heads, args.context, dim)
    values = torch.randn(args.rows, kv_heads, args.context, dim)
    print("| queries per row | ms over 30 layers |")
    print("| --- | --- |")
    for q in (1, 2, 3):
        query = torch.randn(args.rows, heads, q, dim)
        mask = torch.ones(args.rows, 1, q, args.context, dtype=torch.bool)
        mask[..., -3:] = False  # rows of different lengths: padding slots masked
        times = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            for _ in range(layers):
                F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
            times.append(time.perf_counter() - start)
        print(f"| {q} | {1000 * statistics.median(times[1:]):.1f} |")


if __name__ == "__main__":
    main()
