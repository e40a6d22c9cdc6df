"""Rejection sampling in one Triton program per row: the acceptance scan, then the recovered or bonus token.

Same contract as `reference.py`. Sampled rows read only the draft tokens' probabilities during the scan (a gather),
then one pass over the vocabulary at the final position: `max(target_probs - draft_probs, 0)` for a recovered token,
the target itself for a bonus token, sampled as `argmax(w / e)` with `e ~ Exp(1)` from Philox (per-row seed) or from a
given noise tensor. Greedy rows take the argmax of each position's scores, stopping at the first mismatch (whose
argmax is the recovered token), so each position is read at most once and nothing past a rejection is read. Nothing here synchronises with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import check_tensor, interpreting

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPRETER_DTYPES = FLOAT_DTYPES + (torch.float64,)  # float64 models in tests, under TRITON_INTERPRET=1 only


@triton.jit
def _argmax_row(row_ptr, vocab, BLOCK_V: tl.constexpr):
    """Index of the largest score in `row_ptr[0:vocab]`, first index on ties (as torch.argmax)."""
    offs = tl.arange(0, BLOCK_V)
    best = tl.max(tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32), axis=0)
    best_idx = tl.argmax(tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32), axis=0)
    for start in range(BLOCK_V, vocab, BLOCK_V):
        scores = tl.load(row_ptr + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32)
        block_best = tl.max(scores, axis=0)
        block_idx = tl.argmax(scores, axis=0) + start
        better = block_best > best  # strict: an earlier block keeps ties
        best_idx = tl.where(better, block_idx, best_idx)
        best = tl.where(better, block_best, best)
    return best_idx.to(tl.int64)


# The draft count and the strides that follow it change from step to step: not specialized on (see the attention
# kernel), and BLOCK_K is at least 16, so every k up to 15 shares one compiled variant.
@triton.jit(do_not_specialize=["stride_draft_b", "stride_target_b", "stride_draft_probs_b", "stride_uniforms_b", "k"])
def _rejection_sample_kernel(
    out_ptr,  # [batch, k + 1] int64, written fully (-1 past the output)
    num_accepted_ptr,  # [batch] int64
    draft_ids_ptr, stride_draft_b,  # [batch, k] int64
    num_draft_ptr,  # [batch] int64
    target_ptr, stride_target_b, stride_target_k,  # [batch, k + 1, vocab], last stride 1
    draft_probs_ptr, stride_draft_probs_b, stride_draft_probs_k, draft_vocab,  # [batch, k, draft_vocab] or dummy
    is_greedy_ptr,  # [batch] int8
    uniforms_ptr, stride_uniforms_b,  # [batch, k] float64 or dummy
    noise_ptr, stride_noise_b,  # [batch, vocab] float32 or dummy
    seeds_ptr,  # [batch] int64 or dummy
    k, vocab,
    HAS_DRAFT_PROBS: tl.constexpr, HAS_NOISE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num_draft = tl.load(num_draft_ptr + row)
    greedy = tl.load(is_greedy_ptr + row) != 0
    target_row = target_ptr + row * stride_target_b
    num_accepted = num_draft * 0
    alive = num_draft * 0 + 1
    target_argmax = num_draft * 0  # greedy: the argmax at the last position read (the recovered token on a mismatch)
    for j in range(0, k):
        if (j < num_draft) & (alive != 0):
            draft_id = tl.load(draft_ids_ptr + row * stride_draft_b + j)
            if greedy:
                target_argmax = _argmax_row(target_row + j * stride_target_k, vocab, BLOCK_V)
                ok = target_argmax == draft_id
            else:
                target_p = tl.load(target_row + j * stride_target_k + draft_id, mask=draft_id < vocab, other=0.0)
                target_p = target_p.to(tl.float64)
                if HAS_DRAFT_PROBS:
                    draft_p = tl.load(draft_probs_ptr + row * stride_draft_probs_b + j * stride_draft_probs_k
                                      + draft_id, mask=draft_id < draft_vocab, other=0.0).to(tl.float64)
                else:
                    draft_p = target_p * 0 + 1.0
                u = tl.load(uniforms_ptr + row * stride_uniforms_b + j)
                ok = (draft_p > 0) & (target_p >= u * draft_p)
            if ok:
                tl.store(out_ptr + row * (k + 1) + j, draft_id)
                num_accepted += 1
            else:
                alive = alive * 0  # same dtype as the loop-carried value (compiled Triton requires it)

    final_row = target_row + num_accepted * stride_target_k
    if greedy:
        if num_accepted < num_draft:  # rejected: the mismatching argmax is already known, no second read
            token = target_argmax
        else:
            token = _argmax_row(final_row, vocab, BLOCK_V)
    else:
        rejected = num_accepted < num_draft
        rejected_id = tl.load(draft_ids_ptr + row * stride_draft_b + num_accepted, mask=rejected, other=-1)
        removed_vocab = tl.where(rejected, draft_vocab, 0)  # read draft probabilities only after a rejection
        draft_row = draft_probs_ptr + row * stride_draft_probs_b + num_accepted * stride_draft_probs_k
        if HAS_NOISE:
            seed = 0
        else:
            seed = tl.load(seeds_ptr + row)
        offs = tl.arange(0, BLOCK_V)
        best = tl.max(tl.full([BLOCK_V], -2.0, tl.float32), axis=0)
        token = num_draft * 0
        for start in range(0, vocab, BLOCK_V):
            idx = start + offs
            in_vocab = idx < vocab
            weights = tl.load(final_row + idx, mask=in_vocab, other=0.0).to(tl.float32)
            if HAS_DRAFT_PROBS:
                removed = tl.load(draft_row + idx, mask=in_vocab & (idx < removed_vocab), other=0.0)
                removed = removed.to(tl.float32)
            else:
                removed = tl.where(idx == rejected_id, 1.0, 0.0)
            weights = tl.maximum(weights - removed, 0.0)
            if HAS_NOISE:
                noise = tl.load(noise_ptr + row * stride_noise_b + idx, mask=in_vocab, other=1.0)
            else:
                noise = -tl.log(tl.rand(seed, idx))
            scores = tl.where((weights > 0) & in_vocab, tl.math.div_rn(weights, noise), -1.0)
            block_best = tl.max(scores, axis=0)
            block_idx = tl.argmax(scores, axis=0) + start
            better = block_best > best
            token = tl.where(better, block_idx, token)
            best = tl.where(better, block_best, best)

    tl.store(out_ptr + row * (k + 1) + num_accepted, token)
    tl.store(num_accepted_ptr + row, num_accepted)
    cols = tl.arange(0, BLOCK_K)
    tl.store(out_ptr + row * (k + 1) + cols, tl.full([BLOCK_K], -1, tl.int64), mask=(cols > num_accepted) & (cols <= k))


def rejection_sample_triton(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor,
    uniforms: torch.Tensor | None,
    seeds: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    block_v: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the kernel; arguments as in `reference.rejection_sample_reference`, plus `seeds` (`[batch]` int64,
    the per-row Philox seeds for the recovered/bonus draw) unless `noise` is given."""
    batch, k = draft_token_ids.shape
    device = target_probs.device
    vocab = target_probs.shape[-1]
    floats = INTERPRETER_DTYPES if interpreting() else FLOAT_DTYPES
    check_tensor("draft_token_ids", draft_token_ids, (batch, k), (torch.int64,), device, contiguous_last=True)
    check_tensor("num_draft_tokens", num_draft_tokens, (batch,), (torch.int64,), device)
    check_tensor("target_probs", target_probs, (batch, k + 1, vocab), floats, device)
    check_tensor("is_greedy", is_greedy, (batch,), (torch.bool,), device)
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, (batch, k, None), floats, device)
    if uniforms is not None:
        check_tensor("uniforms", uniforms, (batch, k), (torch.float64,), device)
    if noise is not None:
        check_tensor("noise", noise, (batch, vocab), (torch.float32,), device)
    elif seeds is not None:
        check_tensor("seeds", seeds, (batch,), (torch.int64,), device)
    out = torch.empty((batch, k + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty((batch,), dtype=torch.int64, device=device)
    if batch == 0:
        return out, num_accepted
    dummy = num_draft_tokens  # never read: the constexpr flags compile its loads away
    sampled = uniforms is not None
    if sampled and noise is None and seeds is None:
        raise ValueError("sampled rows need `seeds` (per-row Philox seeds) or `noise`")
    _rejection_sample_kernel[(batch,)](
        out, num_accepted,
        draft_token_ids, draft_token_ids.stride(0),
        num_draft_tokens,
        target_probs, target_probs.stride(0), target_probs.stride(1),
        draft_probs if draft_probs is not None else dummy,
        draft_probs.stride(0) if draft_probs is not None else 0,
        draft_probs.stride(1) if draft_probs is not None else 0,
        draft_probs.shape[-1] if draft_probs is not None else 0,
        is_greedy.view(torch.int8),
        uniforms if sampled else dummy, uniforms.stride(0) if sampled else 0,
        noise if noise is not None else dummy, noise.stride(0) if noise is not None else 0,
        seeds if seeds is not None else dummy,
        k, vocab,
        HAS_DRAFT_PROBS=draft_probs is not None, HAS_NOISE=noise is not None,
        BLOCK_V=min(block_v, triton.next_power_of_2(vocab)), BLOCK_K=max(16, triton.next_power_of_2(k + 1)),
    )
    return out, num_accepted
