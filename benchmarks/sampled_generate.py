"""One-call `generate` on a CPU, sampled and greedy, plain against n-gram speculation, on a grounded and an open-chat
prompt; sampled n-gram both with the sampling warpers run as hf_specdec's PyTorch reference (what a CPU does now:
no vocabulary sort) and as transformers' own warpers. Then the warpers alone at 11 positions (batch 1, k = 10) of
SmolLM2's 49152-token vocabulary. Medians of `--repeats` after one warm-up round, variants interleaved.

    python benchmarks/sampled_generate.py [--repeats 3] [--max-new-tokens 96] [--threads 2]
"""

import argparse
import statistics
import time

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_specdec.decode import logits as logits_module
from hf_specdec.kernels._timing import median_ms
from hf_specdec.kernels.sampling import apply_sampling_params
from hf_specdec.models import DEFAULT_MODEL, load_model
from hf_specdec.workloads import GROUNDED, OPEN_CHAT, chat_inputs

CPU = torch.device("cpu")
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(DEFAULT_MODEL)
    prompts = {"grounded": next(iter(GROUNDED.values())), "open chat": next(iter(OPEN_CHAT.values()))}
    variants = {"greedy plain": ({}, True), "greedy ngram": ({"speculator": "ngram"}, True),
                "sampled plain": (SAMPLING, True), "sampled ngram": ({**SAMPLING, "speculator": "ngram"}, True),
                "sampled ngram, transformers warpers": ({**SAMPLING, "speculator": "ngram"}, False)}
    reference_path = logits_module._sampling_params
    times = {(p, v): [] for p in prompts for v in variants}
    for repeat in range(args.repeats + 1):
        names = list(variants) if repeat % 2 else list(variants)[::-1]
        for prompt_name, prompt in prompts.items():
            inputs = chat_inputs(tokenizer, [prompt])
            for name in names:
                kwargs, reference = variants[name]
                # transformers' warpers: the processors are not recognised as the reference's three
                logits_module._sampling_params = reference_path if reference else (lambda processors: None)
                torch.manual_seed(repeat)
                start = time.perf_counter()
                model.generate(**inputs, **kwargs, max_new_tokens=args.max_new_tokens,
                               min_new_tokens=args.max_new_tokens)
                if repeat:
                    times[(prompt_name, name)].append(time.perf_counter() - start)
    logits_module._sampling_params = reference_path
    for prompt_name in prompts:
        medians = {v: statistics.median(times[(prompt_name, v)]) for v in variants}
        print(f"{prompt_name}: " + "; ".join(f"{v} {s:.2f} s" for v, s in medians.items()))
        plain = medians["sampled plain"]
        print(f"  n-gram over plain: greedy {medians['greedy plain'] / medians['greedy ngram']:.2f}x, sampled "
              f"{plain / medians['sampled ngram']:.2f}x (with transformers' warpers "
              f"{plain / medians['sampled ngram, transformers warpers']:.2f}x)")
    scores = torch.randn(11, model.config.vocab_size, generator=torch.Generator().manual_seed(0)) * 4
    for label, warpers, params in (
            ("temperature 0.7, top-k 50, top-p 0.9", [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50),
                                                      TopPLogitsWarper(0.9)], (0.7, 50, 0.9)),
            ("temperature 0.7, top-p 0.9", [TemperatureLogitsWarper(0.7), TopPLogitsWarper(0.9)], (0.7, None, 0.9))):
        chain = LogitsProcessorList(warpers)
        tensors = [None if p is None else torch.full((11,), p) for p in params]
        ours = median_ms(lambda t=tensors: apply_sampling_params(scores, *t, backend="torch"), CPU, repeats=9, warmup=1)
        theirs = median_ms(lambda c=chain: c(None, scores), CPU, repeats=9, warmup=1)
        same = torch.equal(apply_sampling_params(scores, *tensors, backend="torch"), chain(None, scores))
        print(f"warpers at 11 positions, {label}: reference {ours:.1f} ms, transformers {theirs:.1f} ms, "
              f"same scores: {same}")


if __name__ == "__main__":
    main()
