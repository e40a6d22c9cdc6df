"""Is greedy output identical to plain `generate` in float32 and in bfloat16? SmolLM2-135M-Instruct, the bench's six
prompts (grounded and open chat), 128 new tokens. Each prompt's batch-1 plain `generate` is the reference; compared
against it: the same prompts batched (3 per batch, left-padded) in plain `generate`, hf_specdec n-gram (k = 4,
constant), hf_specdec EAGLE (a trained head, k = 3, constant, when a head directory is given) and transformers' own
prompt lookup (4 tokens) at batch 1. Prints, per configuration, how many of the 6 outputs are identical and where
the others first differ. No timing, so machine load does not matter.

    python benchmarks/low_precision_equality.py [HEAD_DIR]
"""
import sys

import torch

import hf_specdec
from hf_specdec.models import load_model
from hf_specdec.workloads import GROUNDED, OPEN_CHAT, chat_inputs

torch.set_num_threads(2)
model, tokenizer = load_model("smollm2-135m-instruct")
head = hf_specdec.EagleSpeculator.from_pretrained(sys.argv[1]) if len(sys.argv) > 1 else None
prompts = [*GROUNDED.values(), *OPEN_CHAT.values()]
new = 128


def generated(inputs, out) -> list[list[int]]:
    return [row[inputs.input_ids.shape[1]:].tolist() for row in out]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def batched(texts: list[str]) -> list[list[int]]:
    inputs = chat_inputs(tokenizer, texts)
    return generated(inputs, model.generate(**inputs, max_new_tokens=new, do_sample=False))


for dtype in (torch.float32, torch.bfloat16):
    model.to(dtype)
    singles = [chat_inputs(tokenizer, [p]) for p in prompts]
    reference = [generated(x, model.generate(**x, max_new_tokens=new, do_sample=False))[0] for x in singles]
    configs = {
        "plain generate, 3 prompts per batch": lambda: [row for i in (0, 3) for row in batched(prompts[i:i + 3])],
        "hf_specdec n-gram k=4": lambda: [generated(x, model.generate(
            **x, max_new_tokens=new, do_sample=False, speculator="ngram", num_speculative_tokens=4,
            speculative_schedule="constant"))[0] for x in singles],
        "transformers prompt lookup": lambda: [generated(x, model.generate(
            **x, max_new_tokens=new, do_sample=False, prompt_lookup_num_tokens=4))[0] for x in singles],
    }
    if head is not None:
        configs["hf_specdec EAGLE-3 k=3"] = lambda: [generated(x, model.generate(
            **x, max_new_tokens=new, do_sample=False, speculator=head, num_speculative_tokens=3,
            speculative_schedule="constant"))[0] for x in singles]
    for name, run in configs.items():
        outputs = run()
        # a batched row may run past its EOS with padding: compare up to the reference's length
        diffs = [first_difference(ref, out[:len(ref)] if len(out) > len(ref) and all(
            t == tokenizer.pad_token_id for t in out[len(ref):]) else out) for ref, out in zip(reference, outputs)]
        same = sum(d is None for d in diffs)
        where = ", ".join(f"prompt {i}: token {d}" for i, d in enumerate(diffs) if d is not None)
        print(f"{str(dtype).removeprefix('torch.')}: {name}: {same}/{len(prompts)} identical"
              + (f" (first differences: {where})" if where else ""))
