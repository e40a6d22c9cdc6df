"""Times target forwards of SmolLM2-135M through the paged KV cache at batch 1/4/16, 1-16 tokens per row and 64 or 256 tokens of context and fits
the step-cost model adaptive k uses (`hf_specdec.StepCost`). Run on a quiet machine; the CPU default in
hf_specdec/adaptive.py came from this fit."""
import torch

from hf_specdec import StepCost
from hf_specdec.models import load_model

model, _ = load_model()
cost = StepCost.measure(model)
print(cost)
for rows in (1, 4, 16):
    for context in (64, 256):
        relative = [round(float(cost.relative(rows, torch.tensor(float(q)), rows * context)), 2)
                    for q in (1, 2, 3, 4, 6, 8, 11)]
        print(f"batch {rows}, {context} tokens of context: 1, 2, 3, 4, 6, 8, 11 tokens per row cost {relative} "
              "plain steps")
