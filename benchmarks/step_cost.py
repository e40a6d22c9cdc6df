"""Times target forwards of SmolLM2-135M through the paged KV cache at batch 1/4/16 and 1-16 tokens per row and fits
the step-cost model adaptive k uses (`hf_specdec.StepCost`). Run on a quiet machine; the CPU default in
hf_specdec/adaptive.py came from this fit."""
import torch

from hf_specdec import StepCost
from hf_specdec.models import load_model

model, _ = load_model()
cost = StepCost.measure(model, context=240)
print(cost)
for rows in (1, 4, 16):
    relative = [round(float(cost.relative(rows, torch.tensor(float(q)))), 2) for q in (1, 2, 3, 4, 6, 8, 11)]
    print(f"batch {rows}: cost of 1, 2, 3, 4, 6, 8, 11 tokens per row relative to a plain step: {relative}")
