"""EAGLE speculator: chain or tree drafting with an EAGLE-1/2 or EAGLE-3 head that reads the target's hidden states.

An entry of the head's sequence pairs the target's feature at position p with the token at p + 1; the head's output
there stands in for the target's feature at p + 1, so its logits predict the token at p + 2. Each step the head first
catches up on the committed tokens whose target features the last verify pass produced (one forward, ragged rows),
which yields the first draft, then feeds its own outputs back for the next k - 1 drafts. Entries built from its own
outputs are rolled back after verification: the next step recomputes them from the target's real features.
`propose_tree` grows an EAGLE-2 dynamic tree instead of a chain (its entries attend to their own ancestors). The
head's keys and values live in a `PagedKVCache` run by a `ModelRunner`, like a draft model's. The head modules and
our checkpoint format are in `heads.py`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..cache.layout import TreeAttention
from ..decode.speculator import Speculator, sample_or_argmax
from ..runners.graphed import for_model
from ..runners.model_runner import ModelRunner, TargetHiddenStates
from ..types import PAD_ID, DraftProposal, DraftTree, SequenceBatch, gather_right_aligned
from .heads import EagleHead, check_head_target, load_eagle_dir


class EagleSpeculator(Speculator):
    """Drafts a chain of tokens per row with an EAGLE head reading the target's hidden states.

    Greedy calls draft the head's argmax; sampling calls sample drafts from the head's processed distribution and
    pass its draft_probs to the verifier, so output stays exactly the target's in both cases.

    Args:
        head (`EagleHead`): the head; `EagleSpeculator.from_pretrained(path)` builds it from our format.
        block_size (`int`): KV block size of the head's paged cache.
    """

    needs_hidden_states = True
    joins_in_verify = True
    supports_trees = True
    drafts_row_subsets = True
    # While drafting is off (`_consume_backlog`): a row keeps its newest `IDLE_WINDOW` target states and no more, and
    # the head reads none of them until drafting resumes; `None` keeps every state, the head reading them every
    # `IDLE_BACKLOG` steps so that it always holds the whole context.
    IDLE_WINDOW: int | None = 64
    IDLE_BACKLOG = 32

    def __init__(self, head: EagleHead, block_size: int = 16):
        self.head = head.eval()
        self.config = head.config
        self.block_size = block_size
        self._runner: ModelRunner | None = None
        self._pending: _PendingStates | None = None
        self._rows: list[int] = []
        self._real_lengths: list[int] | None = None
        # Rows whose head cache was restarted at a window of their states: position of its first entry.
        self._offset: dict[int, int] = {}

    def __repr__(self) -> str:
        return f"EagleSpeculator(EAGLE-{self.head.version}, layers={list(self.hidden_state_layers)})"

    @classmethod
    def from_pretrained(cls, path: str | Path, block_size: int = 16) -> EagleSpeculator:
        """Loads a head converted to our format by `hf_specdec.convert_eagle` (`hf-specdec convert-eagle`)."""
        config, tensors = load_eagle_dir(path)
        head = EagleHead(config)
        head.load_state_dict({n: t.float() if t.is_floating_point() else t for n, t in tensors.items()})
        return cls(head, block_size=block_size)

    @property
    def hidden_state_layers(self) -> tuple[int, ...]:
        """Which `output_hidden_states` entries of the target the head reads, concatenated in this order."""
        return tuple(self.config["target_hidden_states"]["layers"])

    def validate(self, target) -> None:
        check_head_target(target, self.config["target"], "EAGLE")
        if self.head.version == 1 and target.get_output_embeddings() is None:
            raise ValueError("an EAGLE-1/2 head uses the target's LM head, but this target has none")

    def relative_cost(self, target) -> float:
        params = sum(p.numel() for p in self.head.parameters())
        if self.head.version == 1:  # the target's LM head runs once per draft too
            params += target.get_output_embeddings().weight.numel()
        return params / target.num_parameters()

    def unread(self, batch: SequenceBatch) -> float:
        return sum(u for u in self.unread_rows(batch) if u is not None)

    def unread_rows(self, batch: SequenceBatch) -> list[float | None]:
        pending = self._pending
        held = set() if pending is None else set(pending.rows)  # rows joining this step have no states yet
        return [max(0, pending.count(r) - 1) * self._read_cost if r in held else None for r in batch.active]

    def begin(self, target, batch: SequenceBatch) -> None:
        # Reading a state costs the head's fc and layer (no LM head: only a row's newest entry gets logits).
        body = sum(p.numel() for m in (self.head.fc, self.head.layer) for p in m.parameters())
        self._read_cost = body / target.num_parameters()
        self.head.to(device=batch.device, dtype=target.dtype)  # where the target's states arrive (its own
        # device is `meta` when offloaded to disk)
        self.head.bind(target)
        self._runner = ModelRunner(self.head, block_size=self.block_size)
        self._runner.use_graphs(for_model(self.graph_settings, self.head))
        for row in batch.active:
            self._runner.add_sequence(row)
        self._pending, self._real_lengths, self._offset = None, None, {}

    def observe_hidden_states(self, hidden: TargetHiddenStates) -> None:
        """Receives the target's states of newly committed tokens (called by the engine after each verify)."""
        if self._pending is None:
            self._pending = _PendingStates()
        self._pending.add(hidden)

    @torch.no_grad()
    def propose(self, batch: SequenceBatch, k: int, rows: list[int] | None = None) -> DraftProposal:
        """Drafts `k` tokens for each row of `batch.active`, or only for `rows` among them (the others get none
        and keep their states unread, within `IDLE_WINDOW`, as in a step without drafts)."""
        everyone = list(batch.active)
        self._rows, self._real_lengths = [], None
        asked = None if rows is None else set(rows)
        wanted = everyone if asked is None else [r for r in everyone if r in asked]
        # Rows fed for the first time this step (joining a running batch) have no states yet: nothing to draft from.
        rows = [] if k == 0 or self._pending is None else self._with_states(wanted)
        if not rows:  # keep the states for later
            self._consume_backlog(batch, everyone)
            return DraftProposal.empty(len(everyone), batch.device)
        if len(wanted) < len(everyone):  # the rows left out this step: as in a step without drafts
            drafting = set(rows)
            self._consume_backlog(batch, [r for r in everyone if r not in drafting], keep=drafting)
        self._rows = rows
        rows_t = torch.tensor(rows, device=batch.device) if len(rows) < len(everyone) else batch.active_tensor()
        runner = self._runner
        last = self._catch_up(batch, rows)  # [rows, hidden]: every row's newest entry
        end = batch.end_cols(rows)  # column of the first draft
        tokens, probs = [], []
        for j in range(k):
            logits = self.head.logits(last, batch.target_vocab_size)
            scores = batch.processing(batch.token_ids, rows_t, end + j, logits)
            token, token_probs = sample_or_argmax(scores, batch.do_sample)
            batch.token_ids[rows_t, end + j] = token  # scratch column: later positions' processors read it
            tokens.append(token)
            probs.append(token_probs)
            if j + 1 < k:
                last = runner.forward(rows, token[:, None], [1] * len(rows), num_logits=1,
                                      features=last[:, None], from_target=False)[:, -1]
        draft = DraftProposal(torch.stack(tokens, dim=1), torch.full((len(rows),), k, device=batch.device),
                              torch.stack(probs, dim=1) if batch.do_sample else None)
        return draft if len(rows) == len(everyone) else _spread(draft, rows, everyone)

    def _with_states(self, rows: list[int]) -> list[int]:
        """The rows among `rows` whose target states are pending."""
        have = set(self._pending.rows)
        return [r for r in rows if r in have]

    @torch.no_grad()
    def propose_tree(self, batch: SequenceBatch, depth: int, num_nodes: int, branching: int) -> DraftTree:
        """EAGLE-2's dynamic draft tree, per row: the root's `branching` most likely tokens are the first nodes;
        each further level feeds the current frontier (the `branching` nodes of highest path probability, with
        attention to their own ancestors only) through the head at once and adds each one's `branching` most likely
        children; the tree keeps the `num_nodes` nodes of highest path probability over all levels. A node's path
        probability is at most its parent's, so the kept set contains every kept node's ancestors. `depth` head
        forwards in all, as for a chain of `depth` drafts."""
        rows = list(batch.active)
        self._rows, self._real_lengths = rows, None
        if depth == 0 or self._pending is None:
            self._consume_backlog(batch, rows)
            return DraftTree.empty(len(rows), batch.device)
        rows_t = batch.active_tensor()
        device = batch.device
        last = self._catch_up(batch, rows)  # [rows, hidden]
        vocab = batch.target_vocab_size
        num_rows, width = len(rows), min(branching, self.config.get("draft_vocab_size") or vocab, vocab)
        real = torch.tensor(self._real_lengths, device=device)

        def log_probs_of(hidden: torch.Tensor) -> torch.Tensor:
            # Ranked by the call's history-free processors too (top-k, top-p, ...): no node on a token the target
            # cannot emit. Filtered tokens score -inf; such nodes are kept invalid.
            logits = self.head.logits(hidden, vocab).float()
            if batch.processing.history_free:
                flat = logits.reshape(-1, vocab)
                logits = batch.processing(batch.token_ids, rows_t.repeat_interleave(len(flat) // num_rows),
                                          None, flat).view(logits.shape)
            return torch.log_softmax(logits, dim=-1)

        log_probs = log_probs_of(last)
        scores, tokens = log_probs.topk(width, dim=-1)  # the first level: [rows, width]
        cand_tokens, cand_scores = [tokens], [scores]
        cand_parents = [torch.full_like(tokens, -1)]
        frontier = torch.arange(width, device=device).expand(num_rows, -1)  # candidate index of each frontier node
        frontier_scores, frontier_in = scores, last[:, None].expand(-1, width, -1)
        num_entries = width * (depth - 1)  # head entries the frontiers add
        entry_ancestors = torch.zeros(num_rows, num_entries, num_entries, dtype=torch.bool, device=device)
        entry_positions = torch.zeros(num_rows, num_entries, dtype=torch.long, device=device)
        entry_of_candidate = torch.full((num_rows, width + (depth - 1) * width * width), -1, dtype=torch.long,
                                        device=device)
        entry_hidden = None
        rows_index = torch.arange(num_rows, device=device)[:, None]
        num_candidates = width
        for level in range(1, depth):  # feed the level's frontier, add its children (level + 1)
            first = (level - 1) * width
            fed = slice(first, first + width)
            parents = torch.cat(cand_parents, dim=1).gather(1, frontier)  # candidate index or -1 (the root)
            parent_entry = entry_of_candidate.gather(1, parents.clamp(min=0))
            own = torch.zeros(num_rows, width, num_entries, dtype=torch.bool, device=device)
            own[:, torch.arange(width, device=device), first + torch.arange(width, device=device)] = True
            inherited = entry_ancestors[rows_index, parent_entry.clamp(min=0)] & (parents >= 0)[:, :, None]
            entry_ancestors[:, fed] = own | inherited
            entry_positions[:, fed] = (real + level - 1)[:, None]
            entry_of_candidate.scatter_(1, frontier, first + torch.arange(width, device=device).expand(num_rows, -1))
            if level > 1:
                frontier_in = entry_hidden[rows_index, parent_entry]
            seen = first + width
            tree = TreeAttention(real, entry_positions[:, first:seen], entry_ancestors[:, fed, :seen],
                                 entry_positions[:, :seen])
            tokens = torch.cat(cand_tokens, dim=1).gather(1, frontier)
            out = self._runner.forward(rows, tokens, [width] * num_rows, num_logits=width, features=frontier_in,
                                       from_target=False, tree=tree)  # [rows, width, hidden]
            entry_hidden = out if entry_hidden is None else torch.cat([entry_hidden, out], dim=1)
            log_probs = log_probs_of(out)
            child_scores, child_tokens = log_probs.topk(width, dim=-1)  # [rows, width, width]
            child_scores = (frontier_scores[:, :, None] + child_scores).flatten(1)
            cand_tokens.append(child_tokens.flatten(1))
            cand_scores.append(child_scores)
            cand_parents.append(frontier[:, :, None].expand(-1, -1, width).flatten(1))
            frontier_scores, best = child_scores.topk(width, dim=-1)
            frontier = num_candidates + best
            num_candidates += width * width
        all_scores = torch.cat(cand_scores, dim=1)
        keep = min(num_nodes, num_candidates)
        order = torch.sort(all_scores, dim=-1, descending=True, stable=True).indices[:, :keep]
        chosen = order.sort(dim=-1).values  # candidate order is topological
        slot = torch.full((num_rows, num_candidates), -1, dtype=torch.long, device=device)
        slot.scatter_(1, chosen, torch.arange(keep, device=device).expand(num_rows, -1))
        parents = torch.cat(cand_parents, dim=1).gather(1, chosen)
        parents = torch.where(parents >= 0, slot.gather(1, parents.clamp(min=0)), -1)
        return DraftTree(torch.cat(cand_tokens, dim=1).gather(1, chosen), parents,
                         torch.isfinite(all_scores.gather(1, chosen)))

    def _consume_backlog(self, batch: SequenceBatch, rows: list[int], keep: set[int] = frozenset()) -> None:
        """A step without drafts. The head needs a row's states only to draft for it, and while adaptive k keeps
        drafting off (a compute-bound batch, where drafts do not pay) reading them would cost a head forward over
        every committed token of every row. So a row keeps only its newest `IDLE_WINDOW` states; once it holds more,
        its head cache starts again from that window (`_restart`), as a head with a sliding window would, and the
        head reads them when drafting resumes. Drafts made from a window may differ from a full-context head's;
        they are verified all the same, so the output does not. With `IDLE_WINDOW = None` the head keeps the whole
        context, reading the states in one forward once a row holds `IDLE_BACKLOG` of them. Rows in `keep` (drafting
        in this step) are left whole: the head reads all their states before it drafts."""
        pending = self._pending
        if pending is None:
            return
        if self.IDLE_WINDOW is not None:
            for row in pending.rows:
                if row not in keep and pending.count(row) > self.IDLE_WINDOW:
                    self._restart(row, pending.keep_last(row, self.IDLE_WINDOW))
            return
        if pending.most() < self.IDLE_BACKLOG:
            return
        take = self._with_states(rows)  # rows joining this step have none yet; inactive rows may hold some
        if take:
            self._catch_up(batch, take)
        self._real_lengths = None  # nothing was drafted: every entry the head now holds is the target's

    def _restart(self, row: int, start: int) -> None:
        """Empties `row`'s head cache, whose next entry is then the target's state at position `start`. Rotary
        position embeddings make attention depend on relative positions only, so entries keep their own positions
        relative to one another, counted from `start`. A cache already empty (restarted at an earlier idle step)
        only moves its offset."""
        if self._runner.length(row):
            self._runner.free(row)
            self._runner.add_sequence(row)
        self._offset[row] = start

    def _catch_up(self, batch: SequenceBatch, rows: list[int]) -> torch.Tensor:
        """Feeds the committed tokens whose target states arrived since the last step; returns the head's output at
        each row's newest entry, `[rows, hidden]`. Rows holding far more states than the rest (a newcomer's prompt
        beside rows that hold a few) go through the head in a forward of their own (`catch_up_groups`): one forward
        would pad every row's features to the widest row's."""
        runner, device = self._runner, batch.device
        counts = [self._pending.count(r) for r in rows]
        last, real_lengths = None, {}
        for group in catch_up_groups(counts):
            members = [rows[i] for i in group]
            features, num_states, starts = self._pending.take(members)
            offsets = [self._offset.get(r, 0) for r in members]
            if any(runner.length(r) + o != s for r, o, s in zip(members, offsets, starts)):
                raise RuntimeError("EAGLE head cache out of step with the target's states; this is a bug in "
                                   "hf_specdec")
            members_t = torch.tensor(members, device=device)
            # Entry p pairs the target's feature at p with the token at p + 1.
            token_ids = gather_right_aligned(batch.token_ids, members_t, batch.first_col[members_t] + torch.tensor(
                starts, device=device) + 1, torch.tensor(num_states, device=device), features.shape[1])
            # The head cache's lengths (positions in it: the target's, less the row's offset).
            real_lengths.update({r: s + n - o for r, s, n, o in zip(members, starts, num_states, offsets)})
            out = runner.forward(members, token_ids, num_states, num_logits=1, features=features,
                                 from_target=True)[:, -1]
            if len(group) == len(rows):
                last = out
            else:
                last = out.new_empty(len(rows), out.shape[-1]) if last is None else last
                last.index_copy_(0, torch.tensor(group, device=out.device), out)
        if not self._pending:
            self._pending = None
        self._real_lengths = [real_lengths[r] for r in rows]
        return last

    def commit(self, batch: SequenceBatch, num_accepted: list[int]) -> None:
        # Entries built from the head's own outputs go; the next step rebuilds them from the target's real states.
        if self._real_lengths is not None:
            for row, length in zip(self._rows, self._real_lengths):
                self._runner.rollback(row, length)
        self._real_lengths = None

    def admit(self, batch: SequenceBatch, rows: list[int]) -> None:
        for row in rows:
            self._runner.add_sequence(row)
            self._offset.pop(row, None)

    def release(self, rows: list[int]) -> None:
        for row in rows:
            self._runner.free(row)
            self._offset.pop(row, None)
        if self._pending is not None:  # a later request may reuse the row: none of these states are its
            self._pending.drop(rows)
            if not self._pending:
                self._pending = None

    def end(self) -> None:
        self._runner, self._pending, self._real_lengths, self._offset = None, None, None, {}


def _spread(draft: DraftProposal, rows: list[int], everyone: list[int]) -> DraftProposal:
    """`draft` for `rows`, as a proposal for `everyone` in which the others get none."""
    index = {r: i for i, r in enumerate(everyone)}
    at = torch.tensor([index[r] for r in rows], device=draft.token_ids.device)
    token_ids = draft.token_ids.new_full((len(everyone), draft.k), PAD_ID).index_copy_(0, at, draft.token_ids)
    num_tokens = draft.num_tokens.new_zeros(len(everyone)).index_copy_(0, at, draft.num_tokens)
    probs = None if draft.probs is None else draft.probs.new_zeros(
        (len(everyone), *draft.probs.shape[1:])).index_copy_(0, at, draft.probs)
    return DraftProposal(token_ids, num_tokens, probs)


def catch_up_groups(counts: list[int]) -> list[list[int]]:
    """Indices of `counts` (states each row holds) to feed the head together: all in one group, or, where that would
    be more than half padding, the rows holding more than the rest in a second group. The cheapest split by the
    padded entries each group feeds (its rows times its widest row's count) is taken."""
    order = sorted(range(len(counts)), key=counts.__getitem__)
    widths = [counts[i] for i in order]
    whole = len(widths) * (widths[-1] if widths else 0)
    best, cut = whole, None
    for n in range(1, len(widths)):  # the n rows holding least, then the others
        cost = n * widths[n - 1] + (len(widths) - n) * widths[-1]
        if cost < best:
            best, cut = cost, n
    if cut is None or best > whole / 2:
        return [list(range(len(counts)))]
    return [sorted(order[:cut]), sorted(order[cut:])]


class _PendingStates:
    """The target's states the head has not read yet, per row, kept as the steps delivered them (views of each step's
    `TargetHiddenStates`) and put together, right-aligned, only when the head reads them (`take`). Re-padding the
    whole pile at every step instead, to the widest row's (a newcomer's prompt), took about 13 ms of a 180 ms step at
    20 rows while drafting was off (docs/log/2026-11-28-benchmarks-history.md, "EAGLE's head while drafting is off
    (issue 25)")."""

    def __init__(self):
        self._start: dict[int, int] = {}  # row -> position of its first state held
        self._chunks: dict[int, list[torch.Tensor]] = {}  # row -> `[n, features]` pieces, oldest first
        self._count: dict[int, int] = {}
        self._like: torch.Tensor | None = None  # a states tensor: dtype, device and features of what `take` builds

    def __bool__(self) -> bool:
        return bool(self._start)

    @property
    def rows(self) -> list[int]:
        return list(self._start)

    def count(self, row: int) -> int:
        return self._count[row]

    def most(self) -> int:
        """The most states any row holds."""
        return max(self._count.values(), default=0)

    def add(self, hidden: TargetHiddenStates) -> None:
        """Appends a step's states; a row's continue where its held ones end (rows may hold none yet)."""
        self._like = hidden.states
        for i, (row, n, start) in enumerate(zip(hidden.rows, hidden.num_states, hidden.start_positions)):
            if row not in self._start:
                self._start[row], self._chunks[row], self._count[row] = start, [], 0
            if n:
                self._chunks[row].append(hidden.row(i))
                self._count[row] += n

    def take(self, rows: list[int]) -> tuple[torch.Tensor, list[int], list[int]]:
        """Removes `rows`' states and returns them padded, `[rows, width, features]` right-aligned (width: the most
        any of them has; padding is zeros), with the counts and start positions."""
        counts = [self._count.pop(r) for r in rows]
        starts = [self._start.pop(r) for r in rows]
        chunks = [c for r in rows for c in self._chunks.pop(r)]
        width, like = max(counts, default=0), self._like
        out = like.new_zeros(len(rows), width, like.shape[-1])
        if chunks:
            device = like.device
            counts_t = torch.tensor(counts, device=device)
            row_of = torch.repeat_interleave(torch.arange(len(rows), device=device), counts_t)
            first = torch.repeat_interleave(counts_t.cumsum(0) - counts_t, counts_t)  # each state's row's first index
            within = torch.arange(len(row_of), device=device) - first
            column = (width - counts_t)[row_of] + within
            out.view(-1, like.shape[-1]).index_copy_(0, row_of * width + column, torch.cat(chunks))
        return out, counts, starts

    def keep_last(self, row: int, n: int) -> int:
        """Drops all but `row`'s newest `n` states; returns the position of the first one kept."""
        chunks, extra = self._chunks[row], self._count[row] - n
        while extra > 0:
            if len(chunks[0]) <= extra:
                extra -= len(chunks[0])
                self._start[row] += len(chunks[0])
                self._count[row] -= len(chunks[0])
                chunks.pop(0)
            else:
                chunks[0] = chunks[0][extra:]
                self._start[row] += extra
                self._count[row] -= extra
                extra = 0
        return self._start[row]

    def drop(self, rows: list[int]) -> None:
        for row in rows:
            if row in self._start:
                del self._start[row], self._chunks[row], self._count[row]
