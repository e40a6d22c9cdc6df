"""Rejection sampling for the verify step: `rejection_sample(...)` with `backend="auto" | "torch" | "triton"`."""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from .reference import (
    PAD_ID,
    greedy_accept,
    greedy_accept_argmax,
    rejection_sample_reference,
    sample_with_noise,
    sample_with_uniforms,
)

__all__ = ["PAD_ID", "greedy_accept", "greedy_accept_argmax", "rejection_sample", "rejection_sample_reference",
           "sample_with_noise", "sample_with_uniforms"]


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    is_greedy: torch.Tensor | bool,
    uniforms: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    backend: str = "auto",
    target_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keeps the accepted prefix of each row's drafts and adds the recovered or bonus token.

    Args:
        draft_token_ids: `[batch, k]` int64 drafts, -1 past each row's count.
        num_draft_tokens: `[batch]` int64 drafts per row (0 allowed).
        target_probs: `[batch, k + 1, vocab]` target probabilities (float32, bfloat16 or float16); for greedy rows any
            scores with the target's argmax, such as the processed logits.
        draft_probs: `[batch, k, draft_vocab]` probabilities the drafts were sampled from, `None` for deterministic
            drafts (n-gram lookup, greedy drafting).
        is_greedy: `[batch]` bool, or one bool for every row.
        uniforms: `[batch, k]` float64 acceptance draws; drawn from `generator` when `None`.
        seeds: `[batch]` int64 per-row seeds for the recovered/bonus draw, for reproducible rows whatever the batch;
            drawn from `generator` when `None`.
        generator: the random source when `uniforms`/`seeds` are not given (the global one when `None`, so
            `torch.manual_seed` makes runs reproducible).
        backend: `"auto"` (triton on CUDA, torch elsewhere, unless `HF_SPECDEC_KERNEL_BACKEND` says otherwise),
            `"torch"` or `"triton"`. A batch known to be all greedy (`is_greedy=True`) takes the PyTorch greedy rule
            (`greedy_accept`) on every backend: its argmax is one parallel reduction there, while the kernel scans
            each row's positions in one program (on an H200, batch 256, k 5, vocab 128256: 0.45 ms against the
            kernel's 0.72; docs/kernels.md).
        target_index: `[batch, k + 1]`, where `target_probs` is packed `[n, vocab]`: each position's entry there
            (`rejection_sample_reference`). The PyTorch rule reads only the entries it needs; the kernel gets the
            probabilities laid out per row.

    Returns:
        `(output_token_ids, num_accepted)`: `[batch, k + 1]` int64 (accepted drafts, then the recovered or bonus
        token, then -1) and `[batch]` int64 accepted drafts per row.
    """
    batch, k = draft_token_ids.shape
    device = target_probs.device
    backend = resolve_backend(backend, device)
    all_greedy = is_greedy if isinstance(is_greedy, bool) else None
    if all_greedy is True:
        if target_index is not None:
            return greedy_accept_argmax(draft_token_ids, num_draft_tokens, target_probs.argmax(-1)[target_index])
        return greedy_accept(draft_token_ids, num_draft_tokens, target_probs)
    if uniforms is None and all_greedy is not True:
        uniforms = torch.rand((batch, k), dtype=torch.float64, device=device, generator=generator)
    if backend == "triton" and all_greedy is not True:
        from .triton_kernel import rejection_sample_triton
        if target_index is not None:
            target_probs = target_probs[target_index]

        if isinstance(is_greedy, bool):
            is_greedy = torch.full((batch,), is_greedy, dtype=torch.bool, device=device)
        if seeds is None and all_greedy is not True:
            seeds = torch.randint(0, 2**31 - 1, (batch,), device=device, generator=generator)
        return rejection_sample_triton(draft_token_ids, num_draft_tokens, target_probs, draft_probs, is_greedy,
                                       uniforms, seeds=seeds)
    noise = final_uniforms = None
    if all_greedy is not True:
        vocab = target_probs.shape[-1]
        if seeds is None:  # one uniform per row, not a vocabulary of Exp(1) noise (see `reference`)
            final_uniforms = torch.rand(batch, dtype=torch.float64, device=device, generator=generator)
        else:  # per-row generators: a row's draw depends only on its own seed (the spec; not a hot path)
            noise = torch.stack([
                torch.empty(vocab, dtype=torch.float32, device=device).exponential_(
                    generator=torch.Generator(device).manual_seed(int(s))) for s in seeds.tolist()])
    return rejection_sample_reference(draft_token_ids, num_draft_tokens, target_probs, draft_probs, is_greedy,
                                      uniforms, noise, final_uniforms, target_index)
