"""The EAGLE head's idle backlog: taken every `IDLE_BACKLOG` steps (now) against piled up until the next draft.

16 grounded rows (the benchmark's prompts, cycled), greedy, 128 new tokens, the shipped head with adaptive k (which
turns it off on grounded text after a few steps); each repeat times plain `generate`, then the head with the
backlog taken every 32 steps, then with it never taken while idle, and checks both outputs against plain's.

    python benchmarks/eagle_idle_backlog.py [REPEATS]
"""

import sys
import time

import torch

import hf_specdec
from hf_specdec.models import DEFAULT_MODEL, load_model, trained_head
from hf_specdec.workloads import GROUNDED, chat_inputs

from _paired import report  # benchmarks/_paired.py


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    torch.set_num_threads(2)
    model, tokenizer = load_model(DEFAULT_MODEL)
    prompts = list(GROUNDED.values())
    inputs = chat_inputs(tokenizer, [prompts[i % len(prompts)] for i in range(16)])
    kwargs = dict(max_new_tokens=128, do_sample=False)
    heads = {}
    for name, backlog in (("taken every 32 steps", 32), ("piled up", 10**9)):
        heads[name] = hf_specdec.EagleSpeculator.from_pretrained(trained_head(DEFAULT_MODEL))
        heads[name].IDLE_BACKLOG = backlog
        model.generate(**inputs, max_new_tokens=4, do_sample=False, speculator=heads[name])  # warm-up
    times = {"plain": [], **{name: [] for name in heads}}
    for _ in range(repeats):
        start = time.perf_counter()
        expected = model.generate(**inputs, **kwargs)
        times["plain"].append(time.perf_counter() - start)
        for name, head in heads.items():
            start = time.perf_counter()
            out = model.generate(**inputs, **kwargs, speculator=head)
            times[name].append(time.perf_counter() - start)
            assert torch.equal(out, expected), f"{name}: output differs from plain generate"
    report(times)

if __name__ == "__main__":
    main()
