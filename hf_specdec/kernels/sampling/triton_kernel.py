"""Temperature, top-k and top-p in one program per row, with no sort: thresholds are found by a 16-ary search.

Scores map to int32 keys that order like the floats. Top-k needs the largest key t with `count(key >= t) >= k`;
top-p the smallest key t with `sum(exp(score - max) for kept tokens with key <= t) > (1 - top_p) * Z`. Each search
round streams the row once and evaluates 15 candidate thresholds at a time, so 32-bit keys take 8 rounds. The row is
read about 2 + 8 (top-k) + 9 (top-p) times and written once; no extra memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._backend import check_tensor

NUM_CANDIDATES = 16  # thresholds tried per search round (the first is the current lower bound)
NUM_ROUNDS = 8  # 16 ** 8 = 2 ** 32 keys


@triton.jit
def _keys(scores):
    """int32 keys ordered like the float32 scores (-inf included)."""
    bits = scores.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _scores(row_ptr, idx, vocab, temperature, HAS_TEMPERATURE: tl.constexpr):
    """Scores at `idx` (-inf past the vocabulary), divided by the temperature as the spec does (multiplying by its
    reciprocal can differ in the last bit)."""
    x = tl.load(row_ptr + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
    if HAS_TEMPERATURE:
        x = tl.math.div_rn(x, temperature)
    return x


@triton.jit
def _sampling_params_kernel(
    out_ptr, stride_out,  # [n, vocab] float32
    logits_ptr, stride_logits,  # [n, vocab]
    temperature_ptr, top_k_ptr, top_p_ptr,  # [n] each (dummies when absent)
    vocab,
    HAS_TEMPERATURE: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr,
    BLOCK_V: tl.constexpr, NUM_CANDIDATES: tl.constexpr, NUM_ROUNDS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits
    offs = tl.arange(0, BLOCK_V)
    cand = tl.arange(0, NUM_CANDIDATES)
    if HAS_TEMPERATURE:
        temperature = tl.load(temperature_ptr + row).to(tl.float32)
    else:
        temperature = 1.0  # unused

    # The row's largest key (the top token always survives both filters).
    max_key = tl.max(tl.full([BLOCK_V], -2147483647 - 1, tl.int32), axis=0)
    for start in range(0, vocab, BLOCK_V):
        s = _scores(row_ptr, start + offs, vocab, temperature, HAS_TEMPERATURE)
        max_key = tl.maximum(max_key, tl.max(_keys(s), axis=0))

    # Top-k: the largest threshold t with count(key >= t) >= k.
    k_key = max_key * 0 - 2147483647 - 1  # keep everything
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row)
        if (k > 0) & (k < vocab):
            lo = (max_key * 0 - 2147483647 - 1).to(tl.int64)  # count(key >= lo) = vocab >= k
            hi = max_key.to(tl.int64)  # any valid answer is <= the largest key
            for _ in range(NUM_ROUNDS):
                step = (hi - lo + NUM_CANDIDATES) // NUM_CANDIDATES
                thresholds = lo + cand.to(tl.int64) * step  # thresholds[0] = lo
                counts = tl.zeros([NUM_CANDIDATES], tl.int64)
                for start in range(0, vocab, BLOCK_V):
                    key = _keys(_scores(row_ptr, start + offs, vocab, temperature, HAS_TEMPERATURE)).to(tl.int64)
                    key = tl.where(start + offs < vocab, key, -4294967296)  # padding never counts
                    counts += tl.sum((key[:, None] >= thresholds[None, :]).to(tl.int64), axis=0)
                ok = (counts >= k) & (thresholds <= hi)
                new_lo = tl.max(tl.where(ok, thresholds, lo), axis=0)
                fail = tl.where(ok | (thresholds > hi), hi + 1, thresholds)
                hi = tl.minimum(tl.min(fail, axis=0) - 1, hi)
                lo = new_lo
            k_key = lo.to(tl.int32)

    # Top-p over what top-k kept: the smallest threshold t with sum(e_i for key_i <= t) > (1 - p) * Z.
    p_key = k_key
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row).to(tl.float32)
        if p < 1.0:
            max_score = _float_of_key(max_key)
            total = tl.zeros([BLOCK_V], tl.float32)
            for start in range(0, vocab, BLOCK_V):
                s = _scores(row_ptr, start + offs, vocab, temperature, HAS_TEMPERATURE)
                total += tl.where(_keys(s) >= k_key, tl.exp(s - max_score), 0.0)
            limit = (1.0 - p) * tl.sum(total, axis=0)
            lo = k_key.to(tl.int64)
            hi = max_key.to(tl.int64)  # mass(key <= max) = Z > limit: the answer lies in [lo, hi]
            for _ in range(NUM_ROUNDS):
                step = (hi - lo + NUM_CANDIDATES) // NUM_CANDIDATES
                thresholds = lo + cand.to(tl.int64) * step
                mass = tl.zeros([NUM_CANDIDATES], tl.float32)
                for start in range(0, vocab, BLOCK_V):
                    s = _scores(row_ptr, start + offs, vocab, temperature, HAS_TEMPERATURE)
                    key = _keys(s)
                    e = tl.where(key >= k_key, tl.exp(s - max_score), 0.0)
                    key = key.to(tl.int64)
                    mass += tl.sum(tl.where(key[:, None] <= thresholds[None, :], e[:, None], 0.0), axis=0)
                above = (mass > limit) & (thresholds <= hi)
                new_hi = tl.min(tl.where(above, thresholds, hi), axis=0)
                low = tl.where(above | (thresholds > hi), lo - 1, thresholds)
                lo = tl.maximum(tl.max(low, axis=0) + 1, lo)
                hi = new_hi
            p_key = hi.to(tl.int32)

    keep_key = tl.maximum(k_key, p_key)
    for start in range(0, vocab, BLOCK_V):
        idx = start + offs
        s = _scores(row_ptr, idx, vocab, temperature, HAS_TEMPERATURE)
        tl.store(out_ptr + row * stride_out + idx, tl.where(_keys(s) >= keep_key, s, float("-inf")), mask=idx < vocab)


@triton.jit
def _float_of_key(key):
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


def apply_sampling_params_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    block_v: int = 1024,
) -> torch.Tensor:
    """Launches the kernel; arguments and result as in `reference.apply_sampling_params_reference`."""
    n, vocab = logits.shape
    device = logits.device
    check_tensor("logits", logits, (n, vocab), (torch.float32, torch.float16, torch.bfloat16), device)
    if temperature is not None:
        check_tensor("temperature", temperature, (n,), (torch.float32,), device)
    if top_k is not None:
        check_tensor("top_k", top_k, (n,), (torch.int64,), device)
    if top_p is not None:
        check_tensor("top_p", top_p, (n,), (torch.float32,), device)
    out = torch.empty((n, vocab), dtype=torch.float32, device=device)
    if n == 0:
        return out
    dummy = out
    _sampling_params_kernel[(n,)](
        out, out.stride(0), logits, logits.stride(0),
        temperature if temperature is not None else dummy,
        top_k if top_k is not None else dummy,
        top_p if top_p is not None else dummy,
        vocab,
        HAS_TEMPERATURE=temperature is not None, HAS_TOP_K=top_k is not None, HAS_TOP_P=top_p is not None,
        BLOCK_V=min(block_v, triton.next_power_of_2(vocab)), NUM_CANDIDATES=NUM_CANDIDATES, NUM_ROUNDS=NUM_ROUNDS,
    )
    return out
