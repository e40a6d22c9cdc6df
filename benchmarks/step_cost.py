"""Times target forwards of SmolLM2-135M (or `--model`) through the paged KV cache at batch 1/4/16, 1-16 tokens per
row and 64 or 256 tokens of context and fits the step-cost model adaptive k uses (`hf_specdec.StepCost`). Run on a
quiet machine; the CPU default in hf_specdec/costs/step_cost.py came from this fit.

    python benchmarks/step_cost.py [--model NAME] [--dtype bfloat16] [--device cuda] [--threads N]
"""
import argparse

import _common  # benchmarks/, this script's folder
import torch

from hf_specdec import StepCost

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
args = _common.add_model_args(parser, threads=None).parse_args()
model, _ = _common.load(args)
cost = StepCost.measure(model)
print(cost)
for rows in (1, 4, 16):
    for context in (64, 256):
        relative = [round(float(cost.relative(rows, torch.tensor(float(q)), rows * context)), 2)
                    for q in (1, 2, 3, 4, 6, 8, 11)]
        print(f"batch {rows}, {context} tokens of context: 1, 2, 3, 4, 6, 8, 11 tokens per row cost {relative} "
              "plain steps")
