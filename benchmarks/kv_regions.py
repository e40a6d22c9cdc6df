"""Rows in regions (the one-call `generate` layout: each row's keys and values read in place) against rows taking
blocks as they grow (gathered every layer and step), beside plain `generate`: open chat, batch 16, greedy, with
drafting forced off so every step is a plain decode step through hf_specdec's engine. Interleaved, rotating the
order each repeat; prints medians and the median of the per-repeat ratios.

    python benchmarks/kv_regions.py [--repeats 4] [--batch 16] [--max-new-tokens 128]
"""
import argparse
import statistics
import time

import torch

from hf_specdec import StepCost
from hf_specdec.decode.engine import SpeculativeEngine
from hf_specdec.models import load_model
from hf_specdec.workloads import OPEN_CHAT, chat_inputs

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=4)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
torch.set_num_threads(args.threads)
model, tokenizer = load_model()
prompts = list(OPEN_CHAT.values())
inputs = chat_inputs(tokenizer, [prompts[i % len(prompts)] for i in range(args.batch)])
never_draft = StepCost(per_row=0.0, points=((1, 1.0), (2, 100.0)), per_context_token=0.0)
engine = dict(speculator="ngram", num_speculative_tokens=1, speculative_step_cost=never_draft)
default = SpeculativeEngine.REGION_MAX_NEW_TOKENS
runs = {"plain generate": ({}, None), "engine, regions": (engine, default), "engine, blocks as rows grow": (engine, 0)}
times = {name: [] for name in runs}
outputs = {}


def call(name, max_new_tokens):
    kwargs, region_limit = runs[name]
    if region_limit is not None:
        SpeculativeEngine.REGION_MAX_NEW_TOKENS = region_limit
    return model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


for name in runs:  # warm-up
    call(name, 8)
names = list(runs)
for repeat in range(args.repeats):
    for name in names[repeat % 3:] + names[:repeat % 3]:
        start = time.perf_counter()
        outputs[name] = call(name, args.max_new_tokens)
        times[name].append(time.perf_counter() - start)
SpeculativeEngine.REGION_MAX_NEW_TOKENS = default
same = all(torch.equal(out, outputs["plain generate"]) for out in outputs.values())
for name, samples in times.items():
    print(f"{name:28s} median {statistics.median(samples):.2f} s  ({', '.join(f'{t:.2f}' for t in samples)})")
for name in names[1:]:
    ratios = [p / t for p, t in zip(times["plain generate"], times[name])]
    print(f"{name}: {statistics.median(times['plain generate']) / statistics.median(times[name]):.3f}x plain "
          f"generate (median of paired ratios {statistics.median(ratios):.3f}x)")
ratios = [b / r for b, r in zip(times["engine, blocks as rows grow"], times["engine, regions"])]
print(f"regions against blocks as rows grow: {statistics.median(ratios):.3f}x (paired: "
      f"{', '.join(f'{r:.3f}' for r in ratios)}); identical output: {same}")
