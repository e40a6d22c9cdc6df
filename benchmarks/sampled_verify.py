"""Sampled `generate` (temperature, top-p): what a step spends on the logits processors and on the verify rule.

`--rows` rows of the built-in prompts (grounded and open chat, cycled), `--max-new-tokens` sampled tokens at
`--temperature` and `--top-p`: plain `generate`, hf_specdec with speculation off and with each of `--speculators`,
medians of `--repeats` seeded calls (after one short warm-up call each). Per configuration the call's time, and per
step the time in the logits processors (`LogitsProcessing`, with the entries processed) and in the verify rule
(`decode.verify.verify`: softmax, rejection sampling), both timed around their calls. What a big vocabulary costs
there: a verify's scores are one entry per position fed, each a vocabulary wide.

    python benchmarks/sampled_verify.py [--model gemma-3-270m] [--rows 8] [--max-new-tokens 64] [--repeats 3]
        [--speculators ngram] [--threads 2]

docs/benchmarks.md, "A sampled verify on a CPU", has its output.
"""

import argparse
import statistics
import time

import _common  # benchmarks/, this script's folder
import torch

from hf_specdec.decode import logits as logits_module
from hf_specdec.decode import step as step_module

SPENT = {"processing": 0.0, "verify": 0.0, "entries": 0}


def timed(owner, name, key, count=None):
    """Adds the time spent in `owner.name` to `SPENT[key]` (and the entries it was given to `SPENT["entries"]`)."""
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[key] += time.perf_counter() - start
            if count is not None:
                SPENT["entries"] += count(args)
    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    _common.add_model_args(parser, options=("model", "dtype", "threads"))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--speculators", default="ngram", help="comma-separated speculator names for generate")
    args = parser.parse_args()
    model, tokenizer = _common.load(args)
    inputs = _common.chat_batch(tokenizer, _common.prompt_texts("grounded") + _common.prompt_texts("open_chat"),
                                rows=args.rows)
    timed(logits_module.LogitsProcessing, "__call__", "processing", count=lambda a: len(a[4]))
    timed(step_module, "verify", "verify")
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    configs = [("plain generate", {})] + [(f"hf_specdec {name}", {"speculator": name})
                                         for name in ["off"] + args.speculators.split(",")]
    print(f"{args.model}, {args.rows} rows, {args.max_new_tokens} sampled tokens (temperature {args.temperature}, "
          f"top-p {args.top_p}), {torch.get_num_threads()} threads, medians of {args.repeats}")
    print("| configuration | call s | steps | processing ms per step | entries processed per step "
          "| verify ms per step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, kwargs in configs:
        torch.manual_seed(0)
        model.generate(**inputs, **dict(sampling, max_new_tokens=4), **kwargs)
        samples = []
        for repeat in range(args.repeats):
            SPENT.update(processing=0.0, verify=0.0, entries=0)
            torch.manual_seed(repeat)
            start = time.perf_counter()
            out = model.generate(**inputs, **sampling, **kwargs, return_dict_in_generate=True)
            metrics = getattr(out, "speculative_metrics", None)
            steps = metrics.num_steps if metrics is not None else None
            samples.append((time.perf_counter() - start, steps, dict(SPENT)))
        seconds = statistics.median(s[0] for s in samples)
        if samples[0][1] is None:  # plain generate: its processors are transformers' own, not timed here
            print(f"| {name} | {seconds:.2f} | - | - | - | - |", flush=True)
            continue
        steps = statistics.median(s[1] for s in samples)
        per_step = {key: statistics.median(s[2][key] for s in samples) / steps for key in SPENT}
        print(f"| {name} | {seconds:.2f} | {steps:.0f} | {1000 * per_step['processing']:.2f} | "
              f"{per_step['entries']:.1f} | {1000 * per_step['verify']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
