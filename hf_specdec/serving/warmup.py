"""The serving engine's warm-up: synthetic requests through its real step before any client's, so that kernels
compile and memory pools grow then rather than inside the first clients' requests (`ServingEngine(warmup=...)`)."""

from __future__ import annotations

import time

from ..decode.requests import Request, SamplingParams
from ..metrics import SpeculativeMetrics, logger


def warm_up(engine, short: bool = False) -> None:
    """Runs synthetic requests through the real step of `engine` (a `ServingEngine` not serving yet), so that every
    variant of the Triton kernels a request can launch is compiled now (`hf_specdec/kernels/variants.py` lists what
    makes a variant): four groups, one per combination of top-k and top-p that a sampled batch can need (the sampling
    kernel's variants), alternately seeded and not (seeded rows sample by position, `verify.sample_by_position`),
    each of greedy and sampled rows whose prompts differ in length (a packed prefill) and that join a running batch
    (its first row, which emits k + 4 tokens), where row j > 0 may emit j + 2 tokens (every draft count up to k
    verified in one packed step, fewer as rows finish); then one row alone, and one sampled row without drafts. A
    prompt that repeats itself gives n-gram lookup something to propose; k is constant (adaptive k would draft
    nothing on its static priors) and nothing is stored for prefix reuse. Afterwards the metrics start again from
    zero and adaptive k's statistics were never touched.
    Groups larger than the batch queue as any requests would. `short`: the row alone only (the KV pools, the
    speculator's own included, are allocated at their first write, and the first forward's one-off costs paid)."""
    start = time.perf_counter()
    policy, prefix_cache = engine.step.policy, engine.scheduler.prefix_cache
    engine.step.policy, engine.scheduler.prefix_cache = None, None
    engine.speculator.bind_policy(None)
    # With its tokens, within the context
    prompt = warmup_prompt(engine)[:max(2, engine.max_model_len - engine.k - 4)]
    greedy = SamplingParams()
    groups = []
    for i, (top_k, top_p) in enumerate(() if short else ((0, 1.0), (20, 1.0), (0, 0.9), (20, 0.9))):
        sampled = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=0 if i % 2 == 0 else None)
        groups.append([Request(prompt[:max(2, len(prompt) - j)], j + 2 if j else engine.k + 4,
                               greedy if j % 2 == 0 else sampled) for j in range(max(2, engine.k + 1))])
    # One row alone; then a sampled row of one token, whose only step has no drafts (a speculator with draft
    # probabilities verifies its drafts in another variant than a step without any).
    groups += [[Request(list(prompt[:16]) if short else list(prompt), engine.k + 2)]]  # short: fits small pools
    if not short:
        groups += [[Request(list(prompt), 1, SamplingParams(temperature=1.0))]]
    steps = 0
    try:
        for group in groups:
            engine.scheduler.add(group[0])
            if len(group) > 1:  # the others join a running batch (a step of their own for some speculators)
                engine.scheduler.step()
                steps += 1
            for request in group[1:]:
                engine.scheduler.add(request)
            # A bound: every request ends within its length, and each joins in a step of its own at worst,
            # after its prompt's pieces (chunked prefill) and steps waiting for the others'.
            pieces = sum(len(r.prompt_ids) for r in group) // (engine.scheduler.prefill_chunk or 1 << 30) + 1
            for _ in range(sum(r.max_new_tokens + 2 for r in group) + len(group) * pieces + 8):
                if not engine.scheduler.has_work():
                    break
                engine.scheduler.step()
                steps += 1
            if engine.scheduler.has_work():
                raise RuntimeError(f"the warm-up's requests did not finish in {steps} steps")
            failed = [r.error for r in group if r.finish_reason == "error"]
            if failed:
                raise RuntimeError(f"a warm-up request was refused: {failed[0]}")
    finally:
        engine.step.policy, engine.scheduler.prefix_cache = policy, prefix_cache
        engine.speculator.bind_policy(policy)
    engine.warmup_report = {"kind": "short" if short else "full", "steps": steps,
                            "draft_tokens": engine.metrics.num_draft_tokens,
                            "accepted_tokens": engine.metrics.num_accepted_tokens,
                            "seconds": round(time.perf_counter() - start, 3)}
    engine.metrics = engine.scheduler.metrics = SpeculativeMetrics()
    engine.scheduler.num_prefill_chunks = 0
    logger.info(f"hf_specdec serving engine warmed up: {engine.warmup_report}")


def warmup_prompt(engine) -> list[int]:
    """About 48 tokens that repeat a short phrase (at least k + 8: the warm-up's rows need prompts of different
    lengths, and n-gram lookup a repeat to propose from)."""
    if engine.tokenizer is not None:
        ids = engine.tokenizer("one two three four five six seven eight. " * 6, add_special_tokens=False)[
            "input_ids"]
        if len(ids) >= engine.k + 8 and max(ids) < engine.vocab_size:
            return list(ids)[:64]
    return [1 + i % max(1, min(engine.vocab_size - 1, 8)) for i in range(48)]
