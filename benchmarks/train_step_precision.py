"""Times `hf-specdec train-eagle` steps in float32 and under bfloat16 autocast (`--mixed-precision bf16`),
alternated, on a stored training set: an EAGLE-3 head for SmolLM2-135M-Instruct, batches of 16 sequences, 3 unroll
steps, the 8192-token draft vocabulary. Prints each step's time and the medians.

    python benchmarks/train_step_precision.py ~/.cache/hf_specdec/heads/smollm2-eagle3-d/training_set
"""
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_specdec.models import load_model
from hf_specdec.train_eagle import TrainingSet, eagle_loss, head_config_for, new_head
from hf_specdec.train_eagle.loop import _batch_indices

torch.set_num_threads(2)
source = Path(sys.argv[1]).expanduser()
parts = sorted(source.glob("part-*.pt")) if source.is_dir() else [source]
data = TrainingSet.concat([TrainingSet.load(parts[0])])  # the first part is enough to time steps
target, _ = load_model("smollm2-135m-instruct")
config, draft_to_target = head_config_for(target, data, 3, draft_vocab_size=8192)
head = new_head(target, config, draft_to_target)
head.bind(target)
target_to_draft = torch.full((config["target"]["vocab_size"],), -100, dtype=torch.long)
target_to_draft[draft_to_target] = torch.arange(len(draft_to_target))
head.layer.self_attn.config._attn_implementation = "sdpa"
for p in target.parameters():
    p.requires_grad_(False)
optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
head.train()
times = {"float32": [], "bf16": []}
for step in range(12):
    mode = "float32" if step % 2 == 0 else "bf16"
    rows = _batch_indices(len(data.lengths), 16, 0, step // 2)  # both modes see the same batches
    width = int(data.lengths[rows].max())
    ids, features, labels = (t[rows][:, :width] for t in (data.token_ids, data.features, data.labels))
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
        loss = eagle_loss(head, ids, data.lengths[rows], features.float(), labels, 3, target_to_draft)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    times[mode].append(time.perf_counter() - start)
for mode, values in times.items():
    print(f"{mode}: steps {[round(t, 2) for t in values]} s, median {statistics.median(values):.2f} s "
          "(the first step of each includes warm-up)")
print(f"float32 / bf16 median step time: {statistics.median(times['float32']) / statistics.median(times['bf16']):.2f}x")
