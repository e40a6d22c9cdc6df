"""A paged KV cache that plugs into transformers models through `Cache.update` and `AttentionInterface`.

Each layer's keys and values live in one pool tensor of `num_blocks * block_size` slots; a row's tokens are found
through its block table (see `block_manager.py`). Before every forward the runner asks the cache for a `StepPlan`:
where each new token is written, which slots make up each row's context, and each query's position. The model's
attention modules call `update(...)`, which writes the new keys/values and gathers each row's context; our
registered attention function then masks by the plan (causal per row, sliding windows when the layer has one).

Rows are right-aligned inside a step: row i's `n_i` new tokens occupy the last `n_i` of the `q` query columns, so the
last column always holds every row's newest token. Padding columns write to a scratch slot no row ever reads.

With the triton kernel backend (CUDA by default, see `hf_specdec.kernels`), `update` only writes and the attention
function reads the pools in place through the block tables; with the torch backend `update` gathers each row's
context and the attention is masked SDPA. Both follow `hf_specdec.kernels.paged_attention.reference`.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

import torch

from ..errors import torchao_skew_messages_dropped

with torchao_skew_messages_dropped():  # the first import of transformers' model code (see there)
    from transformers import AttentionInterface
from transformers.cache_utils import Cache  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from .block_manager import BlockManager
from ..kernels._backend import resolve_backend
from ..kernels.paged_attention.reference import (
    TreeMask, attend, attention_mask, context_slots, slots_of, tree_attention_mask,
)
from ..errors import UnsupportedModelError

ATTENTION_NAME = "hf_specdec_paged"
PLAN_KWARG = "hf_specdec_plan"
SCRATCH_SLOT = 0  # slot 0 of reserved block 0
# The plan of the forward running now, for models whose decoder layers drop the keyword arguments on their way to
# the attention modules (Nemotron): the attention function finds the plan here when its kwargs lack it.
_ACTIVE_PLAN: ContextVar[StepPlan | None] = ContextVar("hf_specdec_active_plan", default=None)


@dataclass
class TreeAttention:
    """A step that feeds draft-tree nodes. Each row's context ends with a tree region: entries written from storage
    index `region_start` on (this step's and any earlier step's not yet rolled back), one per tree node, where
    several nodes share a position. A query attends to the committed context and to the region entries its mask
    allows (its ancestors and itself).

    Attributes:
        region_start: `[rows]` storage index of each row's first region entry.
        query_positions: `[rows, q]` position of each query (rotary embeddings), which differs from its storage
            index inside the region.
        region_mask: `[rows, q, region]` bool, True where query j may see region entry e.
        region_positions: `[rows, region]` position of each region entry (sliding windows compare positions).
    """

    region_start: torch.Tensor
    query_positions: torch.Tensor
    region_mask: torch.Tensor
    region_positions: torch.Tensor


@dataclass
class PackedLayout:
    """A step whose rows' tokens go through the model as one stream `[1, T]` (T: the rows' token counts summed),
    so a row with 1 token does not pay for another's 8 in every linear layer. Attention unpacks each layer's
    queries into the padded `[rows, q]` layout (PyTorch path) or reads them in place (`cu_query`, Triton kernel).

    Attributes:
        pack_index: `[T]` index into the flattened padded `[rows * q]` layout of each packed token.
        unpack_index: `[rows * q]` packed index of each padded position; padding points at its row's first token.
        cu_query: `[rows + 1]` offset of each row's first token in the stream.
        positions: `[1, T]` position of each packed token (the model's `position_ids`).
    """

    pack_index: torch.Tensor
    unpack_index: torch.Tensor
    cu_query: torch.Tensor
    positions: torch.Tensor
    #: The PyTorch path's attention in groups of rows, each padded to its own width (a newcomer's prompt beside rows
    #: verifying a few drafts), `QueryGroup`s; `None`: one group, every row padded to `q`.
    groups: tuple[QueryGroup, ...] | None = None
    #: `[T]` each token's row, when the PyTorch path's attention gives every token a row of its own (one query over
    #: its row's context up to itself: `token_rows_pay`); `None` otherwise.
    token_rows: torch.Tensor | None = None

    @classmethod
    def build(cls, counts: torch.Tensor, q: int, total: int, query_positions: torch.Tensor,
              host_counts: list[int] | None = None, split: tuple | None = None,
              token_rows: bool = False) -> PackedLayout:
        """`counts` `[rows]` tokens per row (each at least 1), right-aligned in a width of `q`; `total` their sum
        (known on the host, so nothing here waits for the device). `host_counts`, the same counts on the host, with
        `split`, what `query_groups` made of them, asks for the PyTorch path's attention groups; `token_rows` for a
        row per token instead."""
        rows = counts.shape[0]
        device = counts.device
        cu_query = torch.zeros(rows + 1, dtype=torch.long, device=device)
        cu_query[1:] = counts.cumsum(0)
        row_of, within = _ragged(counts, total)
        pack_index = row_of * q + (q - counts)[row_of] + within
        offset = torch.arange(q, device=device)[None, :] - (q - counts)[:, None]
        unpack_index = (cu_query[:-1, None] + offset.clamp(min=0)).reshape(-1)
        groups = None
        if split is not None and host_counts is not None and not token_rows:
            short, long_rows, long = split
            short_kept = sum(c for c in host_counts if c <= short)
            groups = (QueryGroup.build(None, short, counts, cu_query, short_kept),
                      QueryGroup.build(torch.tensor(long_rows, device=device), long, counts, cu_query,
                                       total - short_kept))
        return cls(pack_index, unpack_index, cu_query, query_positions.reshape(-1)[pack_index][None], groups,
                   row_of if token_rows else None)

    def to(self, device) -> PackedLayout:
        groups = None if self.groups is None else tuple(g.to(device) for g in self.groups)
        return PackedLayout(*(t.to(device) for t in (self.pack_index, self.unpack_index, self.cu_query,
                                                     self.positions)), groups,
                            None if self.token_rows is None else self.token_rows.to(device))

    def pad(self, packed: torch.Tensor, rows: int) -> torch.Tensor:
        """A packed query `[1, heads, T, dim]` to the padded `[rows, heads, q, dim]` (padding repeats each row's first
        query)."""
        heads, _, dim = packed.shape[1:]
        return packed[0].index_select(1, self.unpack_index).view(heads, rows, -1, dim).transpose(0, 1)

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """`[rows, q, *rest]` to `[1, T, *rest]`."""
        return padded.flatten(0, 1).index_select(0, self.pack_index)[None]


@dataclass
class QueryGroup:
    """Rows whose queries attend together, padded to `width` (right-aligned), gathered from and scattered back to the
    packed stream.

    Attributes:
        rows: `[n]` the rows, or `None` for every row (their keys, values and mask are then used as they are).
        width: the group's padded query width.
        gather: `[n * width]` stream index of each padded position (padding repeats a row's first token).
        real: positions in that padded layout whose output is kept.
        targets: `[len(real)]` their stream indices.
    """

    rows: torch.Tensor | None
    width: int
    gather: torch.Tensor
    real: torch.Tensor
    targets: torch.Tensor

    @classmethod
    def build(cls, rows: torch.Tensor | None, width: int, counts: torch.Tensor, cu_query: torch.Tensor,
              num_kept: int) -> QueryGroup:
        """Every row's last `width` tokens. The group of all rows keeps the outputs of the rows that fit in `width`
        only (the others' come from their own group); `num_kept`: the tokens of the rows whose outputs it keeps."""
        own = counts if rows is None else counts[rows]
        starts = cu_query[:-1] if rows is None else cu_query[:-1][rows]
        fed = own.clamp(max=width)
        offset = torch.arange(width, device=counts.device)[None, :] - (width - fed)[:, None]
        gather = (starts[:, None] + (own - fed)[:, None] + offset.clamp(min=0)).reshape(-1)
        kept = torch.where(own <= width, own, 0)
        row_of, within = _ragged(kept, num_kept)
        real = row_of * width + (width - kept)[row_of] + within
        return cls(rows, width, gather, real, starts[row_of] + within)

    def to(self, device) -> QueryGroup:
        return QueryGroup(None if self.rows is None else self.rows.to(device), self.width,
                          *(t.to(device) for t in (self.gather, self.real, self.targets)))


def _ragged(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `total` (= `counts.sum()`, known on the host) tokens of rows holding `counts` each, in row order: each
    token's row and its index within the row."""
    rows = torch.arange(counts.shape[0], device=counts.device)
    row_of = torch.repeat_interleave(rows, counts, output_size=total)
    first = counts.cumsum(0) - counts
    return row_of, torch.arange(total, device=counts.device) - first[row_of]


def query_groups(counts: list[int]) -> tuple[int, list[int], int] | None:
    """Where feeding rows' queries to attention in two groups saves a quarter of the padded queries and at least 12
    (a newcomer's prompt beside rows feeding a token or a few drafts, or a row verifying drafts beside many rows
    feeding one token): `(short, long_rows, long)`, every row's last `short` tokens in one group, the rows longer
    than that in another of width `long`. `None` where one padded group is as good. A second group costs its own
    gathers and attention call per layer; one row of 20 feeding 2 tokens padded every row to 2 queries, and that
    attention took 27-35 ms against 15 over SmolLM2's 30 layers at 256 cached tokens (2-core CPU,
    `benchmarks/ragged_attention.py`). On whole forwards
    (`benchmarks/query_groups.py`, docs/benchmarks.md) two groups were 6-18% faster at 20-30 rows, between 4% faster
    and 7% slower at 8 and up to 18% slower at 4, where this rule keeps one."""
    # every row at the cut (the rows past it again, at the longest): their last `cut` tokens in one group
    whole, best, short = _two_groups(counts, every_row_in_first=True)
    if short is None or whole - best < max(whole / 4, 12):
        return None
    return short, [i for i, c in enumerate(counts) if c > short], max(counts)


def _two_groups(values: list[int], every_row_in_first: bool) -> tuple[int, int, int | None]:
    """Where to cut rows padded to `values` (query widths, context lengths) into two groups, each padded to its own
    longest: `(one group's padded area, the best two groups' area, the cut)`, the cut `None` where no split helps.
    The first group holds the rows up to the cut, or (`every_row_in_first`) every row's last `cut` entries."""
    widths = sorted(values)
    rows, longest = len(widths), widths[-1]
    whole = rows * longest
    best, cut = whole, None
    for n in range(1, rows):  # the first group padded to the n-th shortest, the rows past it to the longest
        if widths[n] == widths[n - 1]:
            continue
        cost = (rows if every_row_in_first else n) * widths[n - 1] + (rows - n) * longest
        if cost < best:
            best, cut = cost, widths[n - 1]
    return whole, best, cut


# Token rows gather their rows' contexts again for the tokens beyond one per row; where one padded group would have
# gathered each context once, they are taken only while those extra contexts hold at most this many key elements
# (tokens x kv heads x head dim) per layer: about what the padded step's extra work costs (a second group copies its
# rows' contexts anyway).
TOKEN_ROWS_EXTRA = 1 << 18


def token_rows_pay(counts: list[int], num_context: int = 0, kv_width: int = 0, split=...) -> bool:
    """Whether the PyTorch path's attention should give every token of a packed step a row of its own, one query
    over its row's context up to itself (the context gathered once per token), instead of padding rows to a common
    query width or splitting them into two groups (`query_groups`): where a few rows verify a few drafts beside rows
    feeding one token, at most a quarter more tokens than rows (at most 2 more below 8 rows), and, where the rows
    would otherwise attend as one padded group, the extra contexts are small (`TOKEN_ROWS_EXTRA`; `num_context`
    cached tokens a row, `kv_width` kv heads x head dim, 0 when not known yet; `split`: `query_groups(counts)`
    when the caller has it). One row of 12 verifying 2 drafts took
    a second attention group, whose own gathers, selections and attention call in every layer cost 9-10 ms of a
    120 ms forward of SmolLM2 on a 2-core CPU (`benchmarks/draft_pricing.py --profile 12`); as token rows it costs
    10 ms less (`benchmarks/token_rows.py`). With 2-4 rows of long contexts one padded group is cheaper: token rows
    there would gather up to twice the keys and values."""
    rows, total = len(counts), sum(counts)
    if not rows < total <= rows + max(2, rows // 4):
        return False
    if split is ...:
        split = query_groups(counts)
    return split is not None or 0 < (total - rows) * num_context * kv_width <= TOKEN_ROWS_EXTRA


@dataclass
class ContextGroup:
    """Rows whose contexts the PyTorch path gathers and attends to together, padded to the longest of them only
    (`context_groups`).

    Attributes:
        rows: `[n]` the rows (indices into the step's rows, in order).
        slots: `[n, num_context]` flat pool slots of each row's positions `0 .. num_context - 1` (scratch past its
            length).
        view: `(first slot, slots per row)` where the rows lie in consecutive regions of the pool (read in place, as
            `StepPlan.context_view`), else `None`.
    """

    rows: torch.Tensor
    slots: torch.Tensor
    view: tuple[int, int] | None = None
    _masks: dict = field(default_factory=dict)

    def to(self, device) -> ContextGroup:
        return ContextGroup(self.rows.to(device), self.slots.to(device), self.view)

    def mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The step's mask `[rows, 1, q, num_context]` for this group's rows and context, made once per step (every
        layer with the same window reads it)."""
        key = id(mask)
        if key not in self._masks:
            self._masks[key] = (mask, mask.index_select(0, self.rows)[..., :self.slots.shape[1]])
        return self._masks[key][1]


# A second context group costs, in every layer, its own gather, selections and attention call; padding costs about
# 7 us per context token (summed over rows) of a SmolLM2 forward on a 2-core CPU. By `benchmarks/context_groups.py`
# two groups were 1.16-8.4x faster where they saved 3400-58000 padded tokens, and within noise of one group (0.95-1.08x)
# where they saved 1200-1750.
CONTEXT_SPLIT_MIN = 2048


def context_groups(context_lens: list[int], min_saved: int | None = None,
                   min_fraction: float = 0.25) -> tuple[list[int], int] | None:
    """Where gathering the rows' contexts in two groups, each padded to its own longest, saves a quarter of the
    padded context and at least `CONTEXT_SPLIT_MIN` tokens (a long prompt's row beside rows of short chats; rows all
    about as long stay one group): `(short_rows, short_context)`, the rows whose contexts fit in `short_context`
    (the others form the second group). `None` where one padded group is as good. `min_saved=0, min_fraction=0`:
    two groups wherever the lengths differ (the model's trial, `compat._groups_exactly`)."""
    min_saved = CONTEXT_SPLIT_MIN if min_saved is None else min_saved
    whole, best, cut = _two_groups(context_lens, every_row_in_first=False)
    if cut is None or whole - best < max(whole * min_fraction, min_saved):
        return None
    return [i for i, c in enumerate(context_lens) if c <= cut], cut


@dataclass
class StepPlan:
    """Where one forward's tokens go and what each query may see.

    Attributes:
        write_slots: `[rows * q]` flat pool slot of every query token; padding goes to the scratch slot.
        block_tables: `[rows, max_blocks]` each row's blocks.
        block_size: tokens per block.
        query_positions: `[rows, q]` position of each query token in its row (padding repeats the first real one).
        context_lens: `[rows]` tokens each row holds once this step's tokens are written.
        backend: `"torch"` (gather, then SDPA) or `"triton"` (the paged attention kernel reads the pool in place).
        context_slots: `[rows, num_context]` flat pool slots of each row's context, padded with the scratch slot
            (torch backend only; `None` with triton); with token rows (`PackedLayout.token_rows`) one row per token,
            its row's context.
    """

    write_slots: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    query_positions: torch.Tensor
    context_lens: torch.Tensor
    backend: str = "torch"
    context_slots: torch.Tensor | None = None
    tree: TreeAttention | None = None
    query_slots: torch.Tensor | None = None  # [rows, q] storage index of each query, when a tree makes it differ
    packed: PackedLayout | None = None  # the model sees one stream of every row's tokens (no padding)
    # (first slot, slots per row) when the rows' storage lies in equal consecutive regions of the pool
    # (`BlockManager.give_regions`): their contexts are then one strided view of each pool, not a gather.
    context_view: tuple[int, int] | None = None
    # The PyTorch path's contexts in two groups of rows, each padded to its own longest (`context_groups`): `update`
    # then returns the pools, and attention gathers per group. `None`: one gather, every row padded to the longest.
    context_groups: tuple[ContextGroup, ...] | None = None
    _masks: dict = field(default_factory=dict)
    _kernel_tree: TreeMask | None = None
    # Layers that wrote keys/values and layers that attended through our function in this step: they differ when a
    # model computes some attention itself, which the runner then refuses (see `ModelRunner.forward`).
    num_updates: int = 0
    num_attended: int = 0
    # Copies of this plan on the other devices a model's layers run on (accelerate's device_map), made once per step.
    _copies: dict = field(default_factory=dict)

    def on(self, device: torch.device) -> StepPlan:
        """This plan with its tensors on `device` (itself when they are there already). Layer counts stay here."""
        if self.block_tables.device == device:
            return self
        if device not in self._copies:
            moved = {f: getattr(self, f).to(device) for f in ("write_slots", "block_tables", "query_positions",
                                                               "context_lens", "context_slots", "query_slots")
                     if getattr(self, f) is not None}
            if self.packed is not None:
                moved["packed"] = self.packed.to(device)
            if self.context_groups is not None:
                moved["context_groups"] = tuple(g.to(device) for g in self.context_groups)
            tree = self.tree and TreeAttention(*(t.to(device) for t in (
                self.tree.region_start, self.tree.query_positions, self.tree.region_mask, self.tree.region_positions)))
            if self.backend == "triton" and device.type != "cuda":  # a layer on the host: gather, then SDPA
                tables, lens = moved["block_tables"], moved["context_lens"]
                moved.update(backend="torch", context_slots=context_slots(tables, lens, int(lens.max()),
                                                                          self.block_size, pad_slot=SCRATCH_SLOT))
            self._copies[device] = replace(self, **moved, tree=tree, _masks={}, _kernel_tree=None, _copies={})
        return self._copies[device]

    def kernel_tree(self) -> TreeMask | None:
        """The tree step's masks as the triton kernel takes them, built once per step (every layer reads them)."""
        if self.tree is None:
            return None
        if self._kernel_tree is None:
            tree = self.tree
            self._kernel_tree = TreeMask(self.query_slots, tree.region_start, tree.region_mask.to(torch.int8),
                                         tree.region_positions)
        return self._kernel_tree

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """`[rows, 1, q, num_context]` boolean mask: True where a query may attend (torch backend); with token rows
        `[tokens, 1, 1, num_context]`."""
        key = sliding_window or 0
        if key not in self._masks:
            num_context = self.context_slots.shape[1]
            if self.packed is not None and self.packed.token_rows is not None:  # `[tokens, 1, 1, num_context]`
                self._masks[key] = attention_mask(self.packed.positions[0][:, None], num_context, sliding_window)
            elif self.tree is None:
                self._masks[key] = attention_mask(self.query_positions, num_context, sliding_window)
            else:
                tree = self.tree
                self._masks[key] = tree_attention_mask(self.query_slots, self.query_positions, num_context,
                                                       tree.region_start, tree.region_mask, tree.region_positions,
                                                       sliding_window)
        return self._masks[key]


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

    # --- sequences -----------------------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        self.manager.add_sequence(seq_id)

    def length(self, seq_id: int) -> int:
        return self.manager.length(seq_id)

    def rollback(self, seq_id: int, length: int) -> None:
        self.manager.rollback(seq_id, length)

    def free(self, seq_id: int) -> None:
        self.manager.free(seq_id)

    def reserve(self, seq_ids: list[int], num_tokens: list[int]) -> list[int]:
        """Makes room for `num_tokens[i]` more tokens in each row, growing the pool if needed.

        Returns the position of each row's first new token.
        """
        missing = sum(self.manager.blocks_missing(s, n) for s, n in zip(seq_ids, num_tokens))
        if missing > self.manager.num_free_blocks:
            self._grow(missing - self.manager.num_free_blocks)
        return [self.manager.append(s, n) for s, n in zip(seq_ids, num_tokens)]

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
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
        starts_t = torch.tensor(starts, dtype=torch.long, device=device)
        counts_t = torch.tensor(num_tokens, dtype=torch.long, device=device)
        context_lens = starts_t + counts_t
        self._past_length = max(starts)

        offset = torch.arange(q, device=device)[None, :] - (q - counts_t)[:, None]  # [rows, q]; < 0 is padding
        is_token = offset >= 0
        query_positions = starts_t[:, None] + offset.clamp(min=0)

        write_slots = torch.where(is_token, slots_of(block_tables, query_positions, bs), SCRATCH_SLOT)
        backend = resolve_backend(self.kernel_backend, device)
        slots = view = None
        if backend == "torch":
            num_context = int(max(s + n for s, n in zip(starts, num_tokens)))
            slots = context_slots(block_tables, context_lens, num_context, bs, pad_slot=SCRATCH_SLOT)
            run = self.manager.contiguous_run(seq_ids)
            if run is not None and num_context <= run[1] * bs:
                view = (run[0] * bs, run[1] * bs)
        if tree is None:
            # The attention groups serve the gather-then-SDPA path only (the kernel reads each row's queries in place);
            # so do token rows, which need the gather (rows read in place keep their groups).
            split = query_groups(num_tokens) if packed and backend == "torch" else None
            pool = next(iter(self.key_pools.values()), None)
            by_token = (packed and backend == "torch" and view is None and self.token_rows is not False
                        and (self.token_rows or token_rows_pay(num_tokens, slots.shape[1],
                                                               0 if pool is None else pool[0].numel(), split)))
            layout = PackedLayout.build(counts_t, q, sum(num_tokens), query_positions,
                                        list(num_tokens) if backend == "torch" else None, split,
                                        by_token) if packed else None
            write_slots = write_slots.reshape(-1)
            if layout is not None:
                write_slots = write_slots.index_select(0, layout.pack_index)
            if by_token:  # each token's row's context, its own mask hiding what follows it
                slots = slots.index_select(0, layout.token_rows)
            groups = None
            if (backend == "torch" and view is None and not by_token and split is None and self.context_split
                    is not False and os.environ.get("HF_SPECDEC_CONTEXT_GROUPS", "1") != "0"):
                groups = self._context_groups(seq_ids, [s + n for s, n in zip(starts, num_tokens)], slots, device)
            self.plan = StepPlan(write_slots, block_tables, bs, query_positions, context_lens, backend, slots,
                                 packed=layout, context_view=view, context_groups=groups)
        else:
            self.plan = StepPlan(write_slots.reshape(-1), block_tables, bs, tree.query_positions, context_lens,
                                 backend, slots, tree, query_positions, context_view=view)
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
        if layer_idx not in self.key_pools:
            size = self.manager.num_blocks * self.block_size
            self.key_pools[layer_idx] = key_states.new_zeros((size, heads, dim))
            self.value_pools[layer_idx] = value_states.new_zeros((size, heads, value_states.shape[-1]))
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
        """Makes `plan` the one attention finds when a model does not pass it down (see `_ACTIVE_PLAN`)."""
        token = _ACTIVE_PLAN.set(plan)
        try:
            yield
        finally:
            _ACTIVE_PLAN.reset(token)

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
    plan: StepPlan | None = kwargs.get(PLAN_KWARG) or _ACTIVE_PLAN.get()
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
