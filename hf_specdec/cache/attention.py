"""hf_specdec's attention, registered with transformers' `AttentionInterface` (and a mask function with
`AttentionMaskInterface`) as `ATTENTION_NAME` when this module is first imported: a model set to that implementation
attends over a `PagedKVCache` step by the step's plan (`layout.StepPlan`: causal per row, sliding windows when the
layer has one, draft trees by their masks) instead of a mask tensor.

With the triton kernel backend (CUDA by default, see `hf_specdec.kernels`) the kernel reads the cache's pools in
place through the block tables; with the torch backend it is masked SDPA over the contexts `PagedKVCache.update`
gathered (or over groups of rows that gather their own, `layout.ContextGroup`). Both follow
`hf_specdec.kernels.paged_attention.reference`.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import torch

from ..errors import UnsupportedModelError, torchao_skew_messages_dropped
from ..kernels.paged_attention.graph_op import paged_attention_op
from ..kernels.paged_attention.reference import attend
from .layout import StepPlan

with torchao_skew_messages_dropped():  # the first import of transformers' model code (see there)
    from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

ATTENTION_NAME = "hf_specdec_paged"
PLAN_KWARG = "hf_specdec_plan"
# The plan a compiled step passes (`runners/graphed.py`): its keys and values come gathered, and its mask is the
# `attention_mask` argument; or, with the kernel (`GraphedKernelPlan`), the pools themselves.
GRAPHED = "hf_specdec_graphed_step"


@dataclass
class GraphedKernelPlan:
    """A compiled step's plan where the paged attention kernel reads the pools in place: each row's block table
    `[rows, max_blocks]` and each query's position `[rows, q]`."""

    block_tables: torch.Tensor
    query_positions: torch.Tensor
    block_size: int
# The plan of the forward running now, for models whose decoder layers drop the keyword arguments on their way to
# the attention modules (Nemotron): the attention function finds the plan here (`PagedKVCache.active` sets it) when
# its kwargs lack it.
ACTIVE_PLAN: ContextVar[StepPlan | None] = ContextVar("hf_specdec_active_plan", default=None)


@dataclass(frozen=True)
class MaskRequest:
    """What a model's mask builder asked for, handed to our attention in place of a mask tensor (the step plan
    holds each row's causal structure). Models that declare a sliding window only to their mask builder (PhiMoE,
    Doge) have it honoured through `sliding_window`.

    Attributes:
        sliding_window: the window of a `create_sliding_window_causal_mask` call, or `None`.
        custom: the model combined the mask with its own mask functions (bidirectional image tokens and the like),
            which the plan cannot express.
    """

    sliding_window: int | None = None
    custom: bool = False


def paged_mask(*, local_size: int | None = None, use_vmap: bool = False, **kwargs) -> MaskRequest | None:
    """transformers' mask interface for our attention: no tensor, only what the plan needs to know."""
    if local_size is None and not use_vmap:
        return None
    return MaskRequest(local_size, use_vmap)


def paged_attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None, **kwargs
):
    """Attention over a `PagedKVCache` step: `query` `[rows, heads, q, dim]`, `key`/`value` what `update` returned."""
    plan: StepPlan | None = kwargs.get(PLAN_KWARG) or ACTIVE_PLAN.get()
    if isinstance(plan, GraphedKernelPlan) or plan == GRAPHED:  # a compiled step (`runners/graphed.py`)
        if sliding_window:  # its mask is causal only (models with windows are refused; this guards the rest): the
            # raise sends the step back to the eager path, which applies the window
            raise NotImplementedError(f"{type(module).__name__} attends through a sliding window, which compiled "
                                      "steps do not apply")
        sinks = _head_sinks(kwargs, query.shape[1])
        if plan == GRAPHED:  # `key`, `value` gathered; `attention_mask` the step's
            return attend(query, key, value, attention_mask, scaling, softcap, sinks).contiguous(), None
        # `key`, `value` are the pools: the kernel reads them in place
        return paged_attention_op(query, key, value, plan.block_tables, plan.query_positions, plan.block_size,
                                  scaling, softcap or None, sinks), None
    if plan is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} only runs inside hf_specdec's engine, which sets the "
            "step plan"
        )
    if isinstance(attention_mask, torch.Tensor):  # never silently attend past a mask the model computed itself
        raise NotImplementedError(
            f"{type(module).__name__} computes an attention mask of its own, which hf_specdec's paged attention "
            "cannot apply"
        )
    if isinstance(attention_mask, MaskRequest):
        if attention_mask.custom:
            raise NotImplementedError(
                f"{type(module).__name__} combines its attention mask with mask functions of its own, which "
                "hf_specdec's paged attention cannot apply"
            )
        sliding_window = sliding_window or attention_mask.sliding_window
    sinks = _head_sinks(kwargs, query.shape[1])
    plan.num_attended += 1
    plan = plan.on(query.device)
    packed = plan.packed
    if plan.backend == "triton":
        from ..kernels.paged_attention.triton_kernel import paged_attention_triton

        if packed is not None:  # the kernel reads each row's queries from the stream in place
            out = paged_attention_triton(query, key, value, plan.block_tables, packed.positions, plan.block_size,
                                         sliding_window, scaling, softcap, sinks=sinks, cu_query=packed.cu_query,
                                         max_query_len=plan.query_positions.shape[1])
            return out, None
        out = paged_attention_triton(query, key, value, plan.block_tables, plan.query_positions, plan.block_size,
                                     sliding_window, scaling, softcap, tree=plan.kernel_tree(), sinks=sinks)
        return out, None
    if packed is not None and packed.token_rows is not None:  # a row per token: `[T, heads, 1, dim]` queries
        out = attend(query[0].transpose(0, 1)[:, :, None], key, value, plan.mask(sliding_window), scaling, softcap,
                     sinks)
        return out.transpose(0, 1), None  # `[1, T, heads, dim]`
    if plan.context_groups is not None:  # `key`, `value` are the pools: each group gathers its own contexts
        rows, mask = plan.query_positions.shape[0], plan.mask(sliding_window)
        padded = query if packed is None else packed.pad(query, rows)
        out = _attend_context_groups(padded, key, value, mask, plan.context_groups, scaling, softcap, sinks)
        return (out if packed is None else packed.pack(out)), None
    if packed is not None:  # attention runs padded ([rows, q]); the linear layers around it saw only real tokens
        rows, mask = plan.query_positions.shape[0], plan.mask(sliding_window)
        if packed.groups is None:
            return packed.pack(attend(packed.pad(query, rows), key, value, mask, scaling, softcap, sinks)), None
        # Each group padded to its own width only; right-aligned, its queries' mask is the last `width` columns.
        heads, total, dim = query.shape[1:]
        value_dim = value.shape[-1]  # latent attention's (DeepSeek's) value heads are narrower than its queries'
        out = query.new_empty(total, heads, value_dim)
        for group in packed.groups:
            n = rows if group.rows is None else group.rows.shape[0]
            q = query[0].index_select(1, group.gather).view(heads, n, group.width, dim).transpose(0, 1)
            k, v, m = (key, value, mask) if group.rows is None else (key[group.rows], value[group.rows],
                                                                   mask[group.rows])
            o = attend(q, k, v, m[:, :, m.shape[2] - group.width:], scaling, softcap, sinks)
            out.index_copy_(0, group.targets, o.reshape(-1, heads, value_dim).index_select(0, group.real))
        return out[None], None
    return attend(query, key, value, plan.mask(sliding_window), scaling, softcap, sinks).contiguous(), None


def _attend_context_groups(query, key_pool, value_pool, mask, groups, scaling, softcap, sinks) -> torch.Tensor:
    """Padded queries `[rows, heads, q, dim]` attending group by group to contexts gathered (or viewed) per group
    from the pools `[num_slots, kv_heads, dim]`; returns `[rows, q, heads, dim]`."""
    if key_pool.dim() != 3 or value_pool.dim() != 3 or key_pool.shape[0] != value_pool.shape[0]:
        raise UnsupportedModelError("the model changed the keys or values between the cache's update and attention, "
                                    "which hf_specdec's grouped attention cannot follow; set "
                                    "HF_SPECDEC_CONTEXT_GROUPS=0")
    rows, heads, q, dim = query.shape
    out = query.new_empty(rows, q, heads, value_pool.shape[-1])
    for group in groups:
        n, num_context = group.slots.shape
        if group.view is not None:
            first, stride = group.view
            keys = key_pool[first:first + n * stride].view(n, stride, *key_pool.shape[1:])[:, :num_context]
            values = value_pool[first:first + n * stride].view(n, stride, *value_pool.shape[1:])[:, :num_context]
        else:
            slots = group.slots.flatten()
            keys = key_pool.index_select(0, slots).view(n, num_context, *key_pool.shape[1:])
            values = value_pool.index_select(0, slots).view(n, num_context, *value_pool.shape[1:])
        o = attend(query.index_select(0, group.rows), keys.transpose(1, 2), values.transpose(1, 2),
                   group.mask(mask), scaling, softcap, sinks)
        out.index_copy_(0, group.rows, o)
    return out


def _head_sinks(kwargs, heads: int) -> torch.Tensor | None:
    """The attention-sink logits a model passes (`s_aux`, gpt-oss and its kin), one per head, or `None`."""
    for name in ("s_aux", "sinks"):
        sinks = kwargs.get(name)
        if sinks is not None:
            if sinks.shape != (heads,):
                raise NotImplementedError(
                    f"attention sinks ({name}) of shape {list(sinks.shape)}: hf_specdec's paged attention takes one "
                    f"sink logit per head ([{heads}])"
                )
            return sinks.detach()
    return None


AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, paged_mask)
