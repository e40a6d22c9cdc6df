"""Verify attention straight from the paged KV pool, without gathering each row's context.

One program per (row, kv head, tile of queries): the tile packs `BLOCK_M` (query, head) pairs of one grouped-query
group, so the group's query heads share every key/value load. The program walks the row's context in `BLOCK_N`
position chunks through its block table (only the chunks its queries can see: up to the last query's position, from
the first query's window start), with an online softmax in float32 (float64 under the interpreter for float64
tests).

Attention sinks (`sinks=`, one logit per head) join the softmax once the walk is done: the running maximum and
denominator take the sink's logit, whose value is zero, so the output only shrinks by the mass the sink absorbs.

Draft-tree steps (`tree=`) walk storage indices instead: a row's committed entries, where storage index and
position agree, then its tree region, whose entries a query sees only where its ancestor mask says so (the spec is
`reference.tree_attention_mask`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._backend import check_tensor, interpreting
from .reference import TreeMask

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
              torch.float64: tl.float64}


# Integers that change with the batch (its query count, its block tables' width, a tree's size) are not specialized
# on (Triton compiles a variant per argument equal to 1 or a multiple of 16): a server would otherwise compile new
# variants inside clients' requests whenever a batch first took such a shape (hf_specdec/kernels/variants.py).
@triton.jit(do_not_specialize=["stride_tables_b", "stride_positions_b", "stride_slots_b", "stride_region_mask_b",
                               "stride_region_mask_q", "stride_region_positions_b", "region_len", "num_queries",
                               "sliding_window"])
def _paged_attention_kernel(
    out_ptr, stride_out_b, stride_out_q, stride_out_h,  # [rows, q, heads, head_dim], last stride 1
    query_ptr, stride_query_b, stride_query_h, stride_query_q,  # [rows, heads, q, head_dim], last stride 1
    key_pool_ptr, value_pool_ptr, stride_pool_slot, stride_pool_h,  # [num_slots, kv_heads, head_dim], last stride 1
    block_tables_ptr, stride_tables_b,  # [rows, max_blocks]
    positions_ptr, stride_positions_b,  # [rows, q] int64
    slots_ptr, stride_slots_b,  # tree steps: [rows, q] int64 storage index of each query
    region_start_ptr,  # tree steps: [rows] int64 storage index of the first region entry
    region_mask_ptr, stride_region_mask_b, stride_region_mask_q,  # tree steps: [rows, q, region] int8
    region_positions_ptr, stride_region_positions_b,  # tree steps: [rows, region] int64
    region_len,
    sinks_ptr,  # [heads] float32 sink logits, when HAS_SINKS
    cu_query_ptr,  # VARLEN: [rows + 1] int64 offset of each row's first query in the stream (batch strides are 0)
    num_queries, groups, head_dim, block_size, sliding_window, scale, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    ACC_DTYPE: tl.constexpr, IEEE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, HAS_TREE: tl.constexpr,
    HAS_SINKS: tl.constexpr, VARLEN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    head = kv_head * groups + m % groups
    if VARLEN:  # this row's queries are entries first .. first + row_len - 1 of one stream
        first_query = tl.load(cu_query_ptr + row)
        row_len = tl.load(cu_query_ptr + row + 1) - first_query
        valid_m = m // groups < row_len
        query_idx = first_query + m // groups
    else:
        query_idx = m // groups
        valid_m = query_idx < num_queries
    d = tl.arange(0, BLOCK_D)
    valid_d = d < head_dim

    query_pos = tl.load(positions_ptr + row * stride_positions_b + query_idx, mask=valid_m, other=0)
    q = tl.load(query_ptr + row * stride_query_b + head[:, None] * stride_query_h + query_idx[:, None] * stride_query_q
                + d[None, :], mask=valid_m[:, None] & valid_d[None, :], other=0.0).to(DOT_DTYPE)

    if HAS_TREE:
        query_slot = tl.load(slots_ptr + row * stride_slots_b + query_idx, mask=valid_m, other=0)
        region_start = tl.load(region_start_ptr + row)
    else:
        query_slot = query_pos
    hi = tl.max(tl.where(valid_m, query_slot, 0), axis=0) + 1
    lo = hi * 0
    # Entries below the first query's window start are committed ones (storage index == position), out of every
    # query's window: tree queries sit at or after the region start, pending ones before it.
    if sliding_window > 0:
        first = tl.min(tl.where(valid_m, query_pos, hi), axis=0)
        lo = tl.maximum(first - sliding_window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), ACC_DTYPE)
    l_i = tl.zeros([BLOCK_M], ACC_DTYPE)
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC_DTYPE)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + n
        valid_n = pos < hi
        block = tl.load(block_tables_ptr + row * stride_tables_b + pos // block_size, mask=valid_n, other=0)
        slot = block.to(tl.int64) * block_size + pos % block_size
        kv_offsets = slot[:, None] * stride_pool_slot + kv_head * stride_pool_h + d[None, :]
        kv_mask = valid_n[:, None] & valid_d[None, :]
        k = tl.load(key_pool_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        if IEEE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC_DTYPE)
        else:
            scores = tl.dot(q, tl.trans(k), out_dtype=ACC_DTYPE)
        scores = scores * scale
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), tanh written with exp (portable to the interpreter)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        if HAS_TREE:
            rel = pos - region_start
            in_region = (rel >= 0) & (rel < region_len) & valid_n
            rel = tl.minimum(tl.maximum(rel, 0), tl.maximum(region_len - 1, 0))
            seen = tl.load(region_mask_ptr + row * stride_region_mask_b + query_idx[:, None] * stride_region_mask_q
                           + rel[None, :], mask=valid_m[:, None] & in_region[None, :], other=0)
            committed = (pos < region_start) & valid_n
            allowed = (committed[None, :] & (pos[None, :] <= query_slot[:, None])) | (in_region[None, :] & (seen != 0))
            if sliding_window > 0:
                key_pos = tl.load(region_positions_ptr + row * stride_region_positions_b + rel, mask=in_region,
                                  other=0)
                key_pos = tl.where(in_region, key_pos, pos)
                allowed = allowed & (key_pos[None, :] > query_pos[:, None] - sliding_window)
        else:
            allowed = (pos[None, :] <= query_pos[:, None]) & valid_n[None, :]
            if sliding_window > 0:
                allowed = allowed & (pos[None, :] > query_pos[:, None] - sliding_window)
        scores = tl.where(allowed, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
        p = tl.exp(scores - m_shift[:, None])
        alpha = tl.exp(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(value_pool_ptr + kv_offsets, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee", out_dtype=ACC_DTYPE)
        else:
            pv = tl.dot(p.to(v.dtype), v, out_dtype=ACC_DTYPE)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=valid_m, other=0.0).to(ACC_DTYPE)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + row * stride_out_b + query_idx[:, None] * stride_out_q + head[:, None] * stride_out_h
             + d[None, :], out.to(out_ptr.dtype.element_ty), mask=valid_m[:, None] & valid_d[None, :])


def paged_attention_triton(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    block_m: int = 32,
    block_n: int = 32,
    tree: TreeMask | None = None,
    sinks: torch.Tensor | None = None,
    cu_query: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Launches the kernel; arguments and result as in `reference.paged_attention_reference`, including its
    packed layout (`cu_query`, with `max_query_len` the longest row's query count, known on the host)."""
    varlen = cu_query is not None
    if varlen:
        if tree is not None:
            raise ValueError("a packed query (cu_query=) cannot be combined with a draft tree")
        if max_query_len is None:
            raise ValueError("a packed query (cu_query=) needs max_query_len, the longest row's query count")
        rows = cu_query.shape[0] - 1
        _, heads, num_queries, head_dim = query.shape  # num_queries: the stream's length
    else:
        rows, heads, num_queries, head_dim = query.shape
    kv_heads = key_pool.shape[1]
    device = query.device
    dtypes = (torch.float32, torch.float16, torch.bfloat16) + ((torch.float64,) if interpreting() else ())
    check_tensor("query", query, (1 if varlen else rows, heads, num_queries, head_dim), dtypes, device)
    check_tensor("key_pool", key_pool, (None, kv_heads, head_dim), (query.dtype,), device)
    check_tensor("value_pool", value_pool, tuple(key_pool.shape), (query.dtype,), device)
    check_tensor("block_tables", block_tables, (rows, None), (torch.int32, torch.int64), device)
    check_tensor("query_positions", query_positions, (1, num_queries) if varlen else (rows, num_queries),
                 (torch.int64,), device)
    if varlen:
        check_tensor("cu_query", cu_query, (rows + 1,), (torch.int64,), device)
    if tree is not None:
        region = tree.region_mask.shape[-1]
        check_tensor("tree.query_slots", tree.query_slots, (rows, num_queries), (torch.int64,), device)
        check_tensor("tree.region_start", tree.region_start, (rows,), (torch.int64,), device)
        check_tensor("tree.region_mask", tree.region_mask, (rows, num_queries, region), (torch.bool, torch.int8),
                     device)
        check_tensor("tree.region_positions", tree.region_positions, (rows, region), (torch.int64,), device)
    if sinks is not None:
        check_tensor("sinks", sinks, (heads,), (torch.float32, torch.float16, torch.bfloat16, torch.float64), device)
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if key_pool.stride() != value_pool.stride() or key_pool.stride(1) != head_dim:
        raise ValueError("key_pool and value_pool must be contiguous [num_slots, kv_heads, head_dim] with equal strides")
    groups = heads // kv_heads
    out = torch.empty((1 if varlen else rows, num_queries, heads, head_dim), dtype=query.dtype, device=device)
    if rows == 0 or num_queries == 0:
        return out
    grid = (rows, kv_heads, triton.cdiv((max_query_len if varlen else num_queries) * groups, block_m))
    if tree is not None:
        slots, region_start = tree.query_slots.contiguous(), tree.region_start.contiguous()
        region_mask = tree.region_mask.to(torch.int8).contiguous()  # no copy when the caller passes int8
        region_positions = tree.region_positions.contiguous()
        tree_args = (slots, slots.stride(0), region_start, region_mask, region_mask.stride(0), region_mask.stride(1),
                     region_positions, region_positions.stride(0), region_mask.shape[-1])
    else:  # unused pointers: the positions stand in
        tree_args = (query_positions, 0, query_positions, query_positions, 0, 0, query_positions, 0, 0)
    batch_stride = 0 if varlen else 1  # a packed stream: every row reads the one batch entry
    _paged_attention_kernel[grid](
        out, out.stride(0) * batch_stride, out.stride(1), out.stride(2),
        query, query.stride(0) * batch_stride, query.stride(1), query.stride(2),
        key_pool, value_pool, key_pool.stride(0), key_pool.stride(1),
        block_tables, block_tables.stride(0),
        query_positions, query_positions.stride(0) * batch_stride,
        *tree_args,
        sinks.contiguous() if sinks is not None else query_positions,  # unused pointer without sinks
        cu_query if varlen else query_positions,  # unused pointer without a packed query
        num_queries, groups, head_dim, block_size, sliding_window or 0,
        scale if scale is not None else 1 / math.sqrt(head_dim), softcap or 0.0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        HAS_SOFTCAP=bool(softcap), ACC_DTYPE=tl.float64 if query.dtype == torch.float64 else tl.float32,
        IEEE_DOT=query.dtype == torch.float32,
        # The interpreter has no bfloat16 matrix multiply; it multiplies bfloat16 inputs in float32 instead.
        DOT_DTYPE=tl.float32 if query.dtype == torch.bfloat16 and interpreting() else _TL_DTYPES[query.dtype],
        HAS_TREE=tree is not None,
        HAS_SINKS=sinks is not None,
        VARLEN=varlen,
    )
    return out
