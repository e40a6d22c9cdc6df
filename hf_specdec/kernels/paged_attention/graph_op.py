"""The paged attention kernel as a PyTorch custom op (`hf_specdec::paged_attention`), for compiled steps.

`torch.compile` treats the op as opaque: the kernel reads the KV pools in place through the block tables, so the
compiled step's shapes hold no context length (a CUDA graph per bucket of rows serves every context), and inductor
needs no trace of the Triton launch. Its fake implementation gives the output's shape; the real one launches
`triton_kernel.paged_attention_triton` (on a CPU only under `TRITON_INTERPRET=1`, as the tests run it).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("hf_specdec::paged_attention", mutates_args=())
def paged_attention_op(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                       block_tables: torch.Tensor, query_positions: torch.Tensor, block_size: int,
                       scale: float | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """`[rows, q, heads, value_dim]`: each row's queries `[rows, heads, q, dim]` attending causally to its cached
    tokens (see `reference.paged_attention_reference`)."""
    from .triton_kernel import paged_attention_triton

    return paged_attention_triton(query, key_pool, value_pool, block_tables, query_positions, block_size, None,
                                  scale, softcap, sinks=sinks)


@paged_attention_op.register_fake
def _(query, key_pool, value_pool, block_tables, query_positions, block_size, scale, softcap, sinks):
    rows, heads, q, _ = query.shape
    return query.new_empty(rows, q, heads, value_pool.shape[-1])
