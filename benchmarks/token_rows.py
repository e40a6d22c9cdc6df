"""A row per token in a packed step's attention (the PyTorch path), against the rows padded to a common query width
or split into two groups (`query_groups`): whole SmolLM2 forwards of `ROWS` rows of 300 cached tokens, where some rows
verify drafts beside rows feeding one token, timed interleaved (medians).

    python benchmarks/token_rows.py [--rows 4,8,12,20,28] [--repeats 7]

Each shape runs both ways on the same runner (`PagedKVCache.token_rows` True / False), and a plain step (one token
per row) is timed beside them: the extra time over it is what the drafts cost each way.
"""

import argparse
import statistics

import torch

from hf_specdec.runners.model_runner import paged_attention
from hf_specdec.models import DEFAULT_MODEL, load_model
from _forwards import filled_runner, timed_forwards  # benchmarks/, this script's folder


def shapes(rows: int) -> dict:
    """Tokens per row: one row verifying 2 drafts, two rows verifying 2, and rows // 4 rows verifying 1."""
    out = {"1 row +2": [3] + [1] * (rows - 1), "2 rows +2": [3, 3] + [1] * (rows - 2)}
    if rows >= 8:
        out[f"{rows // 4} rows +1"] = [2] * (rows // 4) + [1] * (rows - rows // 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="4,8,12,20,28")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(DEFAULT_MODEL)
    print("| rows | drafts | plain step ms | token rows: ms (extra) | padded or grouped: ms (extra) | token rows saved |")
    print("| --- | --- | --- | --- | --- | --- |")
    with paged_attention(model), torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            runner = filled_runner(model, rows, args.context)

            def setting(value):
                return lambda: setattr(runner.cache, "token_rows", value)

            variants = {"plain": ([1] * rows, None)}
            for name, counts in shapes(rows).items():
                variants[name + " token"] = (counts, setting(True))
                variants[name + " grouped"] = (counts, setting(False))
            times = timed_forwards(runner, args.context, variants, args.repeats)
            med = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            for name in shapes(rows):
                token, grouped, plain = med[name + " token"], med[name + " grouped"], med["plain"]
                print(f"| {rows} | {name} | {plain:.1f} | {token:.1f} ({token - plain:+.1f}) | {grouped:.1f} "
                      f"({grouped - plain:+.1f}) | {grouped - token:+.1f} ms |", flush=True)
            runner.cache.token_rows = None


if __name__ == "__main__":
    main()
