"""Plain `generate` throughput of the default model in float32 and bfloat16 at batch 64 (what `train-eagle
--data-dtype` chooses between when it builds a training set). CPUs with AMX run bfloat16 matmuls much faster.

    python benchmarks/generate_dtype.py
"""
import time

import torch

from hf_specdec.models import load_model
from hf_specdec.train_eagle import tokenize_prompts
from hf_specdec.train_eagle.prompts import built_in_prompts

model, tokenizer = load_model()
prompts = tokenize_prompts(tokenizer, built_in_prompts(200)[100:164])
width = max(map(len, prompts))
input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
new_tokens = 160
for dtype in (torch.float32, torch.bfloat16):
    model.to(dtype)
    model.generate(input_ids=input_ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False)  # warm-up
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    elapsed = time.perf_counter() - start
    generated = int((out[:, width:] != tokenizer.eos_token_id).sum())
    print(f"{str(dtype):15s} batch 64: {generated / elapsed:6.1f} new tokens/s ({elapsed:.1f} s)")
