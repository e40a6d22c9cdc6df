"""A paged KV cache that plugs into transformers models through `Cache.update` and `AttentionInterface`.

Each layer's keys and values live in one pool tensor of `num_blocks * block_size` slots; a row's tokens are found
through its block table (see `block_manager.py`). Before every forward the runner asks the cache for a `StepPlan`
(`layout.py`): where each new token is written, which slots make up each row's context, and each query's position.
The model's attention modules call `update(...)`, which writes the new keys/values and gathers each row's context;
our registered attention function (`attention.py`) then masks by the plan (causal per row, sliding windows when the
layer has one).

With the triton kernel backend (CUDA by default, see `hf_specdec.kernels`), `update` only writes and the attention
function reads the pools in place through the block tables; with the torch backend `update` gathers each row's
context and the attention is masked SDPA. Both follow `hf_specdec.kernels.paged_attention.reference`.
"""

from __future__ import annotations

import os
import weakref
from contextlib import contextmanager

import numpy as np
import torch
from transformers.cache_utils import Cache

from ..kernels._backend import resolve_backend
from ..kernels.paged_attention.reference import context_slots, slots_of
from .attention import ACTIVE_PLAN
from .block_manager import BlockManager
from .layout import (
    SCRATCH_SLOT,
    ContextGroup,
    PackedLayout,
    StepPlan,
    TreeAttention,
    context_groups,
    host_to_device,
    query_groups,
    token_rows_pay,
)


class KeptPools:
    """A model's KV pools kept from one call to the next, for steps that run as CUDA graphs: a graph reads its pools
    at the addresses it was recorded with, so fresh pools in every `generate` call (or a pool that grows) would
    record every graph again. A cache that keeps them (`PagedKVCache.keep_pools`) starts with them, as large as they
    grew, and hands them back grown. Reusing their contents is safe: a step reads only the slots its rows wrote in
    this call (stale slots lie outside every row's context). One cache uses them at a time; a call running beside it
    on the same model allocates its own."""

    def __init__(self):
        self.block_size: int | None = None
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.user = None  # a weak reference to the cache using them

    def in_use_by_another(self, cache) -> bool:
        user = self.user() if self.user is not None else None
        return user is not None and user is not cache

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for pools in (self.keys, self.values) for p in pools.values())


def release_kv_pools(*owners) -> int:
    """Frees the KV pools kept between calls (`KeptPools`, under CUDA graphs) by these models, or by the models a
    speculator runs (a draft model, an EAGLE head); returns the bytes let go. The next call allocates again and
    records its graphs again."""
    freed = 0
    for owner in owners:
        roots = [owner] if isinstance(owner, torch.nn.Module) else list(owner.modules())
        for root in roots:
            for module in root.modules():
                kept = module.__dict__.pop("_hf_specdec_pools", None)
                if kept is not None:
                    freed += kept.memory_bytes()
    return freed


class PagedKVCache(Cache):
    """Paged keys and values for one model, with O(1) per-row rollback.

    Rollback is this cache's declared capability: `rollback(seq_id, length)` forgets everything past `length` for
    that row alone, by moving its length pointer and freeing its tail blocks; nothing is copied.

    Args:
        block_size (`int`): tokens per block.
        num_blocks (`int`): initial pool size in blocks; the pool doubles as needed up to `max_num_blocks`.
        max_num_blocks (`int`, *optional*): hard cap on the pool, `None` for no cap.
        kernel_backend (`str`): attention backend, `"auto"` (triton on CUDA), `"torch"` or `"triton"`.
    """

    is_compileable = False

    # Token rows (`token_rows_pay`) on the PyTorch path: None decides per step, True whenever a packed step can,
    # False never (benchmarks compare them).
    token_rows: bool | None = None
    # Context groups (`context_groups`) on the PyTorch path: None decides per step, True wherever rows' lengths
    # differ (the model's trial), False never (a model that failed the trial; benchmarks compare them; so does
    # `HF_SPECDEC_CONTEXT_GROUPS=0`).
    context_split: bool | None = None
    # The PyTorch path's context slots computed on the host (None: where the device is the host; an accelerator
    # derives them from the block tables itself). Tests force either on a CPU.
    host_slots: bool | None = None

    def __init__(self, block_size: int = 16, num_blocks: int = 64, max_num_blocks: int | None = None,
                 kernel_backend: str = "auto"):
        self.kernel_backend = kernel_backend
        # transformers' mask helpers iterate `layers`; an empty list tells them nothing (we build our own masks).
        self.layers = []
        if max_num_blocks is not None:
            num_blocks = min(num_blocks, max_num_blocks)
        self.manager = BlockManager(num_blocks, block_size, max_num_blocks=max_num_blocks)
        self.block_size = block_size
        self.key_pools: dict[int, torch.Tensor] = {}  # layer -> [num_blocks * block_size, kv_heads, head_dim]
        self.value_pools: dict[int, torch.Tensor] = {}
        self.plan: StepPlan | None = None
        self._past_length = 0
        self.kept: KeptPools | None = None  # pools kept between calls (`keep_pools`)
        self._unchecked: set[int] = set()  # layers whose kept pools have not met a key yet (shape, dtype, device)

    def keep_pools(self, kept: KeptPools) -> bool:
        """Uses `kept`'s pools, grown to their size, and leaves this cache's in it for the next call. False (nothing
        kept) where another live cache uses them, or they do not fit this one (block size, its cap, tokens already
        held)."""
        if kept.in_use_by_another(self) or self.key_pools or self.manager.num_used_blocks:
            return False
        if kept.keys:
            slots = next(iter(kept.keys.values())).shape[0]
            blocks = slots // self.block_size
            cap = self.manager.max_num_blocks
            if (kept.block_size != self.block_size or slots % self.block_size
                    or (cap is not None and blocks > cap) or blocks < self.manager.num_blocks):
                return False
            if blocks > self.manager.num_blocks:
                self.manager.grow(blocks - self.manager.num_blocks)
            self.key_pools, self.value_pools = dict(kept.keys), dict(kept.values)
            self._unchecked = set(self.key_pools)
        kept.block_size, kept.user, self.kept = self.block_size, weakref.ref(self), kept
        return True

    # --- sequences -----------------------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        self.manager.add_sequence(seq_id)

    def length(self, seq_id: int) -> int:
        return self.manager.length(seq_id)

    def rollback(self, seq_id: int, length: int) -> None:
        self.manager.rollback(seq_id, length)

    def rollback_many(self, seq_ids: list[int], lengths: list[int]) -> None:
        self.manager.rollback_many(seq_ids, lengths)

    def free(self, seq_id: int) -> None:
        self.manager.free(seq_id)

    def reserve(self, seq_ids: list[int], num_tokens: list[int]) -> list[int]:
        """Makes room for `num_tokens[i]` more tokens in each row, growing the pool if needed.

        Returns the position of each row's first new token.
        """
        missing = self.manager.blocks_missing_total(seq_ids, num_tokens)
        if missing > self.manager.num_free_blocks:
            self._grow(missing - self.manager.num_free_blocks)
        return self.manager.append_many(seq_ids, num_tokens)

    def give_regions(self, seq_ids: list[int], num_tokens: int) -> None:
        """Gives each of these row ids room for `num_tokens` tokens in one region of consecutive blocks, the regions
        one after another in this order, kept by the id across its sequences (`BlockManager.give_regions`). While
        rows with consecutive regions step together, in order, the gather-then-SDPA attention reads their keys and
        values as a view of the pool instead of copying them (`StepPlan.context_view`)."""
        before = self.manager.num_blocks
        self.manager.give_regions(seq_ids, self.manager.blocks_for(num_tokens))
        self._extend_pools(self.manager.num_blocks - before)

    def _grow(self, needed: int) -> None:
        # Double the pool (amortised O(1) growth), but never past the cap; the manager raises if `needed` is over it.
        num_new_blocks = max(needed, self.manager.num_blocks - self.manager.num_region_blocks)
        if self.manager.max_num_blocks is not None:
            num_new_blocks = max(needed, min(num_new_blocks, self.manager.max_num_blocks - self.manager.num_blocks))
        self.manager.grow(num_new_blocks)
        self._extend_pools(num_new_blocks)

    def _extend_pools(self, num_new_blocks: int) -> None:
        extra = num_new_blocks * self.block_size
        for pools in (self.key_pools, self.value_pools):
            for layer, pool in pools.items():
                pools[layer] = torch.cat([pool, pool.new_zeros((extra, *pool.shape[1:]))])
        if self.kept is not None:  # the next call starts with them as large as they are now
            self.kept.keys, self.kept.values = dict(self.key_pools), dict(self.value_pools)

    # --- one forward step ----------------------------------------------------------------------------------------
    def plan_step(self, seq_ids: list[int], starts: list[int], num_tokens: list[int], device,
                  tree: TreeAttention | None = None, packed: bool = False) -> StepPlan:
        """Builds the plan for a step in which row i writes `num_tokens[i]` tokens from storage index `starts[i]`.

        Without `tree` storage index and position agree. With one, queries take `tree.query_positions` and attend by
        its masks, on either backend. `packed`: the model gets the rows' tokens as one stream (`PackedLayout`; not
        with a tree, and every row must feed at least one token)."""
        bs = self.block_size
        q = max(num_tokens)
        tables = [self.manager.block_table(s) for s in seq_ids]
        rows, width = len(seq_ids), max(len(t) for t in tables)
        self._past_length = max(starts)
        # The step's arrays are computed on the host from the block tables and reach the device in one copy (on a
        # GPU one transfer instead of a few dozen small kernels; on a CPU numpy's small-array ops cost less than
        # torch's). Each row's context slots too where the device is the host; an accelerator derives them from the
        # tables itself (`[rows, context]` would be a large transfer at long contexts).
        table = np.zeros((rows, width), dtype=np.int64)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        first = np.asarray(starts, dtype=np.int64)
        fed = np.asarray(num_tokens, dtype=np.int64)
        offset = np.arange(q)[None, :] - (q - fed)[:, None]  # [rows, q]; < 0 is padding
        context_lens = first + fed
        query_positions = first[:, None] + np.maximum(offset, 0)
        # Each query's slot through its row's table; padding (whose position may lie past the table) writes to the
        # scratch slot.
        blocks = np.minimum(query_positions // bs, width - 1)
        write_slots = np.take_along_axis(table, blocks, 1) * bs + query_positions % bs
        write_slots = np.where(offset >= 0, write_slots, SCRATCH_SLOT).reshape(-1)

        backend = resolve_backend(self.kernel_backend, device)
        on_host = torch.device(device).type == "cpu" if self.host_slots is None else self.host_slots
        slots = view = None
        num_context = int(context_lens.max())
        if backend == "torch":
            if on_host:
                slots = _host_context_slots(table, context_lens, num_context, bs)
            run = self.manager.contiguous_run(seq_ids)
            if run is not None and num_context <= run[1] * bs:
                view = (run[0] * bs, run[1] * bs)
        layout_parts = split = None
        by_token = False
        if tree is None and packed:
            # The attention groups serve the gather-then-SDPA path only (the kernel reads each row's queries in place);
            # so do token rows, which need the gather (rows read in place keep their groups).
            split = query_groups(num_tokens) if backend == "torch" else None
            pool = next(iter(self.key_pools.values()), None)
            by_token = (backend == "torch" and view is None and self.token_rows is not False
                        and (self.token_rows or token_rows_pay(num_tokens, num_context,
                                                               0 if pool is None else pool[0].numel(), split)))
            layout_parts = PackedLayout.host_parts(num_tokens, q, starts, split, by_token)
            write_slots = write_slots[layout_parts[0]]
            if by_token and slots is not None:  # each token's row's context, its own mask hiding what follows it
                slots = slots[layout_parts[4]]
        host = [table, context_lens, query_positions, write_slots] + ([] if slots is None else [slots])
        on_device = host_to_device(host + (layout_parts or []), device)
        block_tables, context_lens_t, query_positions_t, write_slots_t = on_device[:4]
        slots_t = None if slots is None else on_device[4]
        layout = None if layout_parts is None else PackedLayout.from_parts(on_device[len(host):], split, by_token)
        if backend == "torch" and slots_t is None:
            slots_t = context_slots(block_tables, context_lens_t, num_context, bs, pad_slot=SCRATCH_SLOT)
            if by_token:
                slots_t = slots_t.index_select(0, layout.token_rows)
        if tree is None:
            groups = None
            if (backend == "torch" and view is None and not by_token and split is None and self.context_split
                    is not False and os.environ.get("HF_SPECDEC_CONTEXT_GROUPS", "1") != "0"):
                groups = self._context_groups(seq_ids, context_lens.tolist(), slots_t, device)
            self.plan = StepPlan(write_slots_t, block_tables, bs, query_positions_t, context_lens_t, backend, slots_t,
                                 packed=layout, context_view=view, context_groups=groups)
        else:
            self.plan = StepPlan(write_slots_t, block_tables, bs, tree.query_positions, context_lens_t, backend,
                                 slots_t, tree, query_positions_t, context_view=view)
        return self.plan

    def _context_groups(self, seq_ids, lengths, slots, device) -> tuple[ContextGroup, ...] | None:
        split = context_groups(lengths, *((0, 0.0) if self.context_split else ()))
        if split is None:
            return None
        short_rows, short_context = split
        short = set(short_rows)
        long_rows = [i for i in range(len(seq_ids)) if i not in short]
        groups = []
        for rows, width in ((short_rows, short_context), (long_rows, slots.shape[1])):
            run = self.manager.contiguous_run([seq_ids[i] for i in rows])
            view = (run[0] * self.block_size, run[1] * self.block_size) if run is not None and \
                width <= run[1] * self.block_size else None
            index = torch.tensor(rows, device=device)
            groups.append(ContextGroup(index, slots.index_select(0, index)[:, :width], view))
        return tuple(groups)

    def move(self, block_tables: torch.Tensor, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Copies, in every layer, row i's keys and values at storage index `sources[i, j]` to `destinations[i, j]`
        (`[rows, m]`; a negative destination skips the entry). All sources are read before anything is written.
        Used to pack an accepted tree path into consecutive positions; both indices must lie within each row's
        reserved length, and `block_tables` (`[rows, max_blocks]`, e.g. the last step plan's) must be current."""
        if not self.key_pools or sources.numel() == 0:
            return
        block_tables = block_tables.to(sources.device)
        skip = destinations < 0
        src = torch.where(skip, SCRATCH_SLOT, slots_of(block_tables, sources.clamp(min=0), self.block_size))
        dst = torch.where(skip, SCRATCH_SLOT, slots_of(block_tables, destinations.clamp(min=0), self.block_size))
        src, dst = src.flatten(), dst.flatten()
        for pools in (self.key_pools, self.value_pools):
            for pool in pools.values():  # layers may sit on different devices
                s, d = src.to(pool.device), dst.to(pool.device)
                pool.index_copy_(0, d, pool.index_select(0, s))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Writes this step's keys/values `[rows, kv_heads, q, head_dim]`. Returns each row's (with token rows: each
        token's) gathered context
        `[rows, kv_heads, num_context, head_dim]`, ordered by position and padded (the plan's mask hides padding),
        or with the triton backend the pools themselves `[num_slots, kv_heads, head_dim]` (read in place)."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("PagedKVCache.update called outside a planned step; use hf_specdec's model runner")
        rows, heads, q, dim = key_states.shape
        plan.num_updates += 1
        plan = plan.on(key_states.device)  # each layer's pool lives on the device that layer runs on
        if self._unchecked and layer_idx in self._unchecked:  # a kept pool meets this call's keys: still fit?
            self._unchecked.discard(layer_idx)
            pool, values = self.key_pools[layer_idx], self.value_pools[layer_idx]
            if (pool.shape[1:] != (heads, dim) or pool.dtype != key_states.dtype or pool.device != key_states.device
                    or values.shape[1:] != (heads, value_states.shape[-1]) or values.dtype != value_states.dtype):
                del self.key_pools[layer_idx], self.value_pools[layer_idx]  # (the model was cast or moved)
        if layer_idx not in self.key_pools:
            size = self.manager.num_blocks * self.block_size
            self.key_pools[layer_idx] = key_states.new_zeros((size, heads, dim))
            self.value_pools[layer_idx] = value_states.new_zeros((size, heads, value_states.shape[-1]))
            if self.kept is not None:
                self.kept.keys[layer_idx], self.kept.values[layer_idx] = (self.key_pools[layer_idx],
                                                                          self.value_pools[layer_idx])
        key_pool, value_pool = self.key_pools[layer_idx], self.value_pools[layer_idx]
        key_pool.index_copy_(0, plan.write_slots, key_states.transpose(1, 2).reshape(rows * q, heads, dim))
        value_pool.index_copy_(0, plan.write_slots, value_states.transpose(1, 2).reshape(rows * q, heads, -1))
        if plan.backend == "triton" or plan.context_groups is not None:  # attention reads the pools itself
            return key_pool, value_pool
        if plan.context_view is not None:  # rows in consecutive regions: a view, nothing copied
            first, stride = plan.context_view
            num_rows, num_context = plan.context_slots.shape
            keys = key_pool[first:first + num_rows * stride].view(num_rows, stride, heads, dim)
            values = value_pool[first:first + num_rows * stride].view(num_rows, stride, heads, value_pool.shape[-1])
            return keys[:, :num_context].transpose(1, 2), values[:, :num_context].transpose(1, 2)
        # index_select over the flat slots: the same copy as advanced indexing, about 40% faster on CPUs.
        slots = plan.context_slots.flatten()
        shape = (*plan.context_slots.shape, heads)
        keys = key_pool.index_select(0, slots).view(*shape, dim).transpose(1, 2)
        values = value_pool.index_select(0, slots).view(*shape, value_pool.shape[-1]).transpose(1, 2)
        return keys, values

    @contextmanager
    def active(self, plan: StepPlan):
        """Makes `plan` the one attention finds when a model does not pass it down (see `ACTIVE_PLAN`)."""
        token = ACTIVE_PLAN.set(plan)
        try:
            yield
        finally:
            ACTIVE_PLAN.reset(token)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached before the current step, in its longest row.

        Rows hold different lengths, so no single number is every row's. Models call this to derive positions when
        none are given (OPT, CTRL, the BERT family) or to slice position-indexed buffers; hf_specdec always passes
        each row's `position_ids`, so only the buffer slicing sees this value, and the longest row's keeps every
        slice inside the buffer. (A model that took its positions from here despite `position_ids` would get the
        wrong ones for shorter rows: the architecture sweep in the tests compares every model with plain
        `generate` on a ragged batch, which would show it.)
        """
        return self._past_length

    def memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for pools in (self.key_pools, self.value_pools) for p in pools.values())


def _host_context_slots(table: np.ndarray, context_lens: np.ndarray, num_context: int, block_size: int) -> np.ndarray:
    """`context_slots` on host arrays: `[rows, num_context]` pool slot of each row's positions, the scratch slot past
    its length."""
    positions = np.minimum(np.arange(num_context), table.shape[1] * block_size - 1)
    slots = table[:, positions // block_size] * block_size + positions % block_size
    return np.where(positions[None, :] < context_lens[:, None], slots, SCRATCH_SLOT)
