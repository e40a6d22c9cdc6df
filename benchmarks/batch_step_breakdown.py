"""Where a batched EAGLE step's time goes: the bench's open-chat batch of 4 (its 3 prompts, cycled), greedy, 128 new
tokens, a constant chain of k = 2 drafts against plain `generate`, two rounds. Prints per step the draft and verify
time next to a plain step, the steps taken, and the tokens per step of the mean row and of the row that needed the
most steps (a batch runs until its slowest row is done).

    python benchmarks/batch_step_breakdown.py HEAD_DIR
"""
import sys
import time

import torch

from hf_specdec import EagleSpeculator
from hf_specdec.models import load_model
from hf_specdec.workloads import OPEN_CHAT, chat_inputs

torch.set_num_threads(2)
model, tokenizer = load_model("smollm2-135m-instruct")
speculator = EagleSpeculator.from_pretrained(sys.argv[1])
prompts = list(OPEN_CHAT.values())
inputs = chat_inputs(tokenizer, [prompts[i % len(prompts)] for i in range(4)])
width = inputs.input_ids.shape[1]
model.generate(**inputs, max_new_tokens=8, do_sample=False)  # warm-up
for _ in range(2):
    start = time.perf_counter()
    plain = model.generate(**inputs, max_new_tokens=128, do_sample=False)
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=128, do_sample=False, speculator=speculator,
                         num_speculative_tokens=2, speculative_schedule="constant", return_dict_in_generate=True)
    spec_s = time.perf_counter() - start
    m = out.speculative_metrics
    new = (out.sequences[:, width:] != tokenizer.pad_token_id).sum(1)  # tokens each row generated
    plain_steps = plain.shape[1] - width
    print(f"plain {plain_s:.2f} s ({plain_s * 1000 / plain_steps:.1f} ms per step, {plain_steps} steps); "
          f"speculative {spec_s:.2f} s, {plain_s / spec_s:.2f}x, identical {torch.equal(out.sequences, plain)}; "
          f"{m.num_steps} steps: draft {m.draft_time_s * 1000 / m.num_steps:.1f} ms, verify "
          f"{m.verify_time_s * 1000 / m.num_steps:.1f} ms, whole step {m.total_time_s * 1000 / m.num_steps:.1f} ms; "
          f"tokens per step: mean row {float(new.float().mean()) / m.num_steps:.2f}, "
          f"slowest row {int(new.max()) / m.num_steps:.2f} (mean acceptance length {m.mean_acceptance_length:.2f})")
