"""When should the masked dense cache compact? Falcon (random init, hidden 256, 4 layers) decodes a ragged batch of 8
with a disagreeing draft model (most drafts rejected: many holes) and with n-gram drafts, at several
`max_hole_fraction` settings (0: every fed row contiguous, compacting before nearly every forward; 1: never).

Reported per setting: compactions, key columns attended (sum over forwards of rows x columns, the attention work,
which holes inflate), cells copied by compaction (rows x columns gathered, times layers, keys and values), the two as
one memory traffic in cells (each attended column reads a key and a value cell per layer), and wall time (median of
3; noisy on a shared host, the counts are not). Every run's output is checked against plain generate.
`python benchmarks/masked_cache_holes.py`."""
from __future__ import annotations

import statistics
import time

import torch
from transformers import FalconConfig, FalconForCausalLM

import hf_specdec  # noqa: F401
from hf_specdec.runners import dense as dense_runner
from hf_specdec.cache.masked import MaskedKVCache

VOCAB, ROWS, NEW, LAYERS = 512, 8, 64, 4
stats = {"attended": 0, "copied": 0, "compactions": 0}
begin, compact = MaskedKVCache.begin_step, MaskedKVCache.compact


def counted_begin(cache, seq_ids, num_tokens):
    out = begin(cache, seq_ids, num_tokens)
    stats["attended"] += len(seq_ids) * (cache.width + max(num_tokens))
    return out


def counted_compact(cache):
    stats["copied"] += 2 * len(cache.keys) * cache.num_live_rows * cache.width
    stats["compactions"] += 1
    compact(cache)


MaskedKVCache.begin_step, MaskedKVCache.compact = counted_begin, counted_compact


def falcon(seed):
    torch.manual_seed(seed)
    model = FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=LAYERS,
                                           num_attention_heads=8, tie_word_embeddings=False,
                                           initializer_range=0.1)).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


target, draft = falcon(0), falcon(1)
g = torch.Generator().manual_seed(0)
phrase = torch.randint(3, VOCAB, (ROWS, 7), generator=g)
input_ids = phrase.repeat(1, 10)[:, :64]
mask = torch.ones_like(input_ids)
for row in range(ROWS):  # left padding: 64 down to 29 tokens
    mask[row, : 5 * row] = 0
input_ids[mask == 0] = 0
args = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
with torch.no_grad():
    expected = target.generate(**args)
print("| speculator | max_hole_fraction | compactions | key columns attended | cells copied by compaction | "
      "traffic (cells) | time (s) | equal |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for name, speculator in (("draft (disagreeing)", draft), ("ngram", "ngram")):
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        dense_runner.DEFAULT_MAX_HOLE_FRACTION = fraction
        for model in (target, draft):
            model._hf_specdec_trial_passed, model._hf_specdec_contiguous_rows = True, fraction == 0.0
        times = []
        for _ in range(3):
            for key in stats:
                stats[key] = 0
            start = time.perf_counter()
            with torch.no_grad():
                out = target.generate(**args, speculator=speculator, num_speculative_tokens=4,
                                      speculative_schedule="constant")
            times.append(time.perf_counter() - start)
        print(f"| {name} | {fraction} | {stats['compactions']} | {stats['attended']} | {stats['copied']} | "
              f"{2 * LAYERS * stats['attended'] + stats['copied']} | {statistics.median(times):.2f} | "
              f"{'yes' if torch.equal(out, expected) else 'NO'} |")
