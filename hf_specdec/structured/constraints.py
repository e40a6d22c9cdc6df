"""Constrained rows under speculation: which tokens each draft position allows, exactly as plain decoding would.

A row is constrained by a grammar (an xgrammar matcher: `grammar=`, or xgrammar's own transformers logits
processor) or by a `prefix_allowed_tokens_fn`. Before a step's verify forward, each constrained row's drafts are
walked through its constraint (`RowConstraints.constrain`):

- position j's allowed tokens are those the constraint allows after the committed tokens and the j drafts before it;
- the speculator's drafts are cut at the first one the constraint forbids (it would be rejected, so it is not fed);
- then the grammar drafts: where a position allows exactly one token, that token (a "forced" draft: the
  constrained target puts all its mass on it, so it is always accepted), else the next token of the grammar's fixed
  text (a schema's next key and its punctuation, as the tokenizer spells it), with any speculator or none.

The verify forward's logits are masked with those allowed sets before the logits processors run (masking commutes
with the elementwise processors transformers puts first, and comes before the warpers, as a constraint given to
plain `generate` does). Greedy output is then the constrained argmax, token for token. Sampling stays exact too:
a deterministic draft cut at a forbidden token leaves the target's own distribution at that position (the recovered
distribution of a point mass the target gives probability 0 is the target's), and for a sampled draft (draft_probs
q) the cut position samples from `max(p - q, 0)`, as rejecting it would have (`residual`). Grammar matchers are
advanced over drafts to fill the masks and rolled back at once; after the step they accept the tokens emitted.

The walk runs on the host (xgrammar's matchers are CPU objects): a constrained step reads its drafts and emitted
tokens once each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..types import PAD_ID, DraftProposal
from .grammar import xgrammar


@dataclass
class ConstrainedDraft:
    """A step's drafts after the walk.

    Attributes:
        draft: the drafts to verify (the speculator's, cut, then the grammar's).
        entries: `([n], [n])` row and position of each constrained position the verify reads (a row's positions up
            to its draft count); the others are unconstrained or unused.
        allowed: `[n, vocab]` bool, the tokens each entry allows.
        num_speculated: per row, how many leading drafts are the speculator's own (the rest were forced).
        residual_rows: `[rows]` bool, rows whose last position had a sampled draft the constraint forbids.
        residual_probs: `[rows, vocab]` that draft's draft_probs (zeros elsewhere), or `None`.
    """

    draft: DraftProposal
    entries: tuple[torch.Tensor, torch.Tensor]
    allowed: torch.Tensor
    num_speculated: list[int]
    residual_rows: torch.Tensor | None = None
    residual_probs: torch.Tensor | None = None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` `[rows, k + 1, vocab]` with forbidden tokens at -inf."""
        vocab = min(logits.shape[-1], self.allowed.shape[-1])
        allowed = self.allowed[:, :vocab].to(logits.device)
        if logits.shape[-1] > vocab:  # logits past the tokenizer's vocabulary are never allowed
            allowed = torch.nn.functional.pad(allowed, (0, logits.shape[-1] - vocab), value=False)
        rows, positions = (e.to(logits.device) for e in self.entries)
        masked = logits.clone()
        masked[rows, positions] = logits[rows, positions].masked_fill(~allowed, float("-inf"))
        return masked

    def residual(self, scores: torch.Tensor) -> torch.Tensor:
        """Processed scores `[rows, k + 1, vocab]` where each residual row's last position scores
        `log(max(p - q, 0))`: sampling from it is sampling the recovered token of the rejected draft."""
        if self.residual_rows is None:
            return scores
        rows = self.residual_rows.nonzero().flatten()
        pos = self.draft.num_tokens[rows]
        target_probs = torch.softmax(scores[rows, pos], dim=-1)
        draft_probs = torch.zeros_like(target_probs)
        q = self.residual_probs[rows]
        draft_probs[:, : q.shape[-1]] = q[:, : target_probs.shape[-1]]
        scores = scores.clone()
        scores[rows, pos] = torch.log((target_probs - draft_probs).clamp(min=0))
        return scores


class GrammarDeadEnd(ValueError):
    """A row's grammar allows no token of the vocabulary after the row's committed tokens."""


class RowConstraints:
    """What constrains each row of one `generate` call.

    Args:
        num_rows (`int`): batch rows.
        vocab_size (`int`): width of the target's logits.
        compiled (`list`, *optional*): an xgrammar `CompiledGrammar` or `None` per row.
        prefix_allowed_tokens_fn (*optional*): transformers' `prefix_allowed_tokens_fn(batch_id, input_ids)`.
        tokenizer (*optional*): the target's; with it, grammars also draft their fixed text (see `_MatcherState`).
    """

    def __init__(self, num_rows: int, vocab_size: int, compiled: list | None = None,
                 prefix_allowed_tokens_fn=None, tokenizer=None):
        self.vocab_size = vocab_size
        self.words = math.ceil(vocab_size / 32)
        self.states: list = [None] * num_rows
        encode = None
        if tokenizer is not None:
            def encode(text: str) -> list[int]:
                return tokenizer.encode(text, add_special_tokens=False) if text else []
        self._encode = encode
        for row, grammar in enumerate(compiled or []):
            if grammar is not None:
                self.states[row] = _MatcherState(grammar, encode)
        if prefix_allowed_tokens_fn is not None:
            self.states = [_PrefixFnState(prefix_allowed_tokens_fn, row) for row in range(num_rows)]
        # Rows whose grammar reached a dead end (row -> why): they leave the batch with that error, alone
        # (`take_dead_ends`); the step runs them unconstrained and their tokens are dropped.
        self.dead_ends: dict[int, str] = {}

    def __bool__(self) -> bool:
        return any(state is not None for state in self.states)

    def admit(self, row: int, compiled) -> None:
        """A request joining the batch at `row` (the server's), constrained by `compiled` from its first token."""
        self.states[row] = _MatcherState(compiled, self._encode)

    def constrain(self, batch, rows: list[int], draft: DraftProposal, limits: list[int]) -> ConstrainedDraft:
        """Walks each row's drafts (at most `limits[i]` verified drafts for row i) through its constraint."""
        drafted, counts = draft.token_ids.tolist(), draft.num_tokens.tolist()
        depth = max(limits, default=0) + 1
        bitmask = torch.full((len(rows), depth, self.words), -1, dtype=torch.int32)  # all ones: unconstrained
        walked, num_speculated, cut = [], [], []
        for i, row in enumerate(rows):
            own = drafted[i][: counts[i]][: limits[i]]
            state = self.states[row]
            if state is None:
                walked.append(own), num_speculated.append(len(own)), cut.append(False)
                continue
            history = batch.token_ids[row, : int(batch.first_col[row]) + batch.lengths[row]]
            try:
                tokens, n, forbidden = state.walk(own, limits[i], bitmask[i].numpy(), history,
                                                  draft.probs is not None)
            except GrammarDeadEnd as error:  # this row cannot go on; the others in the step do
                self.dead_ends[row] = str(error)
                self.states[row] = None
                walked.append([]), num_speculated.append(0), cut.append(False)
                continue
            if draft.probs is not None and any(t >= draft.probs.shape[-1] for t in tokens[n:]):
                tokens = tokens[: n + next(j for j, t in enumerate(tokens[n:]) if t >= draft.probs.shape[-1])]
            walked.append(tokens), num_speculated.append(n), cut.append(forbidden)
        width = max(map(len, walked), default=0)
        device = draft.token_ids.device
        token_ids = torch.tensor([t + [PAD_ID] * (width - len(t)) for t in walked], dtype=torch.long,
                                 device=device).view(len(rows), width)
        num_tokens = torch.tensor([len(t) for t in walked], dtype=torch.long, device=device)
        probs = residual_rows = residual_probs = None
        if draft.probs is not None:
            probs, residual_rows, residual_probs = self._draft_probs(draft, walked, num_speculated, cut, width)
        # Only the positions the verify reads, of constrained rows: unpacking every [rows, k + 1] mask would cost
        # more than the walk.
        entry_rows = [i for i, row in enumerate(rows) if self.states[row] is not None for _ in range(len(walked[i]) + 1)]
        entry_pos = [j for i, row in enumerate(rows) if self.states[row] is not None for j in range(len(walked[i]) + 1)]
        allowed = _unpack(bitmask.numpy()[entry_rows, entry_pos], self.vocab_size)
        entries = (torch.tensor(entry_rows, dtype=torch.long), torch.tensor(entry_pos, dtype=torch.long))
        proposal = DraftProposal(token_ids, num_tokens, probs, draft.confidence)
        return ConstrainedDraft(proposal, entries, allowed, num_speculated, residual_rows, residual_probs)

    @staticmethod
    def _draft_probs(draft, walked, num_speculated, cut, width):
        """draft_probs for the walked drafts: the speculator's where its drafts stand, point masses where tokens
        were forced; and the probs of each cut row's forbidden draft."""
        rows, vocab = len(walked), draft.probs.shape[-1]
        probs = torch.zeros(rows, width, vocab, dtype=draft.probs.dtype, device=draft.probs.device)
        keep = min(width, draft.probs.shape[1])
        probs[:, :keep] = draft.probs[:, :keep]
        for i, (tokens, n) in enumerate(zip(walked, num_speculated)):
            for j in range(n, len(tokens)):
                probs[i, j] = 0
                probs[i, j, tokens[j]] = 1
        residual_rows = torch.tensor(cut, dtype=torch.bool, device=draft.probs.device)
        residual_probs = torch.zeros(rows, vocab, dtype=draft.probs.dtype, device=draft.probs.device)
        for i, (tokens, c) in enumerate(zip(walked, cut)):
            if c:
                residual_probs[i] = draft.probs[i, len(tokens)]
        return probs, (residual_rows if any(cut) else None), residual_probs

    def commit(self, rows: list[int], output: torch.Tensor, num_emit: list[int], finished: list[bool]) -> None:
        """Advances each constrained row that goes on over the tokens it emitted (`output` `[rows, k + 1]`)."""
        tokens = None
        for i, (row, n, done) in enumerate(zip(rows, num_emit, finished)):
            state = self.states[row]
            if state is None or done:
                continue
            if tokens is None:
                tokens = output.tolist()
            state.advance(tokens[i][:n])

    def release(self, rows: list[int]) -> None:
        for row in rows:
            self.states[row] = None
            self.dead_ends.pop(row, None)

    def take_dead_ends(self) -> dict[int, str]:
        """The rows whose grammar allowed no token in the latest step, with why; forgotten once taken."""
        dead, self.dead_ends = self.dead_ends, {}
        return dead


class _MatcherState:
    """A row under an xgrammar grammar. With `encode` (the tokenizer's), it also drafts the grammar's fixed text
    (xgrammar's jump-forward string: a schema's next key, closing brackets) as the tokenizer spells it."""

    def __init__(self, compiled, encode=None):
        xgr = xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)  # rollback history is unlimited in xgrammar >= 0.2
        self.scratch = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        self.stop_token_ids = list(self.matcher.stop_token_ids)
        self.encode = encode

    def walk(self, drafts: list[int], limit: int, masks: np.ndarray, history,
             stochastic: bool = False) -> tuple[list[int], int, bool]:
        """Fills `masks[j]` for every position it verifies and returns `(tokens, num_speculated, cut)`: the drafts
        to verify, how many lead from `drafts`, and whether the position after them had a forbidden draft.

        After the speculator's drafts come the grammar's: the one token a position allows, else the next token of
        the grammar's fixed text. A sampled draft (`stochastic`) the grammar forbids is replaced only by a token the
        grammar forces: its position must otherwise sample the recovered distribution, so the walk stops there."""
        tokens: list[int] = []
        fixed: list[int] = []  # the grammar's fixed text, tokenized, not drafted yet
        num_speculated, cut = 0, False
        for j in range(limit + 1):
            self._fill(masks[j])
            if not masks[j].any():
                if not tokens:
                    raise GrammarDeadEnd("the grammar allows no token of this vocabulary here: the tokenizer cannot "
                                         "spell what the grammar requires next (or its stop tokens are not in the "
                                         "vocabulary)")
                # The token before leads where nothing can follow: it is not drafted. Should the target choose it,
                # the row meets the dead end at its next step, as plain decoding would.
                self.matcher.rollback(1)
                tokens.pop()
                num_speculated, cut = min(num_speculated, len(tokens)), False
                break
            if j == limit or self.matcher.is_terminated():
                break
            if j == num_speculated and j < len(drafts) and _allows(masks[j], drafts[j]):
                token = drafts[j]
                num_speculated += 1
            else:
                cut = j == num_speculated and j < len(drafts)
                token = _single(masks[j])
                if token is None and not (cut and stochastic):
                    if not fixed and self.encode is not None:
                        fixed = self.encode(self.matcher.find_jump_forward_string())
                    token = fixed[0] if fixed and _allows(masks[j], fixed[0]) else None
                if token is None:
                    break
                fixed = fixed[1:] if fixed and fixed[0] == token else []
                cut = False
            self._accept(token)
            tokens.append(token)
        if tokens:
            self.matcher.rollback(len(tokens))
        return tokens, num_speculated, cut

    def advance(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.matcher.is_terminated():
                return
            self._accept(token)

    def _accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar matcher refused token {token}, which its own mask allowed; please "
                               "report this with the grammar")

    def _fill(self, mask: np.ndarray) -> None:
        mask[:] = 0
        if self.matcher.is_terminated():  # only the stop tokens, as a finished constraint leaves it
            for token in self.stop_token_ids:
                if token < 32 * len(mask):
                    mask.view(np.uint32)[token >> 5] |= np.uint32(1 << (token & 31))
            return
        self.matcher.fill_next_token_bitmask(self.scratch, 0)
        words = min(len(mask), self.scratch.shape[1])
        mask[:words] = self.scratch[0, :words].numpy()


class _PrefixFnState:
    """A row under transformers' `prefix_allowed_tokens_fn(batch_id, input_ids)` (stateless: called per position
    with that position's history, as plain `generate` would call it)."""

    def __init__(self, fn, batch_id: int):
        self.fn = fn
        self.batch_id = batch_id

    def walk(self, drafts: list[int], limit: int, masks: np.ndarray, history,
             stochastic: bool = False) -> tuple[list[int], int, bool]:
        tokens: list[int] = []
        num_speculated, cut = 0, False
        for j in range(limit + 1):
            prefix = torch.cat([history, history.new_tensor(tokens)]) if tokens else history
            allowed = self.fn(self.batch_id, prefix)
            if len(allowed) == 0:
                raise ValueError(f"prefix_allowed_tokens_fn returned an empty list for batch ID {self.batch_id}; "
                                 "it must allow at least one token at every position")
            masks[j] = 0
            ids = np.asarray(allowed, dtype=np.int64)
            ids = ids[ids < 32 * len(masks[j])]
            np.bitwise_or.at(masks[j].view(np.uint32), ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
            if j == limit:
                break
            if j == num_speculated and j < len(drafts) and _allows(masks[j], drafts[j]):
                token = drafts[j]
                num_speculated += 1
            else:
                cut = j < len(drafts) and j == num_speculated
                token = _single(masks[j])
                if token is None:
                    break
                cut = False
            tokens.append(token)
        return tokens, num_speculated, cut

    def advance(self, tokens: list[int]) -> None:
        pass


def first_position_spellable(compiled) -> bool:
    """Whether the grammar allows any token of its tokenizer's vocabulary at its start (a grammar the tokenizer
    cannot spell fails there)."""
    state = _MatcherState(compiled)
    state._fill(state.scratch[0].numpy())
    return bool(state.scratch.numpy().any())


def _allows(mask: np.ndarray, token: int) -> bool:
    return token < 32 * len(mask) and bool((int(mask.view(np.uint32)[token >> 5]) >> (token & 31)) & 1)


def _single(mask: np.ndarray) -> int | None:
    """The one token `mask` allows, or `None` when it allows several (or none)."""
    nonzero = np.flatnonzero(mask)
    if len(nonzero) != 1:
        return None
    word = int(mask.view(np.uint32)[nonzero[0]])
    if word & (word - 1):
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1


def _unpack(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """`[n, words]` int32 bitmask (bit b of word w: token 32 w + b) -> `[n, vocab_size]` bool."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size]).bool()
