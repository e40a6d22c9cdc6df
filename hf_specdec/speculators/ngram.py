"""Prompt lookup: propose what followed the earlier occurrence of each row's context that matches it the longest."""

from __future__ import annotations

import numpy as np
import torch

from ..decode.speculator import Speculator
from ..types import PAD_ID, DraftProposal, SequenceBatch

# Confidence classes are the matched context length, capped here: beyond it, longer matches predict no better.
_MAX_CLASS = 8
# Prior acceptance by matched length m: longer matches are likelier to continue, m / (m + 1.5); a match of one or two
# tokens is mostly a coincidence of common words in free text, m / (m + 3) (0.25 and 0.40, from 0.40 and 0.57). Paired
# against speculation off (`python benchmarks/cpu_probes.py ngram-priors`, docs/benchmarks.md), the doubting priors
# for short matches kept grounded prompts level or better (1.39x -> 1.40x at batch 4, 1.73x -> 1.82x at batch 1) and
# took open chat from 0.86x to 1.05x at batch 1 and from 0.94x to 0.97x at batch 4, where those matches' drafts were
# accepted at about 0.1.
_SHORT_MATCH, _SHORT_DOUBT = 2, 3.0


class NgramSpeculator(Speculator):
    """N-gram prompt lookup, batched (no model, no cache).

    For each row, compares its last `max_ngram` tokens with the tokens before every earlier position of the row
    (prompt and generated tokens) and takes the position whose preceding context matches the longest (the latest
    among equals), if that match is at least `min_ngram` tokens long. It proposes the `k` tokens that followed, the
    row's own tokens past its end included as they are being written (a match d tokens back repeats with period d,
    as an LZ77 copy does). Rows without such a match propose nothing. Drafts are deterministic (point masses).

    The match length is the proposal's confidence class: a row copying a passage matches many tokens and its drafts
    are usually accepted, a two-token coincidence rarely is. Adaptive k keeps acceptance per class and verifies
    only as many drafts as pay off (`costs/adaptive.py`), so drafting is free and proposals are made before k is chosen.

    Where the tokens are in host memory (a CPU model) the lookup runs in numpy over the columns that hold each row's
    last token only (`_host_longest_match`): no tensor op is dispatched, and its work grows with the rows' length
    rather than length times `max_ngram`. On an accelerator every column is compared on the device
    (`_longest_match`), which costs the host a fixed few dozen kernel launches. Both propose the same.

    Args:
        min_ngram (`int`): shortest matched context that proposes.
        max_ngram (`int`): longest context compared.
    """

    drafts_are_free = True
    # Adaptive k verifies only as many free drafts as pay, so a longer ceiling lets a row copying a passage verify
    # more of it per step: on grounded prompts at batch 1, paired, 1.75x speculation off with 10 against 1.68x with
    # 5; on open chat at batch 4 0.99x against 0.98x (docs/benchmarks.md).
    default_num_speculative_tokens = 10

    def __init__(self, min_ngram: int = 1, max_ngram: int = 16):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"NgramSpeculator needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.confidence_priors = tuple(m / (m + (_SHORT_DOUBT if m <= _SHORT_MATCH else 1.5))
                                       for m in range(min(max_ngram, _MAX_CLASS) + 1))

    def __repr__(self) -> str:
        return f"NgramSpeculator(min_ngram={self.min_ngram}, max_ngram={self.max_ngram})"

    def propose(self, batch: SequenceBatch, k: int) -> DraftProposal:
        if k == 0:
            return DraftProposal.empty(len(batch.active), batch.device)
        if batch.device.type == "cpu":
            return self._propose_host(batch, k)
        return self._propose_device(batch, k)

    def _propose_host(self, batch: SequenceBatch, k: int) -> DraftProposal:
        """`propose` in numpy, for tokens in host memory."""
        rows = np.asarray(batch.active, dtype=np.intp)
        # [rows, width]: only the columns the rows use (a server's buffer is as wide as the model's context)
        tokens = batch.token_ids.numpy()[rows, :batch.used_width(batch.active)]
        first = batch.first_col.numpy()[rows]
        end = first + np.asarray(batch.lengths, dtype=first.dtype)[rows]
        position, length = _host_longest_match(tokens, first, end, self.max_ngram)
        found = length >= self.min_ngram
        start = position + 1  # as `_propose_device`: copied on past the row's end with period `end - start`
        period = np.maximum(end - start, 1)
        cols = np.minimum(start[:, None] + np.arange(k)[None, :] % period[:, None], tokens.shape[1] - 1)
        token_ids = np.where(found[:, None], np.take_along_axis(tokens, cols, 1), PAD_ID)
        confidence = np.where(found, np.minimum(length, len(self.confidence_priors) - 1), 0)
        return DraftProposal(torch.from_numpy(token_ids), torch.from_numpy(np.where(found, k, 0)),
                             confidence=torch.from_numpy(confidence))

    def _propose_device(self, batch: SequenceBatch, k: int) -> DraftProposal:
        """`propose` in tensor ops, on the batch's device."""
        rows = batch.active_tensor()
        # [rows, width]: only the columns the rows use (the lookup compares every column's window with the suffix)
        tokens = batch.token_ids[rows, :batch.used_width(batch.active)]
        first = batch.first_col[rows]
        end = batch.end_cols(batch.active)  # [rows] one past the last real token
        position, length = self._longest_match(tokens, first, end)
        found = length >= self.min_ngram
        start = position + 1  # the proposal continues after the matched position
        # What followed the match, copied on past the row's end as an LZ77 copy does: a match `d` tokens back
        # (d = end - start) continues with period d. The latest match in text repeating itself lies just before
        # the end ("the the the": d = 1), and stopping at the end would offer a single draft where the text
        # says k.
        period = (end - start).clamp(min=1)
        offsets = torch.arange(k, device=tokens.device)[None, :]
        token_ids = tokens.gather(1, (start[:, None] + offsets % period[:, None]).clamp(max=tokens.shape[1] - 1))
        confidence = torch.where(found, length.clamp(max=len(self.confidence_priors) - 1), 0)
        return DraftProposal(torch.where(found[:, None], token_ids, PAD_ID), torch.where(found, k, 0),
                             confidence=confidence)

    def _longest_match(self, tokens, first, end):
        """`([rows], [rows])`: for each row the column whose preceding context best matches the row's last tokens
        (aligned with its last token), and the match length (0 when nothing matches)."""
        rows, width = tokens.shape
        n = self.max_ngram
        cols = torch.arange(width, device=tokens.device)
        # Candidates end inside the row and strictly before its last token (so something follows them). Every other
        # column holds -1 in the windows and the suffix's columns outside the row -2: neither matches anything, so a
        # match never reaches past a row's start and a column that is no candidate matches nothing.
        valid = (cols[None, :] >= first[:, None]) & (cols[None, :] < (end - 1)[:, None])
        padded = torch.nn.functional.pad(torch.where(valid, tokens, -1), (n - 1, 0), value=-1)
        windows = padded.unfold(1, n, 1)  # [rows, width, n]: windows[r, e, i] = token at column e - n + 1 + i
        back = (end - n)[:, None] + torch.arange(n, device=tokens.device)[None, :]  # the row's last n columns
        suffix = torch.where(back >= first[:, None], tokens.gather(1, back.clamp(min=0)), -2)
        # [rows, width] matched length: n less one plus the index of the last disagreement (0 where there is none),
        # found as the largest of the disagreements weighted 1 .. n. 0.25 ms at 32 rows of 200 tokens and 0.56 ms at
        # 16 of 1200 on one thread of a 2-core AMD EPYC, against 0.34 and 0.87 ms for the first disagreement from
        # the end through flipped windows and an argmax, and 1.7 ms at 16 x 1200 for a cumulative product.
        weights = torch.arange(1, n + 1, device=tokens.device, dtype=torch.int16 if n < 2 ** 15 else torch.int32)
        agree = n - ((windows != suffix[:, None, :]) * weights).amax(-1).long()  # int64: the rank below is large
        # Longest first, then latest.
        best = (agree * width + cols[None, :]).argmax(-1)
        return best, agree.gather(1, best[:, None]).squeeze(1)


def _host_longest_match(tokens: np.ndarray, first: np.ndarray, end: np.ndarray, n: int) -> tuple[np.ndarray,
                                                                                                    np.ndarray]:
    """`NgramSpeculator._longest_match` in numpy, over the candidates alone: a column can match the row's last `n`
    tokens only if it holds the row's last token, so only those columns (in text, a few in a hundred) are compared
    further, `n` tokens back each. The longest match wins, the latest among equals; `([rows], [rows])` its column and
    length (0 where no column matches)."""
    rows, width = tokens.shape
    cols = np.arange(width)
    last = tokens[np.arange(rows), np.maximum(end - 1, 0)]
    # Candidates end inside the row and strictly before its last token (so something follows them).
    hit_rows, hit_cols = np.nonzero((tokens == last[:, None]) & (cols[None, :] >= first[:, None])
                                    & (cols[None, :] < (end - 1)[:, None]))
    position, length = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
    if not hit_rows.size:
        return position, length
    back = np.arange(n)[None, :]
    at, suffix = hit_cols[:, None] - back, (end[hit_rows] - 1)[:, None] - back  # [hits, n] latest first
    low = first[hit_rows][:, None]  # neither side reaches before its row's first token
    same = (at >= low) & (suffix >= low) & (tokens[hit_rows[:, None], np.maximum(at, 0)]
                                            == tokens[hit_rows[:, None], np.maximum(suffix, 0)])
    agree = np.where(same.all(1), n, same.argmin(1))  # the run of agreeing tokens from the last one back
    # Per row, the largest rank (longest, then latest): `nonzero` lists a row's hits together, rows ascending.
    starts = np.flatnonzero(np.r_[True, hit_rows[1:] != hit_rows[:-1]])
    best = np.maximum.reduceat(agree * width + hit_cols, starts)
    position[hit_rows[starts]], length[hit_rows[starts]] = best % width, best // width
    return position, length
