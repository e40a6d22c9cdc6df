"""Rejection sampler benchmark: the Triton kernel against the PyTorch reference, and against the copy roofline for
the bytes it must read (sampled rows: the target row at the final position, plus the draft row after a rejection;
greedy rows: each position up to the first mismatch, plus the bonus position when every draft is accepted)."""

from __future__ import annotations

import torch

from .._timing import copy_bandwidth_gbs, median_ms
from . import rejection_sample


def bench(device: torch.device, batch: int = 256, k: int = 5, vocab: int = 128256, repeats: int = 20) -> list[dict]:
    """Returns one row per mode (greedy, sampled with draft probabilities, sampled with deterministic drafts)."""
    g = torch.Generator(device).manual_seed(0)
    target_probs = torch.softmax(torch.randn(batch, k + 1, vocab, device=device, generator=g), -1)
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, device=device, generator=g), -1)
    # Drafts that agree with the target's argmax 80% of the time: realistic acceptance lengths.
    argmax = target_probs[:, :k].argmax(-1)
    agree = torch.rand(batch, k, device=device, generator=g) < 0.8
    drafts = torch.where(agree, argmax, torch.randint(0, vocab, (batch, k), device=device, generator=g))
    num_drafts = torch.full((batch,), k, device=device)
    bandwidth = copy_bandwidth_gbs(device)
    element = target_probs.element_size()
    rows = []
    for mode, probs, greedy in (("greedy", None, True), ("sampled, draft probs", draft_probs, False),
                                ("sampled, deterministic drafts", None, False)):
        def run(backend, probs=probs, greedy=greedy):
            return rejection_sample(drafts, num_drafts, target_probs, probs, is_greedy=greedy, backend=backend)

        _, num_accepted = run("triton")
        rejected = num_accepted < num_drafts
        if greedy:
            rows_read = (num_accepted + 1).sum().item()  # positions 0..first mismatch, or all k plus the bonus
        else:
            rows_read = batch + (rejected.sum().item() if probs is not None else 0)
        must_read = rows_read * vocab * element
        triton_ms = median_ms(lambda: run("triton"), device, repeats)
        torch_ms = median_ms(lambda: run("torch"), device, repeats)
        achieved = must_read / (triton_ms * 1e-3) / 1e9
        rows.append({"op": "rejection_sample", "case": mode, "shape": f"batch {batch}, k {k}, vocab {vocab}, fp32",
                     "triton_ms": triton_ms, "torch_ms": torch_ms, "speedup": torch_ms / triton_ms,
                     "must_read_mb": must_read / 1e6, "achieved_gbs": achieved, "copy_gbs": bandwidth,
                     "fraction_of_copy": achieved / bandwidth})
    return rows
