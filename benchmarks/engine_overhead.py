"""The engine's own cost at batch 16: open chat, 128 new tokens, plain `generate` against hf_specdec with drafting
forced off (a step-cost model under which no draft ever pays), interleaved. Their ratio is the engine's overhead
(paged KV cache, verification, bookkeeping) with no speculation to pay for it.

    python benchmarks/engine_overhead.py [--repeats 3]
"""
import argparse
import statistics
import time

from hf_specdec import StepCost
from hf_specdec.models import load_model
from hf_specdec.workloads import OPEN_CHAT, chat_inputs

parser = argparse.ArgumentParser()
parser.add_argument("--repeats", type=int, default=3)
args = parser.parse_args()
model, tokenizer = load_model()
prompts = list(OPEN_CHAT.values())
inputs = chat_inputs(tokenizer, [prompts[i % len(prompts)] for i in range(16)])
never_draft = StepCost(per_row=0.0, points=((1, 1.0), (2, 100.0)), per_context_token=0.0)
runs = {
    "plain generate": dict(),
    "engine, drafting off": dict(speculator="ngram", num_speculative_tokens=1, speculative_step_cost=never_draft),
}
times = {name: [] for name in runs}
for kwargs in runs.values():  # warm-up
    model.generate(**inputs, max_new_tokens=8, do_sample=False, **kwargs)
for _ in range(args.repeats):
    for name, kwargs in runs.items():
        start = time.perf_counter()
        model.generate(**inputs, max_new_tokens=128, do_sample=False, **kwargs)
        times[name].append(time.perf_counter() - start)
for name, samples in times.items():
    print(f"{name:22s} median {statistics.median(samples):.2f} s  ({', '.join(f'{t:.2f}' for t in samples)})")
ratio = statistics.median(times["plain generate"]) / statistics.median(times["engine, drafting off"])
print(f"engine speed relative to plain generate: {ratio:.2f}x")
