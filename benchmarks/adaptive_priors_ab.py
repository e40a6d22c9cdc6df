"""Adaptive k's class priors, call-calibrated (now) against fixed (before), side by side with plain `generate`.

One ragged batch of the benchmark's prompts (cycled to `BATCH` rows), greedy, 128 new tokens; each repeat times
plain `generate`, then n-gram with the priors as they were (each class shrunk towards its own fixed prior), then
n-gram as it is (the prior scaled by how the call's drafts fared against the priors), and checks both outputs
against plain's. Prints each one's median speedup, the paired per-repeat speedups, and drafts / accepted per call.

    python benchmarks/adaptive_priors_ab.py BATCH {grounded,open} [SPECULATOR] [REPEATS]
"""

import sys
import time

import torch

import hf_specdec  # noqa: F401  (registers generate(speculator=...))
from hf_specdec.costs import adaptive
from hf_specdec.models import DEFAULT_MODEL, load_model
from hf_specdec.workloads import GROUNDED, OPEN_CHAT, chat_inputs

from _paired import report  # benchmarks/_paired.py


def fixed_priors(self):
    """The pooled estimate before: each class's counts shrunk towards its own prior, nothing borrowed."""
    return (self.accepted.sum(0) + self.strength * self.priors) / (self.tried.sum(0) + self.strength)


def main() -> None:
    batch, workload = int(sys.argv[1]), sys.argv[2]
    speculator = sys.argv[3] if len(sys.argv) > 3 else "ngram"
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    torch.set_num_threads(2)
    model, tokenizer = load_model(DEFAULT_MODEL)
    prompts = list((OPEN_CHAT if workload == "open" else GROUNDED).values())
    inputs = chat_inputs(tokenizer, [prompts[i % len(prompts)] for i in range(batch)])
    kwargs = dict(max_new_tokens=128, do_sample=False)
    model.generate(**inputs, max_new_tokens=4, do_sample=False, speculator=speculator)  # warm-up
    variants = {"fixed priors": fixed_priors, "call-calibrated priors": adaptive.AdaptiveK.pooled}
    times = {"plain": [], **{name: [] for name in variants}}
    drafts = {name: [] for name in variants}
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            expected = model.generate(**inputs, **kwargs)
            times["plain"].append(time.perf_counter() - start)
            for name, pooled in variants.items():
                adaptive.AdaptiveK.pooled = pooled
                start = time.perf_counter()
                out = model.generate(**inputs, **kwargs, speculator=speculator, return_dict_in_generate=True)
                times[name].append(time.perf_counter() - start)
                m = out.speculative_metrics
                drafts[name].append((m.num_draft_tokens, m.num_accepted_tokens))
                assert torch.equal(out.sequences, expected), f"{name}: output differs from plain generate"
    finally:
        adaptive.AdaptiveK.pooled = variants["call-calibrated priors"]
    report(times, {name: f"(drafts, accepted) per call {drafts[name]}" for name in variants})

if __name__ == "__main__":
    main()
