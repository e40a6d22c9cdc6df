"""Fixed-size KV blocks: a free list and per-sequence block tables. Pure Python, no torch.

A sequence's tokens live in `ceil(length / block_size)` blocks listed in its block table. Appending allocates tail
blocks; rolling back (rejected drafts) moves the length pointer and frees the blocks past it, without copying.
Block 0..num_reserved-1 are never handed out: the cache uses them as a scratch slot for padded tokens.

A row id may instead be given a region up front (`give_regions`): consecutive blocks that every sequence of that id
starts with and keeps through rollback; freeing the sequence keeps the region for the id's next one (a server's
slot). Rows whose regions lie one after another, equally long, can be read as one strided view of the pool instead
of being gathered block by block (`contiguous_run`).
"""

from __future__ import annotations


class OutOfBlocksError(RuntimeError):
    """Raised when the pool cannot hold the tokens asked for and may not grow."""


class BlockManager:
    """Hands out KV blocks to sequences and takes them back.

    Args:
        num_blocks (`int`): blocks in the pool, reserved ones included.
        block_size (`int`): tokens per block.
        max_num_blocks (`int`, *optional*): the most blocks the pool may grow to; `None` for no limit.
        num_reserved (`int`): leading blocks kept out of circulation (scratch space for padding).
    """

    def __init__(self, num_blocks: int, block_size: int, max_num_blocks: int | None = None, num_reserved: int = 1):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks <= num_reserved:
            raise ValueError(f"num_blocks ({num_blocks}) must exceed num_reserved ({num_reserved})")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_reserved = num_reserved
        self.max_num_blocks = max_num_blocks
        # Popping from the end hands out low ids first, which keeps a small pool's live blocks dense.
        self._free: list[int] = list(range(num_blocks - 1, num_reserved - 1, -1))
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._regions: dict[int, list[int]] = {}  # id -> its region's blocks (kept through rollback and free)

    # --- queries -------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return sum(len(t) for t in self._tables.values())

    def sequences(self) -> list[int]:
        return list(self._tables)

    def length(self, seq_id: int) -> int:
        return self._lengths[seq_id]

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_region_blocks(self) -> int:
        return sum(len(r) for r in self._regions.values())

    def region(self, seq_id: int) -> list[int]:
        return self._regions.get(seq_id, [])

    def contiguous_run(self, seq_ids: list[int]) -> tuple[int, int] | None:
        """`(first block, blocks per sequence)` when the sequences, in this order, hold equal regions lying one
        right after another (each still exactly its region), else `None`."""
        region = self._regions.get(seq_ids[0]) if seq_ids else None
        if region is None:
            return None
        first, blocks = region[0], len(region)
        for i, seq_id in enumerate(seq_ids):
            table = self._tables[seq_id]
            if len(table) != blocks or table[0] != first + i * blocks or len(self._regions.get(seq_id, ())) != blocks:
                return None
        return first, blocks

    # --- mutations -----------------------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already exists")
        self._tables[seq_id] = list(self._regions.get(seq_id, ()))
        self._lengths[seq_id] = 0

    def grow(self, num_new_blocks: int) -> None:
        """Adds `num_new_blocks` fresh blocks to the pool (the cache grows its tensors to match)."""
        if self.max_num_blocks is not None and self.num_blocks + num_new_blocks > self.max_num_blocks:
            raise OutOfBlocksError(
                f"the KV pool would need {self.num_blocks + num_new_blocks} blocks but is capped at "
                f"{self.max_num_blocks}; raise max_num_blocks or lower the batch size / max_new_tokens"
            )
        new_ids = range(self.num_blocks + num_new_blocks - 1, self.num_blocks - 1, -1)
        self._free[:0] = new_ids  # behind the current free blocks, so those are used first
        self.num_blocks += num_new_blocks

    def give_regions(self, seq_ids: list[int], num_blocks: int) -> None:
        """Gives each of these ids `num_blocks` consecutive blocks, added to the pool after every existing block, one
        region after another in the order given. Every sequence of the id starts with its region and keeps it
        through rollback (past it, it takes blocks from the free list as usual); `free` keeps it for the next. An id
        may hold one region, and a live sequence of it must still be empty."""
        total = len(seq_ids) * num_blocks
        if self.max_num_blocks is not None and self.num_blocks + total > self.max_num_blocks:
            raise OutOfBlocksError(
                f"regions of {num_blocks} blocks for {len(seq_ids)} rows need {self.num_blocks + total} blocks "
                f"but the pool is capped at {self.max_num_blocks}"
            )
        for seq_id in seq_ids:
            if seq_id in self._regions or self._tables.get(seq_id, []) != []:
                raise ValueError(f"row {seq_id} already has a region or holds tokens; regions go to rows before they "
                                 "hold anything")
        first = self.num_blocks
        self.num_blocks += total
        for i, seq_id in enumerate(seq_ids):
            self._regions[seq_id] = list(range(first + i * num_blocks, first + (i + 1) * num_blocks))
            if seq_id in self._tables:
                self._tables[seq_id] = list(self._regions[seq_id])

    def blocks_missing(self, seq_id: int, num_tokens: int) -> int:
        """How many more blocks `append(seq_id, num_tokens)` would take from the free list."""
        return self.blocks_missing_total([seq_id], [num_tokens])

    def blocks_missing_total(self, seq_ids: list[int], num_tokens: list[int]) -> int:
        """`sum(blocks_missing(s, n))` over the rows, in one pass (a step's every row)."""
        bs, lengths, tables, total = self.block_size, self._lengths, self._tables, 0
        for seq_id, n in zip(seq_ids, num_tokens):
            need = -(-(lengths[seq_id] + n) // bs) - len(tables[seq_id])
            if need > 0:
                total += need
        return total

    def append(self, seq_id: int, num_tokens: int) -> int:
        """Reserves room for `num_tokens` more tokens; returns the position of the first one."""
        return self.append_many([seq_id], [num_tokens])[0]

    def append_many(self, seq_ids: list[int], num_tokens: list[int]) -> list[int]:
        """`append(seq_ids[i], num_tokens[i])` for every row, in one pass; returns each row's first position."""
        bs, lengths, tables, free = self.block_size, self._lengths, self._tables, self._free
        starts = []
        for seq_id, n in zip(seq_ids, num_tokens):
            start, table = lengths[seq_id], tables[seq_id]
            need = -(-(start + n) // bs) - len(table)
            if need > 0:
                if need > len(free):
                    raise OutOfBlocksError(f"sequence {seq_id} needs {need} blocks, {len(free)} free")
                for _ in range(need):
                    table.append(free.pop())
            lengths[seq_id] = start + n
            starts.append(start)
        return starts

    def rollback(self, seq_id: int, length: int) -> None:
        """Shrinks a sequence to its first `length` tokens and frees the blocks past them. O(freed blocks)."""
        self.rollback_many([seq_id], [length])

    def rollback_many(self, seq_ids: list[int], lengths: list[int]) -> None:
        """`rollback(seq_ids[i], lengths[i])` for every row, in one pass."""
        bs, own, tables, free, regions = self.block_size, self._lengths, self._tables, self._free, self._regions
        for seq_id, length in zip(seq_ids, lengths):
            if not 0 <= length <= own[seq_id]:
                raise ValueError(f"cannot roll sequence {seq_id} of length {own[seq_id]} back to {length}")
            table = tables[seq_id]
            keep = -(-length // bs)
            if len(table) > keep:
                keep = max(keep, len(regions.get(seq_id, ())))
                while len(table) > keep:
                    free.append(table.pop())
            own[seq_id] = length

    def free(self, seq_id: int) -> None:
        """Returns a sequence's blocks to the pool (its id's region stays with the id) and forgets it."""
        table = self._tables.pop(seq_id)
        self._free.extend(reversed(table[len(self._regions.get(seq_id, ())):]))
        del self._lengths[seq_id]
