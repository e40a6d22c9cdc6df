"""A contiguous KV cache whose rows say through a 2D attention mask which of its columns they hold.

For models that attend by their own code rather than transformers' attention interface (Falcon, Bloom, GPT-Neo,
MPT, XGLM, ...), our paged attention cannot take over their attention; what they all honour is a cache object's
`update` and a 2D `attention_mask` of `[rows, cached + new]` columns, from which they build their causal mask (and
Bloom and Falcon their ALiBi positions, by counting unmasked columns). `MaskedKVCache` is such a cache, shared by
the rows of a batch: every forward appends the same `q` columns to every layer, and each row's state lives in a
boolean `[rows, columns]` mask of the columns it holds.

- A forward writes row i's `n_i` tokens left-aligned into the new columns; the other `q - n_i` are holes (mask 0).
- Rolling a row back unmasks its columns past the kept tokens: O(1), nothing is copied, and the rollbacks of a step
  are applied as one tensor op before the next forward. Rows of different lengths differ only in where their holes
  are; positions are given explicitly (or, for ALiBi models, counted from the mask, which skips holes).
- Holes cost attention work and memory, so the cache is compacted (each row's held columns gathered, right-aligned,
  into a narrower cache; freed rows dropped) once the columns compaction would remove exceed `max_hole_fraction`
  of the width, or the width would pass `max_width` (models that slice position-indexed buffers by the cache
  width). Models whose attention depends on the distance between columns (MPT's ALiBi, sliding windows) need every
  row contiguous: `max_hole_fraction=0` compacts before every forward in which a fed row has a hole, so each row is
  left padding then its tokens, as in transformers' own left-padded `generate`.

The host keeps, per row, its length and the column spans it wrote since the last compaction, so no step reads the
device to plan the next one.
"""

from __future__ import annotations

import torch

from ..errors import torchao_skew_messages_dropped

with torchao_skew_messages_dropped():  # the first import of transformers' model code (see there)
    from transformers.cache_utils import Cache


class _Accounting:
    """What the scheduler reads of a paged cache's block manager, in blocks of `block_size` held cells."""

    def __init__(self, cache: MaskedKVCache, block_size: int):
        self._cache = cache
        self.block_size = block_size
        self.max_num_blocks = None

    @property
    def num_used_blocks(self) -> int:
        return -(-self._cache.num_live_rows * self._cache.width // self.block_size)


class MaskedKVCache(Cache):
    """Keys and values of a batch of rows in one `[rows, heads, columns, head_dim]` tensor per layer, with per-row
    rollback through a column mask.

    Args:
        device: where the mask lives (the model's input device).
        block_size (`int`): the unit in which `manager.num_used_blocks` counts held cells.
        max_hole_fraction (`float`): compact once the columns compaction would remove exceed this fraction of the
            width; `0` keeps every fed row contiguous (see the module docstring).
        max_width (`int`, *optional*): the most columns a forward may see (the model's position-indexed buffers).
    """

    is_compileable = False

    def __init__(self, device, block_size: int = 16, max_hole_fraction: float = 0.5, max_width: int | None = None):
        self.layers = []  # transformers' mask helpers iterate these: none means one full-attention kind
        self.device = torch.device(device)
        self.max_hole_fraction = max_hole_fraction
        self.max_width = max_width
        self.manager = _Accounting(self, block_size)
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [rows, heads, capacity, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self.valid = torch.zeros((0, 0), dtype=torch.bool, device=self.device)  # [rows, capacity]
        self.width = 0  # columns written so far (every row's)
        self.row_of: dict[int, int] = {}  # caller's seq id -> storage row
        self.lengths: list[int] = []  # tokens each storage row holds
        self.spans: list[list[tuple[int, int]]] = []  # per storage row: (first column, tokens) of each write
        self._free_rows: list[int] = []
        self._cuts: dict[int, int] = {}  # storage row -> first column to unmask (rollbacks not yet applied)
        self._step: tuple | None = None  # (rows index or None for all rows, width before the step, q)
        self._layer_width: dict[int, int] = {}
        self.num_updates = 0
        self.num_compactions = 0

    # --- sequences -----------------------------------------------------------------------------------------------
    @property
    def num_live_rows(self) -> int:
        return len(self.row_of)

    def add_sequence(self, seq_id: int) -> None:
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            row = len(self.lengths)
            self.lengths.append(0)
            self.spans.append([])
        self.row_of[seq_id] = row
        self.lengths[row], self.spans[row] = 0, []
        self._cuts[row] = 0  # whatever an earlier occupant left is unmasked

    def length(self, seq_id: int) -> int:
        return self.lengths[self.row_of[seq_id]]

    def rollback(self, seq_id: int, length: int) -> None:
        """Forgets row `seq_id`'s tokens past `length`: their columns become holes at the next forward."""
        row = self.row_of[seq_id]
        if length >= self.lengths[row]:
            return
        spans, kept = self.spans[row], 0
        for i, (first, count) in enumerate(spans):
            if kept + count >= length:
                cut = first + (length - kept)
                self.spans[row] = spans[:i] + ([(first, length - kept)] if length > kept else [])
                break
            kept += count
        self.lengths[row] = length
        self._cuts[row] = min(self._cuts.get(row, cut), cut)

    def free(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id)
        self._cuts[row] = 0
        self.lengths[row], self.spans[row] = 0, []
        self._free_rows.append(row)

    # --- one forward -----------------------------------------------------------------------------------------------
    def begin_step(self, seq_ids: list[int], num_tokens: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Prepares a forward in which row `seq_ids[i]` appends `num_tokens[i]` tokens (left-aligned in `q =
        max(num_tokens)` new columns). Compacts first when due.

        Returns:
            The model's 2D `attention_mask` `[rows, width + q]` (1 where a row holds the column) and each row's length
            before the step (its first new token's position).
        """
        q = max(num_tokens)
        rows = [self.row_of[s] for s in seq_ids]
        if self._compaction_due(rows, q):
            self.compact()
            rows = [self.row_of[s] for s in seq_ids]
        self._apply_cuts()
        width = self.width
        self._reserve(width + q)
        rows_t = None if rows == list(range(len(self.lengths))) else torch.tensor(rows, device=self.device)
        counts = torch.tensor(num_tokens, device=self.device)
        new = torch.arange(q, device=self.device)[None, :] < counts[:, None]  # [rows, q]
        held = self.valid[:, :width] if rows_t is None else self.valid[rows_t, :width]
        if rows_t is None:
            self.valid[:, width:width + q] = new
        else:
            self.valid[rows_t, width:width + q] = new
        starts = [self.lengths[r] for r in rows]
        for row, n in zip(rows, num_tokens):
            self.spans[row].append((width, n))
            self.lengths[row] += n
        self._step = (rows_t, width, q)
        self._layer_width = {}
        return torch.cat([held, new], dim=1).long(), starts

    def end_step(self) -> None:
        self.width = self._step[1] + self._step[2]
        self._step = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Writes this step's keys/values `[rows, heads, q, head_dim]` and returns the rows' whole cache
        `[rows, heads, width + q, head_dim]` (the attention mask hides what a row does not hold)."""
        if self._step is None:
            raise RuntimeError("MaskedKVCache.update called outside a step; use hf_specdec's dense runner")
        rows_t, width, q = self._step
        self.num_updates += 1
        end = width + q
        keys, values = self._layer_storage(layer_idx, key_states, value_states, end)
        if rows_t is None:
            keys[:, :, width:end] = key_states
            values[:, :, width:end] = value_states
            out = keys[:, :, :end], values[:, :, :end]
        else:
            rows_t = rows_t.to(keys.device)
            keys[rows_t, :, width:end] = key_states
            values[rows_t, :, width:end] = value_states
            out = keys[:, :, :end].index_select(0, rows_t), values[:, :, :end].index_select(0, rows_t)
        self._layer_width[layer_idx] = end
        return out

    def _layer_storage(self, layer, key_states, value_states, end):
        rows, capacity = len(self.lengths), self.valid.shape[1]
        keys = self.keys.get(layer)
        if keys is None or keys.shape[0] < rows or keys.shape[2] < end:
            heads = key_states.shape[1]
            fresh_keys = key_states.new_zeros((rows, heads, capacity, key_states.shape[-1]))
            fresh_values = value_states.new_zeros((rows, value_states.shape[1], capacity, value_states.shape[-1]))
            if keys is not None:  # grown: more rows or more columns
                old_values = self.values[layer]
                fresh_keys[:keys.shape[0], :, :keys.shape[2]] = keys
                fresh_values[:old_values.shape[0], :, :old_values.shape[2]] = old_values
            self.keys[layer], self.values[layer] = fresh_keys, fresh_values
        return self.keys[layer], self.values[layer]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns cached before this step, or after it in a layer this step already wrote (as `DynamicCache`)."""
        if self._step is not None and layer_idx in self._layer_width:
            return self._layer_width[layer_idx]
        return self._step[1] if self._step is not None else self.width

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    # --- holes -------------------------------------------------------------------------------------------------------
    def _compaction_due(self, rows: list[int], q: int) -> bool:
        if self.width == 0:
            return False
        longest = max((self.lengths[r] for r in self.row_of.values()), default=0)
        if self.max_width is not None and self.width + q > self.max_width:
            return True
        if self.max_hole_fraction > 0:
            return (self.width - longest) > self.max_hole_fraction * self.width or len(self._free_rows) > len(
                self.row_of)
        # Contiguous rows: each fed row must end at the last column and hold every column from its first.
        for row in rows:
            spans = self.spans[row]
            if spans and (spans[-1][0] + spans[-1][1] != self.width or any(
                    a + n != b for (a, n), (b, _) in zip(spans, spans[1:]))):
                return True
        return False

    def _apply_cuts(self) -> None:
        cuts = {row: cut for row, cut in self._cuts.items() if row < self.valid.shape[0]}  # later rows: unmasked
        self._cuts.clear()
        if not cuts:
            return
        rows = torch.tensor(list(cuts), device=self.device)
        cuts = torch.tensor(list(cuts.values()), device=self.device)
        columns = torch.arange(self.valid.shape[1], device=self.device)
        self.valid[rows] &= columns[None, :] < cuts[:, None]

    def _reserve(self, end: int) -> None:
        rows, capacity = len(self.lengths), self.valid.shape[1]
        if rows > self.valid.shape[0] or end > capacity:
            capacity = max(capacity, end) if end <= capacity else max(2 * capacity, end + 16)
            grown = torch.zeros((rows, capacity), dtype=torch.bool, device=self.device)
            grown[:self.valid.shape[0], :self.valid.shape[1]] = self.valid
            self.valid = grown

    def _grow_rows(self) -> None:
        """Storage for rows `add_sequence` took since the last forward (they hold nothing yet): a compaction before
        the next forward's `_reserve` gathers them too."""
        rows = len(self.lengths)
        self._reserve(self.width)
        for store in (self.keys, self.values):
            for layer, old in list(store.items()):
                if old.shape[0] < rows:
                    grown = old.new_zeros((rows, *old.shape[1:]))
                    grown[:old.shape[0]] = old
                    store[layer] = grown

    def compact(self) -> None:
        """Gathers each live row's held columns, right-aligned, into a cache as wide as the longest row; freed rows
        are dropped and the others keep their order."""
        self._grow_rows()
        self._apply_cuts()
        live = sorted(self.row_of.items(), key=lambda item: item[1])  # (seq id, storage row)
        old_rows = [row for _, row in live]
        lengths = [self.lengths[r] for r in old_rows]
        width = max(lengths, default=0)
        capacity = max(width + 16, self.valid.shape[1] // 2)
        device = self.device
        rows_t = torch.tensor(old_rows, dtype=torch.long, device=device)
        held = self.valid[rows_t, :self.width]  # [live, width]
        columns = torch.arange(self.width, device=device)
        # Held columns first, in order, then the rest: the i-th held column of a row is `order[row, i]`.
        order = torch.where(held, columns, self.width + columns).argsort(dim=1)
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
        index = torch.arange(width, device=device)[None, :] - (width - lengths_t)[:, None]  # < 0: left padding
        source = order.gather(1, index.clamp(min=0)) if self.width else index.clamp(min=0)
        valid = torch.zeros((len(live), capacity), dtype=torch.bool, device=device)
        valid[:, :width] = index >= 0
        for layer in list(self.keys):
            for store in (self.keys, self.values):
                old = store[layer]
                picked = old.index_select(0, rows_t.to(old.device))[:, :, :self.width]
                src = source.to(old.device)[:, None, :, None].expand(-1, old.shape[1], -1, old.shape[3])
                fresh = old.new_zeros((len(live), old.shape[1], capacity, old.shape[3]))
                fresh[:, :, :width] = picked.gather(2, src)
                store[layer] = fresh
        self.valid, self.width = valid, width
        self.row_of = {seq_id: i for i, (seq_id, _) in enumerate(live)}
        self.lengths = lengths
        self.spans = [[(width - n, n)] if n else [] for n in lengths]
        self._free_rows = []
        self.num_compactions += 1

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for store in (self.keys, self.values) for t in store.values())
