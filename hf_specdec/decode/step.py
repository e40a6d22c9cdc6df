"""What one step does: propose -> verify -> commit, for the rows the scheduler has in the batch.

Two kinds of step: chains (`Step.__call__`: up to k drafts per row, one forward over `[pending tokens, drafts]`)
and trees (`Step._tree_step`: a draft tree per row, verified in one forward with tree attention).

1. propose: the speculator returns up to k drafts per row (a padded `[rows, k]` tensor and per-row counts).
2. verify: one target forward over `[pending tokens, drafts]`, logits processors applied at every draft position
   with the history it would have had, then the verifier keeps the accepted drafts and adds a recovered or bonus token.
3. commit: cut each row's output at EOS, its length budget and the stopping criteria; write it into the batch; roll
   the target's cache back past rejected drafts (per row, O(1)); let the speculator roll back its own state.

A row's first step feeds its whole prompt (plus any drafts a speculator can already propose from it); later steps
feed the last committed token plus the drafts. So the target's cache always holds every committed token but the last.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..cache.layout import TreeAttention, host_to_device, ragged
from ..runners.model_runner import TargetHiddenStates, committed_hidden_states
from ..structured.constraints import RowConstraints
from ..types import PAD_ID, DraftProposal, DraftTree, gather_right_aligned
from .speculator import Speculator
from .verify import verify, verify_argmax, verify_tree


class Step:
    """One speculative step over `batch.active`.

    Args:
        speculator (`Speculator`): proposes drafts.
        num_speculative_tokens (`int`): k, the most drafts per row and step (a tree's depth).
        tree_nodes (`int`, *optional*): draft trees of up to this many nodes instead of chains.
        tree_branching (`int`): children a tree node may get.
        constraints (`RowConstraints`, *optional*): grammars or `prefix_allowed_tokens_fn` per row.
        policy (`AdaptiveK`, *optional*): chooses k per step; `None` drafts `num_speculative_tokens` every step.
    """

    def __init__(self, speculator: Speculator, num_speculative_tokens: int, tree_nodes: int | None = None,
                 tree_branching: int = 4, constraints: RowConstraints | None = None, policy=None):
        self.speculator = speculator
        self.k = num_speculative_tokens
        self.tree_nodes = tree_nodes
        self.tree_branching = tree_branching
        self.constraints = constraints
        self.policy = policy
        speculator.bind_policy(policy)  # None too: a speculator reused across calls forgets the last call's
        self.drafting = True  # False: a step that only feeds prompts (rows joining a running batch)
        self.timed = True  # False: the policy learns nothing from this step's timings (a prompt piece ran before it)
        # Rows whose prompt began with a stored prefix (`prefix.PrefixCache`): the target's states there, given
        # to the speculator ahead of the states of the row's first step. `last_states`: the states the last step
        # gave it.
        self.prefix_states: dict[int, TargetHiddenStates] = {}
        self.last_states: TargetHiddenStates | None = None
        # Rows reporting log probabilities (row -> alternatives per token, `Request.logprobs`), and what the last
        # step gave them: row -> one `(log probability, [(token, log probability), ...])` per emitted token.
        self.logprob_rows: dict[int, int] = {}
        self.last_logprobs: dict[int, list] = {}
        self._draft_forwards = 0  # the draft positions the latest proposal ran (a model speculator's forwards)
        self._draft_unread = 0.0  # the backlog it read first, in target tokens (`Speculator.unread`)

    def __call__(self, batch, target, stop, budget, metrics, pad_token_id) -> tuple[list[int], list[int]]:
        """One propose -> verify -> commit; returns tokens emitted per active row and the rows that finished."""
        if self.tree_nodes is not None:
            return self._tree_step(batch, target, stop, budget, metrics, pad_token_id)
        rows, rows_t = list(batch.active), batch.active_tensor()
        t0 = time.perf_counter()
        self.last_logprobs = {}
        self._recompute(batch, target, rows)
        drafting = self._drafting_budget(batch, target, rows, budget)
        proposed, classes, counts = self._propose(batch, drafting)
        if getattr(self.speculator, "reading_backlog", False):  # the draft read a long backlog: not a usual step
            self.timed = False
        draft, constrained = proposed, None
        if self.constraints:
            limit = self.k if self.drafting else 0
            constrained = self.constraints.constrain(batch, rows, draft,
                                                     [max(0, min(limit, b - 1)) for b in drafting])
            draft = constrained.draft
        draft = target.agree(draft)  # tensor parallelism: rank 0's drafts on every rank (runners/distributed.py)
        if draft is not proposed:  # the grammar's or rank 0's drafts: their counts
            counts = draft.num_tokens.tolist()
        t1 = time.perf_counter()
        k = draft.k
        end = batch.end_cols(rows)  # [rows] first column after each row's committed tokens
        if k:
            batch.token_ids[rows_t[:, None], end[:, None] + torch.arange(k, device=end.device)] = torch.where(
                draft.token_ids == PAD_ID, pad_token_id, draft.token_ids)

        # Each row feeds its pending tokens and its own drafts only: a row that drafts nothing feeds one token beside
        # a row verifying k (the runner packs such a step into one stream of real tokens).
        cached = [target.length(r) for r in rows]
        num_fed = [batch.lengths[r] - c + n for r, c, n in zip(rows, cached, counts)]
        # The step's per-row numbers from the host in one copy (each a copy of its own on a GPU).
        cached_t, counts_fed, budget_t = torch.tensor([cached, num_fed, budget], device=batch.device).unbind(0)
        start_cols = batch.first_col[rows_t] + cached_t
        input_ids = gather_right_aligned(batch.token_ids, rows_t, start_cols, counts_fed, max(num_fed))
        wants_states = self.speculator.needs_hidden_states
        # Nothing but the verify reads the scores (no grammar, log-probabilities or stopping criteria reading them).
        packable = constrained is None and not self.logprob_rows and not stop.custom
        lean = packable and not (batch.do_sample or batch.processing)  # and nothing but their argmax
        # Logits `[rows, k + 1, vocab]`, each row's from column 0: after its pending token, then each draft (past a
        # row's drafts, its last again). A packed step computes only those rows need and, `packable`, leaves them so:
        # `[1, K, vocab]`, `out.logit_index` saying which of them each `[rows, k + 1]` entry is.
        out = target.forward(rows, input_ids, num_fed, num_logits=k + 1, logit_counts=[n + 1 for n in counts],
                             output_hidden_states=self._hidden_layers(wants_states), packed_states=wants_states,
                             packed_logits=packable)
        if getattr(getattr(target, "graphs", None), "trial", False):  # compiled just now: not a step's usual time
            self.timed = False
        logits, index = out.logits, getattr(out, "logit_index", None)
        if index is not None:  # per kept position the NaN/inf check and the argmax or scores, read through `index`
            flat, shape = logits[0], (len(rows), k + 1)
            broken = non_finite_rows(flat).index_select(0, index).view(shape).any(-1)
            if lean:
                scores = None
                result = target.agree(verify_argmax(flat.argmax(-1).index_select(0, index).view(shape), draft))
            else:
                if batch.processing:  # once per kept position, with its own history
                    row_of, within = host_to_device(list(ragged(np.asarray(counts) + 1)), batch.device)
                    flat = batch.processing(batch.token_ids, rows_t[row_of], end[row_of] + within, flat)
                scores = flat.float()  # the rule reads the positions it needs through the index
                result = target.agree(verify(scores, draft, batch.do_sample, index=index.view(shape),
                                             **_row_sampling(batch, rows, k)))
        else:
            masked = constrained.mask(logits) if constrained is not None else logits
            if batch.processing:
                history = end[:, None] + torch.arange(k + 1, device=end.device)  # [rows, k + 1] history lengths
                scores = batch.processing(batch.token_ids, rows_t.repeat_interleave(k + 1), history.reshape(-1),
                                          masked.reshape(-1, logits.shape[-1])).view(logits.shape)
            else:  # no processors: the logits as they are (in float32, as processing returns them)
                scores = masked.float()
            sampling = _row_sampling(batch, rows, k)
            if constrained is not None and batch.do_sample:
                if "seeded" in sampling:  # a seeded row samples the target itself at a forbidden draft's position
                    sampling["seeded_logits"] = scores
                scores = constrained.residual(scores)
            result = target.agree(verify(scores, draft, batch.do_sample, **sampling))
            broken = non_finite_rows(logits)

        output = result.output_token_ids
        batch.token_ids[rows_t[:, None], end[:, None] + torch.arange(k + 1, device=end.device)] = torch.where(
            output == PAD_ID, pad_token_id, output)
        num_emit, finished = stop.apply(batch.token_ids, rows_t, end, output, result.num_accepted + 1,
                                        budget_t, scores)
        # NaN/inf logits would silently turn into arbitrary tokens; checked in the step's one host transfer.
        if draft.probs is not None:
            broken |= non_finite_rows(draft.probs)
        num_emit, num_accepted, num_drafted, finished = self._commit(
            batch, target, rows, [num_emit, result.num_accepted, draft.num_tokens, finished, broken],
            "the target or draft model" if draft.probs is not None else "the target model")
        # The target's forward and the verify, done once the commit's host transfer returned. What follows (a head
        # reading the committed tokens' states) is per committed token, not per draft: adaptive k does not price it.
        verified_s = time.perf_counter() - t1
        if self.logprob_rows:
            self.last_logprobs = emitted_logprobs(logits, output, rows, num_emit, self.logprob_rows)
        if constrained is not None:
            self.constraints.commit(rows, output, num_emit, finished)
            # The grammar's drafts were never the speculator's: it, adaptive k and the metrics see only its own.
            metrics.num_grammar_draft_tokens += sum(d - n for d, n in zip(num_drafted, constrained.num_speculated))
            metrics.num_grammar_tokens += sum(max(0, a - n) for a, n in zip(num_accepted, constrained.num_speculated))
            num_accepted = [min(a, n) for a, n in zip(num_accepted, constrained.num_speculated)]
            num_drafted = list(constrained.num_speculated)
        if wants_states:
            # Only tokens now committed have valid states: every one but the newest (its state comes next step).
            num_committed = [max(0, batch.lengths[r] - 1 - c) for r, c in zip(rows, cached)]
            if self.prefix_states:  # rows that joined from a stored prefix: its states come first
                for row in [r for r in rows if r in self.prefix_states]:
                    self.speculator.observe_hidden_states(self.prefix_states.pop(row))
            self.last_states = committed_hidden_states(
                out.hidden_states, self.speculator.hidden_state_layers, rows, num_fed, cached, num_committed,
                getattr(out, "states_packed", False))
            self.speculator.observe_hidden_states(self.last_states)
        self.speculator.commit(batch, num_accepted)
        metrics.record_step(num_drafted, num_accepted)
        metrics.record_proposing(t1 - t0, num_drafted)
        metrics.verify_time_s += time.perf_counter() - t1
        if self.policy is not None and self.drafting:
            self.policy.update(rows, num_drafted, num_accepted, classes)
            if self.policy.measured is not None and self.timed:  # the serving policy prices drafts by these timings
                # A packed step fed each row its own tokens; a padded one (or a compiled one) every row the widest
                # row's.
                fed, drafts = ((sum(num_fed), sum(counts)) if self.policy.packed else
                               (len(rows) * max(num_fed), len(rows) * max(counts)))
                self.policy.measured.observe(len(rows), fed, self.policy.context, drafts, verified_s)
            # A decode step (every row fed its pending token and its drafts: no prompt tokens) without a grammar.
            if (self.policy.returns is not None and self.timed and constrained is None
                    and sum(num_fed) - sum(counts) == len(rows)):
                self._observe_returns(rows, counts, num_accepted, self.policy.packed, time.perf_counter() - t0)
        return num_emit, [r for r, done in zip(rows, finished) if done]

    def _observe_returns(self, rows, counts, num_accepted, packed, seconds) -> None:
        """The whole step's time (proposing to the speculator's commit) and, with drafts, what the policy's model
        priced for them, for its per-batch-size correction (`returns.DraftReturns`)."""
        policy, drafted = self.policy, sum(counts)
        if not drafted and self._draft_forwards:  # forwards ran, nothing verified: not a plain step's time
            return
        priced = 0.0
        if drafted:
            # A packed target fed each row its own drafts; a padded one fed every row the widest row's.
            tokens = 1 + (drafted / len(rows) if packed else max(counts))
            priced = policy.priced_extra(len(rows), tokens, self._draft_forwards, policy.context, self._draft_unread)
        policy.returns.observe(len(rows), policy.context, seconds, priced, drafted, sum(num_accepted))

    def _tree_step(self, batch, target, stop, budget, metrics, pad_token_id) -> tuple[list[int], list[int]]:
        """One step with draft trees.

        The forward feeds each row's pending tokens and then its tree's n nodes, written to storage indices
        `L .. L + n - 1` (L: the row's committed length) but positioned by depth (`L + depth - 1`), each attending to
        the committed context and its own ancestors (`TreeAttention`). `verify_tree` walks the tree along the target's
        picks. The accepted nodes' keys and values are then moved to storage `L, L + 1, ...`, where a chain would
        have put them, and the cache is rolled back past them: later steps see an ordinary sequence.
        """
        rows, rows_t = list(batch.active), batch.active_tensor()
        device = batch.device
        t0 = time.perf_counter()
        self._recompute(batch, target, rows)
        drafting = self._drafting_budget(batch, target, rows, budget)
        max_depth = max(0, min(self.k, max(drafting) - 1)) if self.drafting else 0
        tree = target.agree(self.speculator.propose_tree(batch, max_depth, self.tree_nodes, self.tree_branching))
        n = tree.num_nodes
        if n == 0:
            max_depth = 0
        ancestors = tree.ancestors(max(max_depth, 1))  # the speculator drafts no deeper than max_depth
        depths = ancestors.sum(-1)
        # Never draft past a row's length budget: the last token a row may emit is always the target's own.
        limits = torch.tensor([max(0, b - 1) for b in drafting], device=device)
        tree = DraftTree(tree.token_ids, tree.parents, tree.valid & (depths <= limits[:, None]))
        t1 = time.perf_counter()

        cached = [target.length(r) for r in rows]
        pending = [batch.lengths[r] - c for r, c in zip(rows, cached)]
        width = max(pending)
        pending_ids = gather_right_aligned(batch.token_ids, rows_t, batch.first_col[rows_t] + torch.tensor(
            cached, device=device), torch.tensor(pending, device=device), width)
        input_ids = torch.cat([pending_ids, torch.where(tree.valid, tree.token_ids, pad_token_id)], dim=1)
        num_fed = [p + n for p in pending]
        q = width + n
        lengths = torch.tensor([batch.lengths[r] for r in rows], device=device)  # L: committed tokens per row
        offset = torch.arange(q, device=device)[None, :] - (q - torch.tensor(num_fed, device=device))[:, None]
        node_positions = lengths[:, None] + depths - 1
        positions = torch.cat([torch.tensor(cached, device=device)[:, None] + offset[:, :width].clamp(min=0),
                               node_positions], dim=1)
        region_mask = torch.cat([ancestors.new_zeros(len(rows), width, n), ancestors], dim=1)
        wants_states = self.speculator.needs_hidden_states
        out = target.forward(rows, input_ids, num_fed, num_logits=n + 1, output_hidden_states=self._hidden_layers(wants_states),
                             tree=TreeAttention(lengths, positions, region_mask, node_positions) if n else None)
        logits = out.logits  # [rows, n + 1, vocab]: after the root (the last pending token), then after each node
        end = batch.end_cols(rows)
        scores = self._tree_scores(batch, rows_t, end, tree, depths, ancestors, logits)
        if batch.sampling is not None:
            raise ValueError("per-request sampling settings are not supported with draft trees")
        result, path = target.agree(verify_tree(scores, tree, batch.do_sample, max_depth))

        output = result.output_token_ids  # [rows, max_depth + 1]
        span = end[:, None] + torch.arange(max_depth + 1, device=device)
        batch.token_ids[rows_t[:, None], span] = torch.where(output == PAD_ID, pad_token_id, output)
        path_scores = None
        if stop.custom:  # custom criteria get the scores that produced each output token
            entries = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1).clamp(min=0)
            path_scores = scores[torch.arange(len(rows), device=device)[:, None], entries]
        num_emit, finished = stop.apply(batch.token_ids, rows_t, end, output, result.num_accepted + 1,
                                        torch.tensor(budget, device=device), path_scores)
        broken = non_finite_rows(logits)
        counts = [num_emit, result.num_accepted, tree.valid.sum(-1), finished, broken]
        # Pack the accepted path: the node at depth d moves from storage L + path[d] to L + d.
        depth_index = torch.arange(max_depth, device=device)[None, :]
        moves = (path >= 0) & (path != depth_index)
        target.cache.move(target.cache.plan.block_tables, lengths[:, None] + path.clamp(min=0),
                          torch.where(moves, lengths[:, None] + depth_index, -1))
        num_emit, num_accepted, num_drafted, finished = self._commit(batch, target, rows, counts, "the target model")
        if wants_states:
            num_committed = [max(0, batch.lengths[r] - 1 - c) for r, c in zip(rows, cached)]
            for row in [r for r in rows if r in self.prefix_states]:  # a stored prefix's or prompt pieces' states
                self.speculator.observe_hidden_states(self.prefix_states.pop(row))
            self.speculator.observe_hidden_states(_tree_hidden_states(
                out.hidden_states, self.speculator.hidden_state_layers, rows, num_fed, pending, width, path,
                cached, num_committed))
        self.speculator.commit(batch, num_accepted)
        metrics.record_step(num_drafted, num_accepted)
        metrics.record_proposing(t1 - t0, num_drafted)
        metrics.verify_time_s += time.perf_counter() - t1
        return num_emit, [r for r, done in zip(rows, finished) if done]

    @staticmethod
    def _commit(batch, target, rows, counts, producer) -> tuple[list[int], ...]:
        """The step's one host transfer (`counts`: emitted, accepted, drafted, finished, broken per row); refuses
        NaN/inf logits (they would silently become arbitrary tokens), then extends each row and rolls the target's
        cache back to every committed token but the last. Returns the first four as lists."""
        num_emit, num_accepted, num_drafted, finished, broken = torch.stack([c.long() for c in counts]).tolist()
        if any(broken):
            raise FloatingPointError(
                f"{producer} produced NaN or inf logits for batch rows {[r for r, b in zip(rows, broken) if b]}; "
                "float16 overflow is the usual cause: load the model in bfloat16 or float32, or check its weights"
            )
        lengths = batch.lengths
        for row, count in zip(rows, num_emit):
            lengths[row] += count
        going = [row for row, done in zip(rows, finished) if not done]
        rollback_many = getattr(target, "rollback_many", None)
        if rollback_many is not None:
            rollback_many(going, [lengths[row] - 1 for row in going])
        else:
            for row in going:
                target.rollback(row, lengths[row] - 1)
        return num_emit, num_accepted, num_drafted, finished

    @staticmethod
    def _tree_scores(batch, rows_t, end, tree, depths, ancestors, logits):
        """Processed scores `[rows, n + 1, vocab]`; entry i + 1 (node i) has the history committed tokens + the
        path to node i, which logits processors that read `input_ids` get spelled out."""
        rows, n = tree.token_ids.shape
        flat = logits.reshape(-1, logits.shape[-1])
        entry_rows = rows_t.repeat_interleave(n + 1)
        if not batch.processing or batch.processing.history_free:
            return batch.processing(batch.token_ids, entry_rows, end.repeat_interleave(n + 1), flat).view(
                logits.shape)
        history = batch.token_ids[rows_t][:, None].repeat(1, n + 1, 1)  # [rows, n + 1, width]
        scratch = history.shape[-1] - 1  # the buffer's scratch column: non-ancestors write there
        cols = torch.where(ancestors, (end[:, None] + depths - 1)[:, None, :], scratch)  # [rows, n, n]
        history[:, 1:].scatter_(2, cols, torch.where(ancestors, tree.token_ids[:, None, :], 0))
        lens = torch.cat([end[:, None], end[:, None] + depths], dim=1)
        return batch.processing(history.flatten(0, 1), torch.arange(rows * (n + 1), device=flat.device),
                                lens.flatten(), flat, batch_rows=entry_rows).view(logits.shape)

    def _recompute(self, batch, target, rows: list[int]) -> None:
        """Rows at LongRoPE's switch, on a model whose `generate` feeds a sequence crossing it again with the long
        factors, are fed their cached tokens again first (`ModelRunner.recompute`, `rope.RopeRows`)."""
        due = target.recompute_due(rows)
        if not due:
            return
        due_t = torch.tensor(due, device=batch.device)
        width = target.length(due[0])  # every such row holds the same: the switch's position
        target.recompute(due, gather_right_aligned(batch.token_ids, due_t, batch.first_col[due_t],
                                                   torch.full((len(due),), width, device=batch.device), width))
        self.timed = False  # a forward over whole sequences: not a step the cost model should learn from

    @staticmethod
    def _drafting_budget(batch, target, rows: list[int], budget: list[int]) -> list[int]:
        """Each row's length budget for drafting: `budget`, or less where the target limits its drafts
        (`ModelRunner.draft_room`: a LongRoPE row verifies nothing past the switch before its recompute)."""
        room = target.draft_room(rows, batch.lengths)
        return budget if room is None else [min(b, r + 1) for b, r in zip(budget, room)]

    def _propose(self, batch, budget) -> tuple[DraftProposal, list[int] | None, list[int]]:
        """This step's drafts, each row's confidence class when adaptive k used one, and each row's number of
        drafts (on the host)."""
        # Never draft past a row's length budget: the last token a row may emit is always the target's own.
        limits = [max(0, b - 1) for b in budget]
        classes = None
        context = sum(batch.lengths[r] for r in batch.active)  # cached tokens, for the step-cost model
        if self.policy is not None:
            self.policy.context = context  # speculators that ask the policy while drafting read it there
        self._draft_forwards, self._draft_unread = 0, 0.0
        if not self.drafting:  # rows joining a running batch feed their prompts; speculators still track them
            return self._no_drafts(batch), None, [0] * len(budget)
        if self.policy is not None and self.speculator.drafts_are_free:
            depth = max(0, min(self.k, max(budget) - 1))
            if not depth:  # no row may draft (their budgets): recorded as a step with nothing on offer
                self.policy.choose_rows(batch.active, [0] * len(budget), context=context)
                return self._no_drafts(batch), None, [0] * len(budget)
            # After a step that verified nothing, look for proposals only where the likeliest ones could pay.
            if (not self.policy.chosen or self.policy.chosen[-1] == 0) and \
                    not self.policy.may_draft(batch.active, [min(depth, limit) for limit in limits], context):
                return self._no_drafts(batch), None, [0] * len(budget)
            # Proposals first, then k from what each row offers and how confident its proposal is.
            draft = self.speculator.propose(batch, depth)
            # A lookup's drafts cost no forwards; a hybrid's head says how many it ran, and what it read first.
            self._draft_forwards = getattr(self.speculator, "draft_forwards", 0)
            self._draft_unread = getattr(self.speculator, "draft_unread", 0.0)
            confidence = draft.confidence if draft.confidence is not None else torch.zeros_like(draft.num_tokens)
            # One small transfer; each row's budget is then applied on the host.
            offered, classes = torch.stack([draft.num_tokens, confidence.to(draft.num_tokens.dtype)]).tolist()
            offered = [min(o, limit) for o, limit in zip(offered, limits)]
            if self.policy.packed:  # each row feeds only its own drafts: each verifies as many as pay
                counts = self.policy.choose_rows(batch.active, offered, classes, context)
            else:  # rows are padded to the widest: one k for all
                k = self.policy.choose(batch.active, offered, classes, context)
                counts = [min(o, k) for o in offered]
            width = max(counts)
            num_tokens = torch.tensor(counts, device=batch.device)
        else:
            wanted = None  # the drafts per row chosen before drafting, for a speculator drafting for some rows only
            if self.policy is not None and self.policy.draft_subsets and self.policy.packed and \
                    self.speculator.drafts_row_subsets:
                # Rows the speculator cannot draft for this step (no states yet) are offered none.
                held = self.speculator.unread_rows(batch)
                offered = [0 if u is None else max(0, b - 1) for u, b in zip(held, budget)]
                backlog = [u or 0.0 for u in held] if self.policy.reads_backlog else None
                wanted = self.policy.choose_drafters(batch.active, offered, context, backlog)
                k = max(wanted)
                unread = sum(u for u, w in zip(backlog, wanted) if w) if backlog is not None else 0.0
            elif self.policy is not None:
                # A model speculator reads its backlog (states or tokens of idle steps, newcomers' prompts) before
                # its first draft: the policy prices that with the drafts.
                unread = self.speculator.unread(batch) if self.policy.reads_backlog else 0.0
                k = self.policy.choose(batch.active, context=context, unread=unread)
            else:
                k, unread = self.k, 0.0
            # Called even for k = 0: speculators track their rows.
            depth = max(0, min(k, max(budget) - 1))
            if wanted is not None and depth:
                draft = self.speculator.propose(batch, depth, rows=[r for r, w in zip(batch.active, wanted) if w])
            else:
                draft = self.speculator.propose(batch, depth)
            # The draft positions the speculator ran (a model's forwards), before any trimming below.
            self._draft_forwards = 0 if self.speculator.drafts_are_free else depth
            self._draft_unread = unread if self._draft_forwards else 0.0
            if not depth or draft.k == 0:  # nothing to verify (k = 0 chosen, or none offered): nothing to read back
                return self._none_of(draft), None, [0] * len(budget)
            num_tokens = torch.minimum(draft.num_tokens, torch.tensor([min(limit, k) for limit in limits],
                                                                      device=batch.device))
            if wanted is not None:
                num_tokens = torch.minimum(num_tokens, torch.tensor(wanted, device=num_tokens.device))
            # Each row's count must be known on the host to build the forward, hence one small transfer; draft
            # columns no row uses are dropped.
            counts = num_tokens.tolist()
            if self.policy is not None and self.policy.packed and len(counts) > 1 and wanted is None:
                # The drafts are made: each row verifies as many as its own acceptance makes worth their width.
                trimmed = self.policy.choose_rows(batch.active, counts, context=context, record=False)
                if trimmed != counts:
                    counts, num_tokens = trimmed, torch.tensor(trimmed, device=batch.device)
            width = max(counts)
        k = width
        token_ids = torch.where(torch.arange(k, device=batch.device) < num_tokens[:, None],
                                draft.token_ids[:, :k], PAD_ID)
        probs = draft.probs[:, :k] if draft.probs is not None else None
        return DraftProposal(token_ids, num_tokens, probs), classes, counts

    def _hidden_layers(self, wants_states: bool):
        # Only the entries the speculator reads come back (a packed step's stay its stream: `packed_states`).
        return tuple(self.speculator.hidden_state_layers) if wants_states else False

    def _no_drafts(self, batch) -> DraftProposal:
        return self._none_of(self.speculator.propose(batch, 0))

    @staticmethod
    def _none_of(draft: DraftProposal) -> DraftProposal:
        """A proposal of no drafts for every row, whatever `draft` offered."""
        if draft.k == 0:  # none offered: its counts are all 0 already
            return DraftProposal(draft.token_ids, draft.num_tokens, None)
        return DraftProposal(draft.token_ids[:, :0], torch.zeros_like(draft.num_tokens), None)


def emitted_logprobs(logits: torch.Tensor, output: torch.Tensor, rows: list[int], num_emit: list[int],
                     wanted: dict[int, int]) -> dict[int, list]:
    """Log probabilities of the tokens a chain step emitted, for the rows in `wanted` (row -> alternatives to list):
    row -> one `(log probability, [(token, log probability), ...])` per emitted token. Emitted token j of a row came
    from its logits column j (after its pending token and drafts `[:j]`), so these are the target's own, the same
    whether the token was a draft it accepted or one it picked; computed in float32 over the whole vocabulary."""
    picks = [i for i, (r, n) in enumerate(zip(rows, num_emit)) if n and r in wanted]
    if not picks:
        return {}
    index = torch.tensor(picks, device=logits.device)
    width = max(num_emit[i] for i in picks)
    logprobs = torch.log_softmax(logits[index, :width].float(), dim=-1)
    chosen = logprobs.gather(-1, output[index, :width].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    top = max(wanted[rows[i]] for i in picks)
    values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[..., :0], logprobs[..., :0].long())
    chosen, values, ids = chosen.tolist(), values.tolist(), ids.tolist()
    out = {}
    for j, i in enumerate(picks):
        n = wanted[rows[i]]
        out[rows[i]] = [(chosen[j][t], list(zip(ids[j][t][:n], values[j][t][:n]))) for t in range(num_emit[i])]
    return out


def non_finite_rows(values: torch.Tensor) -> torch.Tensor:
    """`[rows]` whether any of a row's values is NaN or infinite, from one sum per row (NaN and inf carry through
    a sum; a row of finite values would need a sum past the float32 range, 3e38, to be flagged). Several times
    cheaper than testing every value, which for a batch's logits cost about a millisecond per step on a CPU. A sum
    times 0 is 0 when finite and NaN otherwise: two ops, where `torch.isfinite` takes five."""
    total = values.flatten(1).sum(-1, dtype=torch.promote_types(values.dtype, torch.float32))
    return total * 0 != 0


def _row_sampling(batch, rows: list[int], k: int) -> dict:
    """`verify` arguments for a batch whose rows carry their own sampling settings (`SequenceBatch.sampling`)."""
    return {} if batch.sampling is None or not batch.do_sample else batch.sampling.verify_arguments(rows, k)


def _tree_hidden_states(hidden_states, layers, rows, num_fed, pending, width, path, start_positions,
                        num_committed) -> TargetHiddenStates:
    """The target's states of a tree step's newly committed tokens: each row's pending tokens, then its accepted
    nodes (node i was fed at column `width + i`), right-aligned like `committed_hidden_states`."""
    states = torch.cat([hidden_states[i] for i in layers], dim=-1) if len(layers) > 1 else hidden_states[layers[0]]
    q, device = states.shape[1], states.device
    out_width = max(max(num_committed), 1)
    keep = torch.tensor(num_committed, device=device)
    pend = torch.tensor(pending, device=device)
    index = (torch.arange(out_width, device=device)[None, :] - (out_width - keep)[:, None]).clamp(min=0)
    pending_cols = (q - torch.tensor(num_fed, device=device))[:, None] + index
    node = path.gather(1, (index - pend[:, None]).clamp(min=0, max=max(path.shape[1] - 1, 0))) if path.shape[1] \
        else torch.zeros_like(index)
    cols = torch.where(index < pend[:, None], pending_cols, width + node.clamp(min=0))
    picked = states[torch.arange(len(rows), device=device)[:, None], cols]
    return TargetHiddenStates(picked, list(num_committed), list(start_positions), list(rows))
