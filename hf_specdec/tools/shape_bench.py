"""`hf-specdec bench --shape NAME`: the engine's efficiency at a real model size, apart from draft quality.

A random-init model of a published shape (`shapes.py`) decodes random prompts greedily. Beside transformers' plain
`generate` (eager, and with its static cache, which transformers compiles on CUDA) run hf_specdec with speculation
off and the synthetic speculator (`synthetic.py`) at set mean acceptance lengths L with k drafts: free drafts (the
engine's ceiling), and, where the shape has a draft shape, drafts priced by that draft model's own forwards. Each
speculative row reports the fraction of the ideal speedup it reached: measured / (L / (verify cost + k x draft
cost)), the costs in plain steps measured in the same run (a verify step's time and a drafted token's time over
speculation off's step time).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..decode.speculator import Speculator
from ..speculators.draft_model import DraftModelSpeculator
from ..types import SequenceBatch
from .bench import fmt, markdown_table
from .shapes import DRAFTS, build_shape
from .synthetic import SyntheticSpeculator, acceptance_for_length


class PricedSyntheticSpeculator(SyntheticSpeculator):
    """Synthetic drafts that cost what `drafter`'s do: each step `drafter` proposes (its forwards run, its cache
    advances and rolls back as usual), then its tokens are replaced by the synthetic ones."""

    def __init__(self, drafter: Speculator, reference, acceptance, vocab_size, seed: int = 0):
        super().__init__(reference, acceptance, vocab_size, seed)
        self.drafter = drafter
        self.drafts_are_free = False

    def relative_cost(self, target) -> float:
        return self.drafter.relative_cost(target)

    def begin(self, target, batch: SequenceBatch) -> None:
        super().begin(target, batch)
        self.drafter.begin(target, batch)

    def propose(self, batch: SequenceBatch, k: int):
        self.drafter.propose(batch, k)
        return super().propose(batch, k)

    def commit(self, batch: SequenceBatch, num_accepted: list[int]) -> None:
        self.drafter.commit(batch, num_accepted)

    def release(self, rows: list[int]) -> None:
        self.drafter.release(rows)

    def end(self) -> None:
        self.drafter.end()
        super().end()


@dataclass
class ShapeResult:
    shape: str
    batch_size: int
    config: str
    tokens_per_s: float
    speedup_over_eager: float
    speedup_over_static: float | None
    speedup_over_off: float | None
    mean_acceptance_length: float | None = None
    ideal_speedup: float | None = None
    fraction_of_ideal: float | None = None
    identical: bool | None = None


def _timed(model, inputs: dict, max_new_tokens: int, repeats: int, **kwargs):
    """The median latency of `repeats` greedy calls (after one untimed call) and the last call's output."""
    def call():
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             do_sample=False, return_dict_in_generate=True, **kwargs)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        return time.perf_counter() - start, out

    call()
    samples = [call() for _ in range(repeats)]
    return statistics.median(t for t, _ in samples), samples[-1][1]


def run_shape_bench(name: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, batch_sizes=(1, 16),
                    lengths=(2.0, 3.0, 4.0), k: int = 4, prompt_tokens: int = 128, max_new_tokens: int = 128,
                    repeats: int = 3, static: bool | None = None, draft: bool = True, seed: int = 0,
                    **overrides) -> list[ShapeResult]:
    """Runs the configurations above for shape `name` at each batch size; `overrides` shrink the shape (tests).
    `static` (default: on CUDA) adds transformers' static-cache `generate`; `draft=False` leaves out the priced
    drafts."""
    target = build_shape(name, device, dtype, seed, **overrides)
    drafter = None
    if draft and name in DRAFTS:
        drafter = DraftModelSpeculator(build_shape(DRAFTS[name], device, dtype, seed + 1, **overrides))
    static = target.device.type == "cuda" if static is None else static
    vocab = target.config.vocab_size
    results = []
    for batch_size in batch_sizes:
        ids = torch.randint(3, vocab, (batch_size, prompt_tokens), generator=torch.Generator().manual_seed(seed))
        inputs = dict(input_ids=ids.to(target.device), attention_mask=torch.ones_like(ids, device=target.device))
        eager, reference = _timed(target, inputs, max_new_tokens, repeats)
        reference = reference.sequences
        new_tokens = batch_size * max_new_tokens
        row = dict(shape=name, batch_size=batch_size)
        static_s = _timed(target, inputs, max_new_tokens, repeats, cache_implementation="static")[0] if static \
            else None

        def result(config, seconds, out=None, **extra):
            return ShapeResult(config=config, tokens_per_s=new_tokens / seconds, speedup_over_eager=eager / seconds,
                               speedup_over_static=static_s / seconds if static_s else None,
                               speedup_over_off=off_s / seconds if off_s else None,
                               identical=None if out is None else torch.equal(out.sequences, reference),
                               **row, **extra)

        off_s = None
        results.append(result("plain generate", eager))
        if static_s:
            results.append(result("plain generate, static cache", static_s))
        off_s, off = _timed(target, inputs, max_new_tokens, repeats, speculator="off")
        results.append(result("hf_specdec off", off_s, off))
        # A plain step of the engine: what verify and draft forwards are priced in (their host work is not, so the
        # fraction of the ideal shows what the loop around the forwards costs)
        step_s = off.speculative_metrics.verify_time_s / max(off.speculative_metrics.num_steps, 1)
        for length in lengths:
            acceptance = acceptance_for_length(length, k)
            proposers = {"free drafts": SyntheticSpeculator(reference, acceptance, vocab, seed)}
            if drafter is not None:
                proposers[f"{DRAFTS[name]} draft"] = PricedSyntheticSpeculator(drafter, reference, acceptance, vocab,
                                                                               seed)
            for what, speculator in proposers.items():
                seconds, out = _timed(target, inputs, max_new_tokens, repeats, speculator=speculator,
                                      num_speculative_tokens=k, speculative_schedule="constant")
                m = out.speculative_metrics
                verify = m.verify_time_s / max(m.num_steps, 1) / step_s
                drafted = m.draft_time_s / max(m.num_draft_tokens, 1) * batch_size / step_s
                ideal = m.mean_acceptance_length / (verify + k * drafted * (what != "free drafts"))
                res = result(f"hf_specdec L={length:g} k={k}, {what}", seconds, out,
                             mean_acceptance_length=m.mean_acceptance_length, ideal_speedup=ideal)
                res.fraction_of_ideal = res.speedup_over_off / ideal
                results.append(res)
    return results


def shape_table(results: list[ShapeResult]) -> str:
    """A markdown table of the results."""
    header = ["shape", "batch", "configuration", "tokens/s", "vs eager", "vs static", "vs off", "mean acc. len",
              "ideal", "of ideal", "identical"]
    return markdown_table(header, [[
        r.shape, str(r.batch_size), r.config, f"{r.tokens_per_s:.1f}", f"{r.speedup_over_eager:.2f}x",
        fmt(r.speedup_over_static, ".2f"), fmt(r.speedup_over_off, ".2f"), fmt(r.mean_acceptance_length, ".2f"),
        fmt(r.ideal_speedup, ".2f"), fmt(r.fraction_of_ideal, ".0%"),
        "-" if r.identical is None else "yes" if r.identical else "no"] for r in results])
