"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of each row's suffix."""

from __future__ import annotations

import torch

from ..types import PAD_ID, DraftProposal, SequenceBatch
from .base import Speculator


class NgramSpeculator(Speculator):
    """N-gram prompt lookup, batched with tensor ops (no model, no cache).

    For each row, finds the longest suffix of `max_ngram` down to `min_ngram` tokens that also occurs earlier in the
    row (prompt and generated tokens), takes its latest such occurrence, and proposes up to `k` tokens that followed
    it. Rows without a match propose nothing. Drafts are deterministic (point masses).

    Args:
        min_ngram (`int`): shortest suffix to match.
        max_ngram (`int`): longest suffix to match.
    """

    def __init__(self, min_ngram: int = 2, max_ngram: int = 4):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramSpeculator needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def __repr__(self) -> str:
        return f"NgramSpeculator(min_ngram={self.min_ngram}, max_ngram={self.max_ngram})"

    def propose(self, batch: SequenceBatch, k: int) -> DraftProposal:
        if k == 0:
            return DraftProposal.empty(len(batch.active), batch.device)
        rows = batch.active_tensor()
        tokens = batch.token_ids[rows]  # [rows, width]
        first = batch.first_col[rows]
        end = batch.end_cols(batch.active)  # [rows] one past the last real token
        continuation = torch.full_like(end, -1)  # column where the proposal starts, -1 if none yet
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            continuation = torch.where(continuation < 0, self._latest_match(tokens, first, end, n), continuation)
        found = continuation >= 0
        num_tokens = torch.where(found, (end - continuation).clamp(max=k), 0)
        cols = continuation.clamp(min=0)[:, None] + torch.arange(k, device=tokens.device)[None, :]
        in_draft = torch.arange(k, device=tokens.device)[None, :] < num_tokens[:, None]
        token_ids = tokens.gather(1, cols.clamp(max=tokens.shape[1] - 1))
        return DraftProposal(torch.where(in_draft, token_ids, PAD_ID), num_tokens)

    @staticmethod
    def _latest_match(tokens, first, end, n):
        """`[rows]` column right after the latest earlier occurrence of each row's last `n` tokens, or -1."""
        width = tokens.shape[1]
        if width < n + 1:
            return torch.full_like(end, -1)
        suffix_cols = (end - n)[:, None] + torch.arange(n, device=tokens.device)[None, :]
        suffix = tokens.gather(1, suffix_cols.clamp(min=0))  # [rows, n]
        windows = tokens.unfold(1, n, 1)  # [rows, width - n + 1, n]
        starts = torch.arange(windows.shape[1], device=tokens.device)[None, :]
        # A match must lie inside the row and end before the suffix's last token, so at least one token follows it.
        valid = (starts >= first[:, None]) & (starts + n < end[:, None]) & (end[:, None] - n >= first[:, None])
        hit = (windows == suffix[:, None, :]).all(-1) & valid
        latest = torch.where(hit, starts, -1).max(-1).values
        return torch.where(latest >= 0, latest + n, -1)
