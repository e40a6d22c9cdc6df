"""Verify attention benchmark: the paged Triton kernel against PyTorch SDPA over the same KV laid out contiguously,
with the cost of the gather that contiguous layout needs shown beside it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._timing import median_ms
from . import paged_attention
from .reference import attention_mask, context_slots


def bench(device: torch.device, batch: int = 32, context: int = 2048, k: int = 5, heads: int = 32,
          kv_heads: int = 8, head_dim: int = 128, block_size: int = 16, dtype=torch.bfloat16,
          repeats: int = 20) -> list[dict]:
    """Defaults: Llama-3-8B head shapes, bf16, k + 1 = 6 queries per row at the end of a 2048-token context."""
    q = k + 1
    blocks_per_row = -(-context // block_size)
    num_blocks = 1 + batch * blocks_per_row
    g = torch.Generator(device).manual_seed(0)
    tables = (torch.randperm(num_blocks - 1, device=device, generator=g) + 1)[: batch * blocks_per_row]
    tables = tables.view(batch, blocks_per_row)
    key_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, device=device, dtype=dtype)
    value_pool = torch.randn_like(key_pool)
    query = torch.randn(batch, heads, q, head_dim, device=device, dtype=dtype)
    positions = (torch.arange(q, device=device) + context - q).expand(batch, -1).contiguous()
    lens = torch.full((batch,), context, device=device)

    slots = context_slots(tables, lens, context, block_size)
    keys = key_pool[slots].transpose(1, 2).contiguous()
    values = value_pool[slots].transpose(1, 2).contiguous()
    mask = attention_mask(positions, context, None)

    def gather():
        return key_pool[slots].transpose(1, 2), value_pool[slots].transpose(1, 2)

    def sdpa():
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)

    triton_ms = median_ms(lambda: paged_attention(query, key_pool, value_pool, tables, positions, block_size,
                                                  backend="triton"), device, repeats)
    sdpa_ms = median_ms(sdpa, device, repeats)
    gather_ms = median_ms(gather, device, repeats)
    reference_ms = median_ms(lambda: paged_attention(query, key_pool, value_pool, tables, positions, block_size,
                                                     backend="torch"), device, repeats)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * key_pool.element_size()
    return [{"op": "paged_attention", "case": "verify, k=5",
             "shape": f"batch {batch}, context {context}, {heads}/{kv_heads} heads x {head_dim}, {dtype}",
             "triton_ms": triton_ms, "sdpa_contiguous_ms": sdpa_ms, "gather_ms": gather_ms,
             "torch_reference_ms": reference_ms, "speedup_vs_sdpa": sdpa_ms / triton_ms,
             "kv_read_gbs": kv_bytes / (triton_ms * 1e-3) / 1e9}]
