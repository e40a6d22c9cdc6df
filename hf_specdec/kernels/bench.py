"""Benchmarks of every verify kernel against its PyTorch reference and the roofline:
`python -m hf_specdec.kernels.bench [--out FILE.json]` on a CUDA machine; `--smoke` runs tiny shapes anywhere
(under TRITON_INTERPRET=1 on a CPU) to check the script itself."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .paged_attention.bench import bench as attention_bench
from .rejection_sample.bench import bench as rejection_bench
from .sampling.bench import bench as sampling_bench


def run(smoke: bool = False) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if smoke:
        return (rejection_bench(device, batch=3, k=2, vocab=37, repeats=1)
                + sampling_bench(device, rows=3, vocab=37, repeats=1)
                + attention_bench(device, batch=2, context=40, k=2, heads=4, kv_heads=2, head_dim=16,
                                  dtype=torch.float32, repeats=1))
    return rejection_bench(device) + sampling_bench(device) + attention_bench(device)


def table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        cells = [f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}" for key, value in row.items()]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: checks the script, measures nothing")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("the kernel benchmarks need a CUDA device (use --smoke to check the script on a CPU)", file=sys.stderr)
        return 2
    rows = run(smoke=args.smoke)
    if torch.cuda.is_available():
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
