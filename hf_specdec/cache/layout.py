"""The layout of one forward over a `PagedKVCache`: where each new token is written, which pool slots make up each
row's context, each query's position and what it may see (`StepPlan`, built by `PagedKVCache.plan_step`).

Rows are right-aligned inside a step: row i's `n_i` new tokens occupy the last `n_i` of the `q` query columns, so the
last column always holds every row's newest token. Padding columns write to a scratch slot no row ever reads
(`SCRATCH_SLOT`). Besides the padded `[rows, q]` layout a step may feed draft-tree nodes (`TreeAttention`), feed the
rows' tokens to the model as one stream (`PackedLayout`, with a row per token where that pays: `token_rows_pay`),
and let the PyTorch attention path pad rows in two groups of queries (`QueryGroup`, `query_groups`) or of contexts
(`ContextGroup`, `context_groups`) instead of one. Plain torch: nothing here knows transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..kernels.paged_attention.reference import TreeMask, attention_mask, context_slots, tree_attention_mask

SCRATCH_SLOT = 0  # slot 0 of reserved block 0


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
    def build(cls, counts: list[int], q: int, starts: list[int], device, split: tuple | None = None,
              token_rows: bool = False) -> PackedLayout:
        """`counts` tokens per row (each at least 1), right-aligned in a width of `q`, row i's first at position
        `starts[i]`, all on the host: the indices are computed there and reach `device` in one copy (on a GPU, one
        transfer instead of some fifty small kernels a step). `split`, what `query_groups` made of the counts, asks
        for the PyTorch path's attention groups; `token_rows` for a row per token instead."""
        parts = cls.host_parts(counts, q, starts, split, token_rows)
        return cls.from_parts(host_to_device(parts, device), split, token_rows)

    @staticmethod
    def host_parts(counts: list[int], q: int, starts: list[int], split: tuple | None = None,
                   token_rows: bool = False) -> list[np.ndarray]:
        """`build`'s indices as host arrays, in the order `from_parts` reads them (`pack_index` first), for a caller
        that sends them to the device in one copy with arrays of its own."""
        c = np.asarray(counts, dtype=np.int64)
        cu_query = np.concatenate([[0], np.cumsum(c)])
        row_of, within = ragged(c)
        pack_index = row_of * q + (q - c)[row_of] + within
        offset = np.arange(q)[None, :] - (q - c)[:, None]
        unpack_index = (cu_query[:-1, None] + np.maximum(offset, 0)).reshape(-1)
        positions = np.asarray(starts, dtype=np.int64)[row_of] + within
        parts = [pack_index, unpack_index, cu_query, positions]
        if token_rows:
            parts.append(row_of)
        elif split is not None:
            short, long_rows, long = split
            parts += [*QueryGroup.indices(None, short, c, cu_query),
                      np.asarray(long_rows, dtype=np.int64), *QueryGroup.indices(long_rows, long, c, cu_query)]
        return parts

    @classmethod
    def from_parts(cls, flat: list[torch.Tensor], split: tuple | None = None, token_rows: bool = False
                   ) -> PackedLayout:
        """The layout from `host_parts`' arrays on the device (with the same `split` and `token_rows`)."""
        groups = None
        if split is not None and not token_rows:
            groups = (QueryGroup(None, split[0], *flat[4:7]), QueryGroup(flat[7], split[2], *flat[8:11]))
        return cls(flat[0], flat[1], flat[2], flat[3][None], groups, flat[4] if token_rows else None)

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

    @staticmethod
    def indices(rows: list[int] | None, width: int, counts: np.ndarray, cu_query: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(gather, real, targets)` for `rows` (None: every row) padded to `width`, every row's last `width` tokens,
        on the host. The group of all rows keeps the outputs of the rows that fit in `width` only (the others' come
        from their own group)."""
        own = counts if rows is None else counts[np.asarray(rows, dtype=np.int64)]
        starts = cu_query[:-1] if rows is None else cu_query[:-1][np.asarray(rows, dtype=np.int64)]
        fed = np.minimum(own, width)
        offset = np.arange(width)[None, :] - (width - fed)[:, None]
        gather = (starts[:, None] + (own - fed)[:, None] + np.maximum(offset, 0)).reshape(-1)
        kept = np.where(own <= width, own, 0)
        row_of, within = ragged(kept)
        real = row_of * width + (width - kept)[row_of] + within
        return gather, real, starts[row_of] + within

    def to(self, device) -> QueryGroup:
        return QueryGroup(None if self.rows is None else self.rows.to(device), self.width,
                          *(t.to(device) for t in (self.gather, self.real, self.targets)))


def host_to_device(parts: list[np.ndarray], device) -> list[torch.Tensor]:
    """Host integer arrays as int64 tensors on `device`, shaped as they are, in one copy: views of one buffer, each
    starting on a 64-byte boundary (kernels specialise on their pointers' alignment, and Triton compiles a variant of
    its own for a pointer that is not 16-byte aligned). On the host nothing is copied: the tensors share the arrays'
    memory (those the caller made for the step, not changed after)."""
    if torch.device(device).type == "cpu":
        return [torch.from_numpy(part if part.dtype == np.int64 and part.flags.writeable and part.flags.c_contiguous
                                 else np.array(part, dtype=np.int64, order="C")) for part in parts]
    sizes = [part.size for part in parts]
    padded = [-(-size // 8) * 8 for size in sizes]
    flat = np.zeros(sum(padded), dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(padded)[:-1]]).tolist()
    for part, offset, size in zip(parts, offsets, sizes):
        flat[offset:offset + size] = part.ravel()
    buffer = torch.from_numpy(flat).to(device)
    return [buffer[offset:offset + size].view(part.shape) for part, offset, size in zip(parts, offsets, sizes)]


def ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the tokens of rows holding `counts` each, in row order: each token's row and its index within the row
    (host arrays)."""
    row_of = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    return row_of, np.arange(len(row_of), dtype=np.int64) - first[row_of]


def query_groups(counts: list[int]) -> tuple[int, list[int], int] | None:
    """Where feeding rows' queries to attention in two groups saves a quarter of the padded queries and at least 12
    (a newcomer's prompt beside rows feeding a token or a few drafts, or a row verifying drafts beside many rows
    feeding one token): `(short, long_rows, long)`, every row's last `short` tokens in one group, the rows longer
    than that in another of width `long`. `None` where one padded group is as good. A second group costs its own
    gathers and attention call per layer; one row of 20 feeding 2 tokens padded every row to 2 queries, and that
    attention took 27-35 ms against 15 over SmolLM2's 30 layers at 256 cached tokens (2-core CPU). On whole forwards
    two groups were 6-18% faster at 20-30 rows, between 4% faster and 7% slower at 8 and up to 18% slower at 4, where
    this rule keeps one (docs/log/2026-11-28-benchmarks-history.md, "The server prices its own steps; rows weighed by
    work left; two attention groups for a lone verify (issue 25)")."""
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
    10 ms less (docs/log/2026-11-28-benchmarks-history.md, "A row per token for a step verifying a few drafts
    (issue 25)"). With 2-4 rows of long contexts one padded group is cheaper: token rows there would gather up to
    twice the keys and values."""
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
# 7 us per context token (summed over rows) of a SmolLM2 forward on a 2-core CPU. Two groups were 1.16-8.4x faster
# where they saved 3400-58000 padded tokens, and within noise of one group (0.95-1.08x) where they saved 1200-1750
# (docs/log/2026-11-28-benchmarks-history.md, "Chunked prefill and context groups (issue 25)").
CONTEXT_SPLIT_MIN = 2048


def context_groups(context_lens: list[int], min_saved: int | None = None,
                   min_fraction: float = 0.25) -> tuple[list[int], int] | None:
    """Where gathering the rows' contexts in two groups, each padded to its own longest, saves a quarter of the
    padded context and at least `CONTEXT_SPLIT_MIN` tokens (a long prompt's row beside rows of short chats; rows all
    about as long stay one group): `(short_rows, short_context)`, the rows whose contexts fit in `short_context`
    (the others form the second group). `None` where one padded group is as good. `min_saved=0, min_fraction=0`:
    two groups wherever the lengths differ (the model's trial, `support._groups_exactly`)."""
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
