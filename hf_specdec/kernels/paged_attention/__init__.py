"""Verify attention over the paged KV cache: `paged_attention(...)` with `backend="auto" | "torch" | "triton"`."""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from .reference import TreeMask, attend, attention_mask, context_slots, paged_attention_reference

__all__ = ["TreeMask", "attend", "attention_mask", "context_slots", "paged_attention", "paged_attention_reference"]


def paged_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    block_size: int,
    sliding_window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    backend: str = "auto",
    tree: TreeMask | None = None,
    sinks: torch.Tensor | None = None,
    cu_query: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's queries attend causally to that row's cached tokens through its block table.

    Args:
        query: `[rows, heads, q, head_dim]` (heads a multiple of the pool's kv heads: grouped-query attention).
        key_pool, value_pool: `[num_slots, kv_heads, head_dim]` pools; slot = block * block_size + offset.
        block_tables: `[rows, max_blocks]` block ids per row.
        query_positions: `[rows, q]` int64 position of each query (its keys/values already written to the pool).
        block_size: tokens per block.
        sliding_window: the layer's window (a query sees its last `sliding_window` positions), or `None`.
        scale: score scale (`1 / sqrt(head_dim)` when `None`).
        softcap: logit soft-capping value, or `None`.
        backend: `"auto"`, `"torch"` (gather, then SDPA) or `"triton"` (reads the pool in place).
        tree (`TreeMask`, *optional*): a draft-tree step (see `reference.tree_attention_mask`).
        sinks: `[heads]` attention-sink logits (gpt-oss): each joins its head's softmax with a zero value.
        cu_query: the packed (varlen) layout: `[rows + 1]` offsets of each row's queries in one stream; `query` is
            `[1, heads, T, head_dim]` and `query_positions` `[1, T]`.

    Returns:
        `[rows, q, heads, head_dim]` (`[1, T, heads, head_dim]` when packed).
    """
    if resolve_backend(backend, query.device) == "triton":
        from .triton_kernel import paged_attention_triton

        max_query_len = int(cu_query.diff().max()) if cu_query is not None else None
        return paged_attention_triton(query, key_pool, value_pool, block_tables, query_positions, block_size,
                                      sliding_window, scale, softcap, tree=tree, sinks=sinks, cu_query=cu_query,
                                      max_query_len=max_query_len)
    return paged_attention_reference(query, key_pool, value_pool, block_tables, query_positions, block_size,
                                     sliding_window, scale, softcap, tree, sinks, cu_query)
