"""Prefix caching for continuous batching: keys and values of prompts seen before, kept by their tokens.

Requests often share the beginning of their prompts (a system prompt, a chat template, a document asked about again).
A request whose prompt starts with full KV blocks computed for an earlier one copies them into its own blocks when it
joins the batch, and its first step feeds only the rest of the prompt. The stored blocks live in a store of their
own, apart from the running rows' pool, so sharing never touches a row's block table (rows keep their regions and
roll back as before) and a stored block outlives the request that wrote it.

A block is found by its tokens and everything before them: each stored block is a node keyed by (its parent node,
its tokens), so a match is exact, never a hash collision. Nodes go least recently used first when the store is
full; a node's descendants become unreachable with it and go the same way. A prompt always leaves at least its last
token to feed (its logits start the answer). Speculators that read the target's hidden states (EAGLE) get the
stored prefix's states too (`features`), as if the step had fed the whole prompt.

Keys and values at a position depend only on the tokens up to it (causal attention, positions from 0), so a copied
block holds what the prompt's own prefill would have written, up to the rounding of a forward of another width.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from ..kernels.paged_attention.reference import slots_of
from .paged import PagedKVCache


class PrefixCache:
    """Stores the full KV blocks of prompts, and the target's hidden states there when a speculator reads them.

    Args:
        capacity_tokens (`int`): the most tokens stored (rounded down to whole blocks); the store's tensors grow to
            it as prompts arrive, then the least recently used blocks make room.
        block_size (`int`): the target cache's block size.
        features (`bool`): also keep the target's hidden states of each stored token (for a speculator that reads
            them); `store` then needs them.
        length_key (`Callable[[int], int]`, *optional*): where a prompt's keys depend on its length as well as its
            tokens (LongRoPE rotates a whole prompt past a length with other factors: `rope.RopeRows.prefix_key`),
            the key of each prompt length; prompts whose lengths have different keys share nothing.
    """

    def __init__(self, capacity_tokens: int, block_size: int, features: bool = False,
                 length_key: Callable[[int], int] | None = None):
        if capacity_tokens < block_size:
            raise ValueError(f"a prefix cache needs room for at least one block ({block_size} tokens), got "
                             f"{capacity_tokens}")
        self.block_size = block_size
        self.capacity = capacity_tokens // block_size  # in blocks
        self._nodes: OrderedDict[tuple[int, tuple[int, ...]], int] = OrderedDict()  # (parent, tokens) -> node
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._where: dict[int, int] = {}  # node -> its block in the store
        self.with_features = features
        self._next_node = 1  # node ids are never reused: 0 is the empty prefix
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [stored blocks * block_size, kv_heads, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self.features: torch.Tensor | None = None  # [stored blocks * block_size, features]
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.length_key = length_key

    @property
    def num_stored_blocks(self) -> int:
        return len(self._where)

    def memory_bytes(self) -> int:
        tensors = [*self.keys.values(), *self.values.values()] + ([self.features] if self.features is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    # --- finding -------------------------------------------------------------------------------------------------
    def _root(self, prompt: list[int]) -> int:
        """The parent of a prompt's first block: 0, or a root of its own per `length_key` (node ids are positive)."""
        return 0 if self.length_key is None else -self.length_key(len(prompt))

    def _chain(self, prompt: list[int], num_blocks: int) -> list[int]:
        """The stored nodes of the prompt's first blocks, as far as they are stored (at most `num_blocks`)."""
        nodes, parent, bs = [], self._root(prompt), self.block_size
        for i in range(num_blocks):
            node = self._nodes.get((parent, tuple(prompt[i * bs:(i + 1) * bs])))
            if node is None:
                break
            nodes.append(node)
            parent = node
        return nodes

    def match(self, prompt: list[int]) -> int:
        """How many of the prompt's tokens are stored (whole blocks; never the last token)."""
        return len(self._chain(prompt, (len(prompt) - 1) // self.block_size)) * self.block_size

    def load(self, cache: PagedKVCache, row: int, prompt: list[int]) -> tuple[int, torch.Tensor | None]:
        """Copies the prompt's stored prefix into `row`'s blocks (the row must hold nothing yet) and returns its
        length in tokens, with the target's hidden states there (`[tokens, features]`) when they are stored."""
        self.num_queried_tokens += len(prompt)
        nodes = self._chain(prompt, (len(prompt) - 1) // self.block_size)
        if not nodes or not self.keys:
            return 0, None
        for node in nodes:  # used: the last to go
            self._nodes.move_to_end(self._key_of[node])
        length = len(nodes) * self.block_size
        cache.reserve([row], [length])
        source = self._slots(nodes)
        target = _row_slots(cache, row, length)
        for pools, stores in ((cache.key_pools, self.keys), (cache.value_pools, self.values)):
            for layer, stored in stores.items():
                pool = pools[layer]
                pool.index_copy_(0, target.to(pool.device),
                                 stored.index_select(0, source.to(stored.device)).to(pool.device))
        self.num_hit_tokens += length
        features = None if self.features is None else self.features.index_select(0, source.to(self.features.device))
        return length, features

    # --- storing -------------------------------------------------------------------------------------------------
    def store(self, cache: PagedKVCache, row: int, prompt: list[int], features: torch.Tensor | None = None,
              features_start: int = 0) -> int:
        """Stores the full blocks of `prompt` that `row` now holds in the target's cache and the store lacks, all but
        the block holding the last token. `features`: the target's hidden states at positions `features_start, ...`
        of the row (the speculator's input), kept beside the blocks; blocks they do not cover are not stored.
        Returns the number of blocks added."""
        if not cache.key_pools:
            return 0
        if self.with_features != (features is not None):
            raise ValueError("this prefix cache keeps hidden states: store needs them" if self.with_features else
                             "this prefix cache keeps no hidden states; build it with features=True")
        bs = self.block_size
        num_blocks = min((len(prompt) - 1) // bs, cache.length(row) // bs)
        if features is not None:
            num_blocks = min(num_blocks, (features_start + features.shape[0]) // bs)
        parent, added, chain = self._root(prompt), [], set()
        for i in range(num_blocks):
            key = (parent, tuple(prompt[i * bs:(i + 1) * bs]))
            node = self._nodes.get(key)
            if node is None:
                if features is not None and i * bs < features_start:
                    break  # a block whose states this step did not see (it was loaded, then evicted since)
                block = self._take_block(chain)
                if block is None:
                    break
                node = self._next_node
                self._next_node += 1
                self._nodes[key] = node
                self._key_of[node] = key
                self._where[node] = block
                added.append((i, block))
            else:
                self._nodes.move_to_end(key)
            chain.add(node)
            parent = node
        if not added:
            return 0
        self._reserve(cache, features)
        positions = torch.tensor([i * bs + j for i, _ in added for j in range(bs)])
        source = _row_slots(cache, row, cache.length(row)).index_select(0, positions)
        dest = torch.tensor([b * bs + j for _, b in added for j in range(bs)])
        for pools, stored in ((cache.key_pools, self.keys), (cache.value_pools, self.values)):
            for layer, pool in pools.items():
                stored[layer].index_copy_(0, dest.to(stored[layer].device),
                                          pool.index_select(0, source.to(pool.device)).to(stored[layer].device))
        if features is not None:
            rows = (positions - features_start).to(features.device)
            self.features.index_copy_(0, dest.to(self.features.device), features.index_select(0, rows).to(
                self.features.dtype))
        return len(added)

    # --- internals -----------------------------------------------------------------------------------------------
    def _take_block(self, keep: set[int]) -> int | None:
        """A free block of the store, the least recently used node's when it is full (never one of `keep`, the
        chain being stored: then None)."""
        if len(self._where) < self.capacity:
            return len(self._where)
        key, node = next(iter(self._nodes.items()))  # least recently used
        if node in keep:
            return None
        del self._nodes[key], self._key_of[node]
        return self._where.pop(node)

    def _slots(self, nodes: list[int]) -> torch.Tensor:
        bs = self.block_size
        blocks = torch.tensor([self._where[n] for n in nodes])
        return (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)

    def _reserve(self, cache: PagedKVCache, features: torch.Tensor | None) -> None:
        """Grows the store's tensors (doubling, up to the capacity) to hold every block handed out."""
        used = max(self._where.values()) + 1
        have = next(iter(self.keys.values())).shape[0] // self.block_size if self.keys else 0
        if used <= have:
            return
        size = max(used, min(self.capacity, max(2 * have, 4))) * self.block_size
        for pools, stored in ((cache.key_pools, self.keys), (cache.value_pools, self.values)):
            for layer, pool in pools.items():
                old = stored.get(layer)
                grown = pool.new_zeros((size, *pool.shape[1:]))
                if old is not None:
                    grown[: old.shape[0]] = old
                stored[layer] = grown
        if features is not None:
            grown = features.new_zeros((size, features.shape[-1]))
            if self.features is not None:
                grown[: self.features.shape[0]] = self.features
            self.features = grown


def _row_slots(cache: PagedKVCache, row: int, length: int) -> torch.Tensor:
    """Storage slots of `row`'s first `length` positions."""
    table = torch.tensor([cache.manager.block_table(row)], dtype=torch.long)
    return slots_of(table, torch.arange(length)[None], cache.block_size)[0]
