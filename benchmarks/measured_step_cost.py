"""Open chat at batch 1: plain generate, then the shipped head and n-gram with adaptive k priced by the CPU default
step cost and by one measured on the host at hand (`StepCost.measure`). Output checked against plain generate.

    python benchmarks/measured_step_cost.py
"""
import time

import torch

from hf_specdec import EagleSpeculator, StepCost
from hf_specdec.models import load_model, trained_head
from hf_specdec.train_eagle import tokenize_prompts
from hf_specdec.workloads import OPEN_CHAT

torch.set_num_threads(2)
model, tok = load_model()
t0 = time.perf_counter()
measured = StepCost.measure(model, rows=(1, 4), contexts=(64, 256), repeats=3)
print(f"measured in {time.perf_counter() - t0:.0f} s: {measured}")
head = EagleSpeculator.from_pretrained(trained_head("smollm2-135m-instruct"))
prompts = [torch.tensor([ids]) for ids in tokenize_prompts(tok, list(OPEN_CHAT.values()))]


def run(**kw):
    """Seconds for the three prompts (the faster of two rounds) and the outputs."""
    times, outs = [], []
    for _ in range(2):
        total = 0.0
        for ids in prompts:
            s = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, do_sample=False, **kw)
            total += time.perf_counter() - s
            outs.append(out)
        times.append(total)
    return min(times), outs


base, ref = run()
print(f"plain: {base:.2f} s")
for name, spec in (("eagle", head), ("ngram", "ngram")):
    for label, cost in (("default cost", None), ("measured cost", measured)):
        t, outs = run(speculator=spec, num_speculative_tokens=10, speculative_step_cost=cost)
        same = all(torch.equal(a, b) for a, b in zip(outs, ref))
        print(f"{name:6s} {label:14s} {base / t:.2f}x  identical={same}")
