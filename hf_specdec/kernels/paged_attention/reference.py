"""Verify attention over a paged KV cache: the plain PyTorch spec (gather each row's context, then masked SDPA).

Layout: each layer's keys and values live in a pool `[num_slots, kv_heads, head_dim]`; slot `b * block_size + o` is
offset `o` of block `b`, and row i's token at position p sits in block `block_tables[i, p // block_size]`. A step's
queries `[rows, heads, q, head_dim]` carry their positions `[rows, q]`; query (i, j) attends to row i's positions
`<= query_positions[i, j]` (causal), and within the last `sliding_window` of them when the layer has a window.
Grouped-query heads share kv head `head // (heads // kv_heads)`. Optional logit soft-capping: `softcap * tanh(s /
softcap)`. Optional attention sinks (gpt-oss): one learned logit per head that joins every query's softmax with a
zero value, so it only absorbs probability mass: `softmax([scores, sink])` without its last entry.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


def slots_of(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slot of each row's `positions` `[rows, n]` through its block table."""
    return block_tables.gather(1, positions // block_size) * block_size + positions % block_size


def context_slots(block_tables: torch.Tensor, context_lens: torch.Tensor, num_context: int, block_size: int,
                  pad_slot: int = 0) -> torch.Tensor:
    """`[rows, num_context]` pool slot of each row's positions `0..num_context-1`, `pad_slot` past its length."""
    positions = torch.arange(num_context, device=block_tables.device).expand(len(block_tables), -1)
    in_row = positions < context_lens[:, None]
    slots = slots_of(block_tables, positions.clamp(max=block_tables.shape[1] * block_size - 1), block_size)
    return torch.where(in_row, slots, pad_slot)


def attention_mask(query_positions: torch.Tensor, num_context: int, sliding_window: int | None) -> torch.Tensor:
    """`[rows, 1, q, num_context]` bool: True where a query may attend (causal, within the window if any)."""
    context_pos = torch.arange(num_context, device=query_positions.device)
    query_pos = query_positions[:, :, None]  # [rows, q, 1]
    allowed = context_pos[None, None, :] <= query_pos
    if sliding_window:
        allowed &= context_pos[None, None, :] > query_pos - sliding_window
    return allowed[:, None]


class TreeMask(NamedTuple):
    """What a draft-tree step's queries may see (see `tree_attention_mask`): `query_slots` `[rows, q]` storage index
    of each query, `region_start` `[rows]`, `region_mask` `[rows, q, region]` bool (the Triton launcher also takes
    int8), `region_positions` `[rows, region]`. The queries' positions (rotary, sliding windows) are the usual
    `query_positions`."""

    query_slots: torch.Tensor
    region_start: torch.Tensor
    region_mask: torch.Tensor
    region_positions: torch.Tensor


def tree_attention_mask(query_slots: torch.Tensor, query_positions: torch.Tensor, num_context: int,
                        region_start: torch.Tensor, region_mask: torch.Tensor, region_positions: torch.Tensor,
                        sliding_window: int | None) -> torch.Tensor:
    """`[rows, 1, q, num_context]` bool mask for a step that feeds draft-tree nodes.

    A row's context is laid out in storage order: its committed tokens at storage indices `< region_start`, where
    storage index and position agree, then the tree region, whose entries hold tree nodes (several share a position,
    one per depth). A query sees every committed entry up to its own storage index `query_slots` (causal), and in the
    region exactly the entries `region_mask` allows (its ancestors and itself). Sliding windows compare positions.

    Args:
        query_slots: `[rows, q]` storage index of each query; query_positions: `[rows, q]` its position.
        region_start: `[rows]`; region_mask: `[rows, q, region]` bool; region_positions: `[rows, region]`.
    """
    rows, q = query_slots.shape
    region = region_mask.shape[-1]
    context = torch.arange(num_context, device=query_slots.device)[None, :].expand(rows, -1)  # [rows, ctx]
    rel = context - region_start[:, None]
    committed = rel < 0
    in_region = ~committed & (rel < region)
    rel = rel.clamp(0, max(region - 1, 0))
    allowed = committed[:, None, :] & (context[:, None, :] <= query_slots[:, :, None])
    if region:
        allowed |= in_region[:, None, :] & region_mask.gather(2, rel[:, None, :].expand(rows, q, -1))
    if sliding_window:
        key_positions = torch.where(in_region, region_positions.gather(1, rel) if region else context, context)
        allowed &= key_positions[:, None, :] > query_positions[:, :, None] - sliding_window
    return allowed[:, None]


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float | None,
           softcap: float | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Masked attention over gathered contexts `[rows, kv_heads, num_context, head_dim]`; returns `[rows, q, heads,
    head_dim]` (the layout transformers' attention functions return). `sinks`: `[heads]` sink logits, or `None`."""
    if not softcap and sinks is None:
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    else:  # soft-capping and sinks need the scores, so compute them explicitly
        groups = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
        scores = query @ keys.transpose(-1, -2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        # softmax in float32 at least (float64 stays float64: exactness tests run in it)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        if sinks is not None:  # one more logit per (row, head, query), whose value is zero: dropped after softmax
            sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = probs.to(query.dtype) @ values
    return out.transpose(1, 2)


def paged_attention_reference(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    tree: TreeMask | None = None,
    sinks: torch.Tensor | None = None,
    cu_query: torch.Tensor | None = None,
) -> torch.Tensor:
    """The spec.

    Args:
        query: `[rows, heads, q, head_dim]`.
        key_pool, value_pool: `[num_slots, kv_heads, head_dim]`.
        block_tables: `[rows, max_blocks]` int block ids per row (entries past a row's blocks are ignored).
        query_positions: `[rows, q]` int64 position of each query in its row.
        block_size: tokens per block.
        sliding_window: attend only to the last `sliding_window` positions (including the query's own), or `None`.
        scale: score scale, `1 / sqrt(head_dim)` when `None`.
        softcap: logit soft-capping value, or `None`.
        tree (`TreeMask`, *optional*): a draft-tree step: queries sit at `tree.query_slots` in storage and see what
            `tree_attention_mask` allows.
        sinks: `[heads]` attention-sink logits (see the module docstring), or `None`.
        cu_query: the packed layout: `[rows + 1]` int64 offsets into one stream of every row's queries; `query` is
            then `[1, heads, T, head_dim]` and `query_positions` `[1, T]` (T = `cu_query[-1]`; no tree).

    Returns:
        `[rows, q, heads, head_dim]` in the query's dtype (`[1, T, heads, head_dim]` when packed).
    """
    if cu_query is not None:  # each row's queries padded on the right, attended as above, then packed again
        counts = cu_query.diff()
        width = int(counts.max()) if counts.numel() else 0
        index = cu_query[:-1, None] + torch.arange(width, device=cu_query.device)[None, :]
        real = torch.arange(width, device=cu_query.device)[None, :] < counts[:, None]
        index = torch.where(real, index, cu_query[:-1, None])  # padding repeats the row's first query
        padded = query[0][:, index].transpose(0, 1)  # [rows, heads, width, head_dim]
        positions = query_positions[0][index]
        out = paged_attention_reference(padded, key_pool, value_pool, block_tables, positions, block_size,
                                        sliding_window, scale, softcap, None, sinks)
        return out[real][None]
    context_lens = (query_positions if tree is None else tree.query_slots).max(dim=1).values + 1
    num_context = int(context_lens.max())
    slots = context_slots(block_tables, context_lens, num_context, block_size)
    keys = key_pool[slots].transpose(1, 2)  # [rows, kv_heads, num_context, head_dim]
    values = value_pool[slots].transpose(1, 2)
    if tree is None:
        mask = attention_mask(query_positions, num_context, sliding_window)
    else:
        mask = tree_attention_mask(tree.query_slots, query_positions, num_context, tree.region_start,
                                   tree.region_mask, tree.region_positions, sliding_window)
    return attend(query, keys, values, mask, scale, softcap, sinks)
