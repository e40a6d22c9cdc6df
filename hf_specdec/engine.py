"""The decode loop: propose -> verify -> commit, until every row has stopped.

There is no separate prefill: in the first step each row feeds its whole prompt (plus any drafts a speculator can
already propose from it), later steps feed the last committed token plus the drafts. So the target's cache always
holds every committed token but the last, and one code path serves both.

One step, for the active rows:
1. propose: the speculator returns up to k drafts per row (a padded `[rows, k]` tensor and per-row counts).
2. verify: one target forward over `[pending tokens, drafts]`, logits processors applied at every draft position
   with the history it would have had, then the verifier keeps the accepted drafts and adds a recovered or bonus token.
3. commit: cut each row's output at EOS, its length budget and the stopping criteria; write it into the batch; roll
   the target's cache back past rejected drafts (per row, O(1)); let the speculator roll back its own state.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import torch

from .adaptive import AdaptiveK, StepCost
from .calibration import adaptive_costs, host_linear, report_idle
from .block_manager import OutOfBlocksError
from .logits import LogitsProcessing
from .metrics import SpeculativeMetrics, logger
from .model_runner import ModelRunner, TargetHiddenStates, committed_hidden_states, paged_attention
from .speculators.base import Speculator
from .stopping import StopRules
from .paged_cache import TreeAttention
from .constraints import RowConstraints
from .types import PAD_ID, DraftProposal, DraftTree, SequenceBatch, gather_right_aligned
from .verify import verify, verify_tree


class SpeculativeEngine:
    """Runs one batched speculative `generate` call.

    Args:
        model (`PreTrainedModel`): the target.
        speculator (`Speculator`): proposes drafts.
        num_speculative_tokens (`int`): k, the most drafts per row and step.
        block_size (`int`): KV block size in tokens.
        max_num_blocks (`int`, *optional*): cap on the target's KV pool; a batch that cannot fit is refused.
        schedule (`str`): `"adaptive"` picks k in `[0, num_speculative_tokens]` each step from the acceptance seen so
            far (see `adaptive.py`); `"constant"` always drafts `num_speculative_tokens`.
        step_cost (`StepCost`, *optional*): adaptive k's model of a target forward's cost; defaults to the cached
            profile of this host (`calibration.py`), else one measured for the model's device type.
        tree_nodes (`int`, *optional*): draft trees instead of chains: the speculator proposes up to this many nodes
            per row, at most `num_speculative_tokens` deep, and one forward verifies them all (see `_tree_step`).
            Trees use a fixed shape: `schedule` must be `"constant"`.
        tree_branching (`int`): children a tree node may get (the speculator's top-k per expansion).
        calibration (`bool`): use this host's cached profile (measured costs, the small-row linear form), if any.
    """

    def __init__(self, model, speculator: Speculator, num_speculative_tokens: int, block_size: int = 16,
                 max_num_blocks: int | None = None, schedule: str = "adaptive", step_cost: StepCost | None = None,
                 tree_nodes: int | None = None, tree_branching: int = 4, calibration: bool = True):
        if schedule not in ("adaptive", "constant"):
            raise ValueError(f"speculative_schedule must be 'adaptive' or 'constant', got {schedule!r}")
        if tree_nodes is not None:
            if schedule != "constant":
                raise ValueError("draft trees have a fixed shape: use speculative_schedule='constant' with them")
            if not speculator.supports_trees:
                raise ValueError(f"{type(speculator).__name__} drafts chains only; drop speculative_tree_nodes= "
                                 "(draft trees need an EagleSpeculator)")
        self.model = model
        self.speculator = speculator
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.max_num_blocks = max_num_blocks
        self.schedule = schedule
        self.step_cost = step_cost
        self.tree_nodes = tree_nodes
        self.tree_branching = tree_branching
        self.calibration = calibration

    def generate(self, input_ids, attention_mask, max_new_tokens: int, do_sample: bool, logits_processor=None,
                 stopping_criteria=None, eos_token_ids=None, pad_token_id: int = 0, streamer=None,
                 constraints: RowConstraints | None = None):
        """Generates up to `max_new_tokens` per row.

        Args:
            input_ids: `[batch, prompt_width]` prompts, padded on either side as `attention_mask` says.
            attention_mask: `[batch, prompt_width]` or `None` (no padding).
            constraints: grammars or a `prefix_allowed_tokens_fn` constraining rows (`constraints.py`).
        Returns:
            `(sequences, metrics)`: `[batch, prompt_width + generated]` sequences as transformers returns them (the
            input, then generated tokens padded with `pad_token_id`), and the call's `SpeculativeMetrics`.
        """
        metrics = SpeculativeMetrics()
        start = time.perf_counter()
        self._constraints = constraints if constraints else None
        if self._constraints is not None and self.tree_nodes is not None:
            raise ValueError("grammar= and prefix_allowed_tokens_fn= are not supported with draft trees yet; drop "
                             "speculative_tree_nodes=")
        batch = self._make_batch(input_ids, attention_mask, max_new_tokens, do_sample, logits_processor, pad_token_id)
        self._check_pool_fits(batch.lengths, max_new_tokens)
        num_generated = [0] * len(batch.lengths)
        self._policy = None
        if self.schedule == "adaptive":  # costs are read from the cache, never timed here: seeded calls reproduce
            cost, draft_cost, cost_source = adaptive_costs(self.model, self.speculator, self.step_cost,
                                                           self.calibration)
            self._policy = AdaptiveK(len(batch.lengths), self.k, cost, draft_cost,
                                     priors=self.speculator.confidence_priors)
        stop = StopRules(stopping_criteria, eos_token_ids)
        target = ModelRunner(self.model, block_size=self.block_size, max_num_blocks=self.max_num_blocks)
        with ExitStack() as stack:
            stack.enter_context(paged_attention(self.model))
            stack.enter_context(host_linear(self.model, self.speculator, self.calibration))
            for row in batch.active:
                target.add_sequence(row)
            self.speculator.begin(self.model, batch)
            stack.callback(self.speculator.end)
            while batch.active and max_new_tokens > 0:
                budget = [max_new_tokens - num_generated[r] for r in batch.active]
                emitted, finished = self._step(batch, target, stop, budget, metrics, pad_token_id)
                for row, n in zip(list(batch.active), emitted):
                    num_generated[row] += n
                if streamer is not None:
                    streamer.put(batch.token_ids[0, batch.prompt_width + num_generated[0] - emitted[0]:
                                                 batch.prompt_width + num_generated[0]].cpu())
                self._retire(batch, target, finished)
                if self._constraints is not None:
                    self._constraints.release(finished)
        if streamer is not None:
            streamer.end()
        metrics.num_emitted_tokens = sum(num_generated)
        metrics.total_time_s = time.perf_counter() - start
        metrics.k_per_step = list(self._policy.chosen) if self._policy is not None else [self.k] * metrics.num_steps
        logger.info(metrics.summary())
        if self._policy is not None:
            report_idle(self._policy, self.model, self.speculator, cost_source)
        return self._sequences(input_ids, batch, num_generated, pad_token_id), metrics

    def _step(self, batch, target, stop, budget, metrics, pad_token_id) -> tuple[list[int], list[int]]:
        """One propose -> verify -> commit; returns tokens emitted per active row and the rows that finished."""
        if self.tree_nodes is not None:
            return self._tree_step(batch, target, stop, budget, metrics, pad_token_id)
        rows, rows_t = list(batch.active), batch.active_tensor()
        t0 = time.perf_counter()
        draft, classes = self._propose(batch, budget)
        constrained = None
        if self._constraints is not None:
            constrained = self._constraints.constrain(batch, rows, draft, [max(0, min(self.k, b - 1)) for b in budget])
            draft = constrained.draft
        t1 = time.perf_counter()
        k = draft.k
        end = batch.end_cols(rows)  # [rows] first column after each row's committed tokens
        batch.token_ids[rows_t[:, None], end[:, None] + torch.arange(k, device=end.device)] = torch.where(
            draft.token_ids == PAD_ID, pad_token_id, draft.token_ids)

        cached = [target.length(r) for r in rows]
        num_fed = [batch.lengths[r] - c + k for r, c in zip(rows, cached)]
        start_cols = batch.first_col[rows_t] + torch.tensor(cached, device=batch.device)
        counts_fed = torch.tensor(num_fed, device=batch.device)
        input_ids = gather_right_aligned(batch.token_ids, rows_t, start_cols, counts_fed, max(num_fed))
        wants_states = self.speculator.needs_hidden_states
        out = target.forward(rows, input_ids, num_fed, num_logits=k + 1, output_hidden_states=wants_states)
        logits = out.logits  # [rows, k + 1, vocab]
        masked = constrained.mask(logits) if constrained is not None else logits
        history = end[:, None] + torch.arange(k + 1, device=end.device)  # [rows, k + 1] history length per position
        scores = batch.processing(batch.token_ids, rows_t.repeat_interleave(k + 1), history.reshape(-1),
                                  masked.reshape(-1, logits.shape[-1])).view(logits.shape)
        if constrained is not None and batch.do_sample:
            scores = constrained.residual(scores)
        result = verify(scores, draft, batch.do_sample)

        output = result.output_token_ids
        batch.token_ids[rows_t[:, None], end[:, None] + torch.arange(k + 1, device=end.device)] = torch.where(
            output == PAD_ID, pad_token_id, output)
        num_emit, finished = stop.apply(batch.token_ids, rows_t, end, output, result.num_accepted + 1,
                                        torch.tensor(budget, device=end.device), scores)
        # NaN/inf logits would silently turn into arbitrary tokens; check them in the step's one host transfer.
        broken = ~torch.isfinite(logits).flatten(1).all(-1)
        if draft.probs is not None:
            broken |= ~torch.isfinite(draft.probs).flatten(1).all(-1)
        num_emit, num_accepted, num_drafted, finished = self._commit(
            batch, target, rows, [num_emit, result.num_accepted, draft.num_tokens, finished, broken],
            "the target or draft model" if draft.probs is not None else "the target model")
        if constrained is not None:
            self._constraints.commit(rows, output, num_emit, finished)
            # The grammar's drafts were never the speculator's: it, adaptive k and the metrics see only its own.
            metrics.num_grammar_draft_tokens += sum(d - n for d, n in zip(num_drafted, constrained.num_speculated))
            metrics.num_grammar_tokens += sum(max(0, a - n) for a, n in zip(num_accepted, constrained.num_speculated))
            num_accepted = [min(a, n) for a, n in zip(num_accepted, constrained.num_speculated)]
            num_drafted = list(constrained.num_speculated)
        if wants_states:
            # Only tokens now committed have valid states: every one but the newest (its state comes next step).
            num_committed = [max(0, batch.lengths[r] - 1 - c) for r, c in zip(rows, cached)]
            self.speculator.observe_hidden_states(committed_hidden_states(
                out.hidden_states, self.speculator.hidden_state_layers, rows, num_fed, cached, num_committed))
        self.speculator.commit(batch, num_accepted)
        metrics.record_step(num_drafted, num_accepted)
        metrics.draft_time_s += t1 - t0
        metrics.verify_time_s += time.perf_counter() - t1
        if self._policy is not None:
            self._policy.update(rows, num_drafted, num_accepted, classes)
        return num_emit, [r for r, done in zip(rows, finished) if done]

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
        max_depth = max(0, min(self.k, max(budget) - 1))
        tree = self.speculator.propose_tree(batch, max_depth, self.tree_nodes, self.tree_branching)
        n = tree.num_nodes
        if n == 0:
            max_depth = 0
        ancestors = tree.ancestors(max(max_depth, 1))  # the speculator drafts no deeper than max_depth
        depths = ancestors.sum(-1)
        # Never draft past a row's length budget: the last token a row may emit is always the target's own.
        limits = torch.tensor([max(0, b - 1) for b in budget], device=device)
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
        out = target.forward(rows, input_ids, num_fed, num_logits=n + 1, output_hidden_states=wants_states,
                             tree=TreeAttention(lengths, positions, region_mask, node_positions) if n else None)
        logits = out.logits  # [rows, n + 1, vocab]: after the root (the last pending token), then after each node
        end = batch.end_cols(rows)
        scores = self._tree_scores(batch, rows_t, end, tree, depths, ancestors, logits)
        result, path = verify_tree(scores, tree, batch.do_sample, max_depth)

        output = result.output_token_ids  # [rows, max_depth + 1]
        span = end[:, None] + torch.arange(max_depth + 1, device=device)
        batch.token_ids[rows_t[:, None], span] = torch.where(output == PAD_ID, pad_token_id, output)
        path_scores = None
        if stop.custom:  # custom criteria get the scores that produced each output token
            entries = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1).clamp(min=0)
            path_scores = scores[torch.arange(len(rows), device=device)[:, None], entries]
        num_emit, finished = stop.apply(batch.token_ids, rows_t, end, output, result.num_accepted + 1,
                                        torch.tensor(budget, device=device), path_scores)
        broken = ~torch.isfinite(logits).flatten(1).all(-1)
        counts = [num_emit, result.num_accepted, tree.valid.sum(-1), finished, broken]
        # Pack the accepted path: the node at depth d moves from storage L + path[d] to L + d.
        depth_index = torch.arange(max_depth, device=device)[None, :]
        moves = (path >= 0) & (path != depth_index)
        target.cache.move(target.cache.plan.block_tables, lengths[:, None] + path.clamp(min=0),
                          torch.where(moves, lengths[:, None] + depth_index, -1))
        num_emit, num_accepted, num_drafted, finished = self._commit(batch, target, rows, counts, "the target model")
        if wants_states:
            num_committed = [max(0, batch.lengths[r] - 1 - c) for r, c in zip(rows, cached)]
            self.speculator.observe_hidden_states(_tree_hidden_states(
                out.hidden_states, self.speculator.hidden_state_layers, rows, num_fed, pending, width, path,
                cached, num_committed))
        self.speculator.commit(batch, num_accepted)
        metrics.record_step(num_drafted, num_accepted)
        metrics.draft_time_s += t1 - t0
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
        for row, count, done in zip(rows, num_emit, finished):
            batch.lengths[row] += count
            if not done:
                target.rollback(row, batch.lengths[row] - 1)
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

    def _propose(self, batch, budget) -> tuple[DraftProposal, list[int] | None]:
        """This step's drafts, and each row's confidence class when adaptive k used one."""
        # Never draft past a row's length budget: the last token a row may emit is always the target's own.
        limits = torch.tensor([max(0, b - 1) for b in budget], device=batch.device)
        classes = None
        context = sum(batch.lengths[r] for r in batch.active)  # cached tokens, for the step-cost model
        if self._policy is not None and self.speculator.drafts_are_free:
            # Proposals first, then k from what each row offers and how confident its proposal is.
            draft = self.speculator.propose(batch, max(0, min(self.k, max(budget) - 1)))
            offered = torch.minimum(draft.num_tokens, limits)
            confidence = draft.confidence if draft.confidence is not None else torch.zeros_like(offered)
            offered, classes = torch.stack([offered, confidence.to(offered.dtype)]).tolist()  # one small transfer
            k = self._policy.choose(batch.active, offered, classes, context)
            width = max(min(o, k) for o in offered)
            num_tokens = torch.minimum(draft.num_tokens, limits.clamp(max=k))
        else:
            k = self._policy.choose(batch.active, context=context) if self._policy is not None else self.k
            # Called even for k = 0: speculators track their rows.
            draft = self.speculator.propose(batch, max(0, min(k, max(budget) - 1)))
            num_tokens = torch.minimum(draft.num_tokens, limits.clamp(max=k))
            # Drop draft columns no row uses, so the verify forward is no wider than needed (this width must be known
            # on the host to build the forward, hence one small transfer).
            width = int(num_tokens.max())
        k = width
        token_ids = torch.where(torch.arange(k, device=batch.device) < num_tokens[:, None],
                                draft.token_ids[:, :k], PAD_ID)
        probs = draft.probs[:, :k] if draft.probs is not None else None
        return DraftProposal(token_ids, num_tokens, probs), classes

    def _retire(self, batch, target, finished: list[int]) -> None:
        # Finished rows leave the batch at once: their blocks return to the pool and they cost no more compute.
        if finished:
            for row in finished:
                target.free(row)
            self.speculator.release(finished)
            done = set(finished)
            batch.active = [r for r in batch.active if r not in done]

    def _check_pool_fits(self, prompt_lengths: list[int], max_new_tokens: int) -> None:
        # Refuse before starting, so a batch that cannot fit never leaves other rows half-generated.
        if self.max_num_blocks is None:
            return
        extra = max(self.k, self.tree_nodes or 0)  # a step's drafts are written before they are verified
        worst = sum(-(-(n + max_new_tokens + extra) // self.block_size) for n in prompt_lengths)
        if worst > self.max_num_blocks - 1:
            raise OutOfBlocksError(
                f"this batch may need {worst} KV blocks of {self.block_size} tokens but the pool is capped at "
                f"{self.max_num_blocks - 1}; lower the batch size or max_new_tokens, or raise max_num_blocks"
            )

    def _make_batch(self, input_ids, attention_mask, max_new_tokens, do_sample, logits_processor, pad_token_id):
        rows, width = input_ids.shape
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.device)
        lengths = mask.sum(-1)
        if (lengths == 0).any():
            empty = (lengths == 0).nonzero().flatten().tolist()
            raise ValueError(f"rows {empty} of the batch have empty prompts (attention_mask all 0); give every row "
                             "at least one token")
        # Left-pack each row's real tokens against column `width`, as transformers' left padding would.
        buffer = torch.full((rows, width + max_new_tokens + self.k + 2), pad_token_id, dtype=torch.long,
                            device=input_ids.device)
        first_col = width - lengths
        cols = first_col[:, None] + mask.long().cumsum(-1) - 1
        cols = torch.where(mask.bool(), cols, buffer.shape[1] - 1)  # padding goes to a scratch column
        buffer.scatter_(1, cols, input_ids)
        buffer[:, -1] = pad_token_id
        vocab = self.model.config.get_text_config().vocab_size
        return SequenceBatch(buffer, first_col, lengths.tolist(), list(range(rows)), width, do_sample,
                             LogitsProcessing(logits_processor), vocab)

    @staticmethod
    def _sequences(input_ids, batch, num_generated, pad_token_id):
        longest = max(num_generated, default=0)
        generated = batch.token_ids[:, batch.prompt_width: batch.prompt_width + longest]
        generated_count = torch.tensor(num_generated, device=generated.device)
        keep = torch.arange(longest, device=generated.device)[None, :] < generated_count[:, None]
        return torch.cat([input_ids, torch.where(keep, generated, pad_token_id)], dim=1)


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
