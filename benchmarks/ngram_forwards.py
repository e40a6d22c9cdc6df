"""Deterministic comparison of n-gram speculation at batch 1: target forwards and tokens fed per workload prompt, for
transformers' prompt lookup and hf_specdec's n-gram with adaptive k, and the time the CPU step-cost model
(`hf_specdec.costs.adaptive.DEFAULT_STEP_COST["cpu"]`, measured) implies for them. No timing, so it is the same on any
machine load; run `hf-specdec bench` for measured times."""
import torch

import hf_specdec
from hf_specdec.costs.step_cost import DEFAULT_STEP_COST
from hf_specdec.models import load_model
from hf_specdec.workloads import GROUNDED, OPEN_CHAT, chat_inputs

model, tokenizer = load_model()
cost = DEFAULT_STEP_COST["cpu"]
widths = []
model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                with_kwargs=True)


def run(inputs, **kwargs):
    widths.clear()
    out = model.generate(**inputs, max_new_tokens=128, do_sample=False, return_dict_in_generate=True, **kwargs)
    fed = widths[1:]  # the prefill is the same for every configuration
    return out.sequences, len(fed), sum(fed), sum(float(cost(1, torch.tensor(float(q)))) for q in fed)


configs = {"transformers prompt lookup": dict(prompt_lookup_num_tokens=10),
           "hf_specdec ngram": dict(speculator=hf_specdec.NgramSpeculator(), num_speculative_tokens=10)}
print("| workload | prompt | plain forwards | configuration | target forwards | tokens fed | modelled speedup | identical |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
totals = {}
for workload, prompts in (("grounded", GROUNDED), ("open_chat", OPEN_CHAT)):
    for name, prompt in prompts.items():
        inputs = chat_inputs(tokenizer, [prompt])
        reference, forwards, _, plain = run(inputs)
        for label, kwargs in configs.items():
            sequences, n, fed, modelled = run(inputs, **kwargs)
            key = (workload, label)
            totals[key] = (totals.get(key, (0, 0))[0] + plain, totals.get(key, (0, 0))[1] + modelled)
            print(f"| {workload} | {name} | {forwards} | {label} | {n} | {fed} | {plain / modelled:.2f}x | "
                  f"{'yes' if torch.equal(sequences, reference) else 'NO'} |")
for (workload, label), (plain, modelled) in totals.items():
    print(f"{workload}, {label}: modelled speedup over plain generate {plain / modelled:.2f}x")
