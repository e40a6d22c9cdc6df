"""The data that flows through one speculative step, named with the project's glossary.

draft: tokens a speculator proposes. target: the model whose output we must reproduce. accepted: draft tokens the
verifier keeps. recovered: the token sampled in place of the first rejected draft. bonus: the extra target token when
every draft is accepted. output = accepted + (recovered or bonus).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

PAD_ID = -1  # padding in draft and output token tensors


@dataclass
class DraftProposal:
    """A ragged batch of drafts: padded token ids plus a per-row count. A count of 0 is the one way to say
    "no proposal" for a row.

    Attributes:
        token_ids: `[rows, k]` int64, padded with `PAD_ID`.
        num_tokens: `[rows]` int64 in `[0, k]`.
        probs: `[rows, k, vocab]` draft_probs the tokens were sampled from, or `None` for a deterministic speculator
            (each draft is a point mass).
        confidence: `[rows]` int64 confidence class of each row's proposal, an index into the speculator's
            `confidence_priors` (adaptive k keeps acceptance per class), or `None` for a single class.
    """

    token_ids: torch.Tensor
    num_tokens: torch.Tensor
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.token_ids.shape[1]

    @classmethod
    def empty(cls, rows: int, device) -> DraftProposal:
        return cls(torch.full((rows, 0), PAD_ID, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device))


@dataclass
class DraftTree:
    """A batch of draft trees, one per row, all with the same node count (unused nodes are invalid). The root is the
    row's last committed token; a path from the root is one candidate continuation.

    Attributes:
        token_ids: `[rows, n]` int64 node tokens.
        parents: `[rows, n]` int64 parent of each node: a node index, or -1 for the root. Parents come before their
            children (`parents[:, i] < i`), so index order is a topological order.
        valid: `[rows, n]` bool; an invalid node is never accepted (nor are its descendants).
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def empty(cls, rows: int, device) -> DraftTree:
        none = torch.zeros((rows, 0), dtype=torch.long, device=device)
        return cls(none, none.clone(), none.bool())

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[1]

    def depths(self, max_depth: int | None = None) -> torch.Tensor:
        """`[rows, n]` depth of each node (children of the root: 1). `max_depth` bounds the work: the deepest node
        may be no deeper (default: n)."""
        return self.ancestors(max_depth).sum(-1)

    def ancestors(self, max_depth: int | None = None) -> torch.Tensor:
        """`[rows, n, n]` bool: `[r, i, j]` is True when node j is node i or one of its ancestors. Pointer jumping,
        one step per level: `max_depth - 1` rounds (default: n - 1)."""
        rows, n = self.parents.shape
        device = self.parents.device
        found = torch.eye(n, dtype=torch.bool, device=device).expand(rows, n, n).clone()
        current = self.parents
        for _ in range((n if max_depth is None else max_depth) - 1):
            has = current >= 0
            index = current.clamp(min=0)[:, :, None]
            found.scatter_(2, index, found.gather(2, index) | has[:, :, None])
            current = torch.where(has, self.parents.gather(1, current.clamp(min=0)), -1)
        return found


@dataclass
class VerifyResult:
    """What the verifier keeps of a step.

    Attributes:
        output_token_ids: `[rows, k + 1]` accepted drafts followed by one recovered or bonus token, padded with `PAD_ID`.
        num_accepted: `[rows]` accepted drafts per row, in `[0, num_draft_tokens]`.
    """

    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor


@dataclass
class SequenceBatch:
    """The engine's running batch, as speculators see it (read-only, except scratch columns past each row's end).

    `token_ids` is laid out as transformers lays out a batch: prompts left-padded to `prompt_width` columns, generated
    tokens from column `prompt_width` on. Row i's real tokens are columns `[first_col[i], first_col[i] + lengths[i])`;
    columns past that are scratch a speculator may write its drafts into.

    Attributes:
        token_ids: `[batch, width]` int64.
        first_col: `[batch]` int64 column of each row's first real token.
        lengths: real tokens (prompt + generated) per row, on the host.
        active: rows still generating, ascending, on the host.
        prompt_width: columns of the (padded) prompt.
        do_sample: whether this call samples.
        processing: applies the call's logits processors with per-position history (`logits.LogitsProcessing`).
        target_vocab_size: size of the target's logits.
        sampling: per-row sampling settings when rows differ (`row_sampling.RowSampling`), or `None`: one setting,
            `do_sample` and `processing`, for the whole batch.
    """

    token_ids: torch.Tensor
    first_col: torch.Tensor
    lengths: list[int]
    active: list[int]
    prompt_width: int
    do_sample: bool
    processing: object
    target_vocab_size: int
    sampling: object = None
    # The last `active_tensor` and `end_cols` answers, by what they were built from: a step asks for them, and so do
    # speculators, several times over the same rows and lengths (each a host-to-device copy on a GPU). Callers treat
    # the tensors as read-only.
    _cached: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    def _remembered(self, name: str, key: tuple, build) -> torch.Tensor:
        """`build()`, or what it returned last time under `name` if `key` is unchanged since."""
        hit = self._cached.get(name)
        if hit is None or hit[0] != key:
            hit = self._cached[name] = (key, build())
        return hit[1]

    def active_tensor(self) -> torch.Tensor:
        return self._remembered("active", tuple(self.active),
                                lambda: torch.tensor(self.active, dtype=torch.long, device=self.device))

    def lengths_tensor(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor([self.lengths[r] for r in rows], dtype=torch.long, device=self.device)

    def used_width(self, rows: list[int]) -> int:
        """Columns that hold every real token of these rows (host-side bound: a row's first column is at most
        `prompt_width`); a server's buffer is as wide as the model's context, its rows far shorter."""
        return min(self.token_ids.shape[1], self.prompt_width + max((self.lengths[r] for r in rows), default=0))

    def end_cols(self, rows: list[int]) -> torch.Tensor:
        """`[rows]` column just past each row's last real token."""
        # `first_col`'s version counter moves with every write to it (a slot taken by a new request).
        key = (tuple(rows), tuple(self.lengths[r] for r in rows), self.first_col._version)
        return self._remembered("end", key, lambda: self.first_col[torch.tensor(rows, device=self.device)]
                                + self.lengths_tensor(rows))


def gather_right_aligned(token_ids: torch.Tensor, rows: torch.Tensor, start_cols: torch.Tensor,
                         counts: torch.Tensor, width: int) -> torch.Tensor:
    """Takes `counts[i]` tokens from column `start_cols[i]` of row `rows[i]`, right-aligned in `width` columns.

    Padding on the left repeats the row's first token; the model runner sends those columns to a scratch slot.
    Returns `[len(rows), width]`.
    """
    offset = torch.arange(width, device=token_ids.device)[None, :] - (width - counts)[:, None]
    cols = start_cols[:, None] + offset.clamp(min=0)
    return token_ids[rows[:, None], cols]
