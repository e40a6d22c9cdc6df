"""Whole target forwards through hf_specdec's paged runner at fixed shapes, timed interleaved: `draft_pricing.py`'s
controlled forwards and profiles, for comparing step layouts."""

import time

import torch

from hf_specdec.runners.model_runner import ModelRunner


def filled_runner(model, rows: int, context: int) -> ModelRunner:
    """A packed paged runner holding `rows` rows of `context` random cached tokens each (call inside
    `paged_attention(model)` and `torch.no_grad()`)."""
    runner = ModelRunner(model, num_blocks=rows * (context + 64) // 16 + 8, packed=True)
    for seq in range(rows):
        runner.add_sequence(seq)
    runner.forward(list(range(rows)), torch.randint(model.config.vocab_size, (rows, context)), [context] * rows, 1)
    return runner


def timed_forwards(runner: ModelRunner, context: int, variants: dict, repeats: int) -> dict:
    """Seconds of one forward per variant and repeat: `variants` maps a name to `(tokens fed per row, prepare)`,
    `prepare` a callable run before that variant's forward (or None). Every forward is rolled back to `context`
    tokens; the order reverses every other repeat, and an extra first repeat warms up."""
    times = {name: [] for name in variants}
    vocab = runner.model.config.vocab_size
    for repeat in range(repeats + 1):
        for name, (counts, prepare) in (list(variants.items()) if repeat % 2 else list(variants.items())[::-1]):
            if prepare is not None:
                prepare()
            rows = len(counts)
            ids = torch.randint(vocab, (rows, max(counts)))
            start = time.perf_counter()
            runner.forward(list(range(rows)), ids, counts, max(counts), logit_counts=counts)
            elapsed = time.perf_counter() - start
            for seq in range(rows):
                runner.rollback(seq, context)
            if repeat:
                times[name].append(elapsed)
    return times
