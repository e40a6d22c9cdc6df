"""Who is in the batch: requests wait, join the running batch when a slot is free (and, with a capped KV pool, their
worst-case blocks fit), and leave the moment they finish or are cancelled, their blocks back in the pool.

`Scheduler.step()` admits what fits, runs one `step.Step` over the rows in the batch, and reports each request's new
tokens. A one-call `generate` is a batch of requests that all arrive at once (`engine.SpeculativeEngine`); the server
feeds requests in from other threads (`serving.ServingEngine`).

Rows that join a batch already running get one step of their own first, without drafts: it feeds their prompts
(prefill) and gives speculators that draft from the target's hidden states (EAGLE, Medusa) the states of the prompt.
From then on they are verified together with the others. Rows that all arrive together skip it: their first step
feeds the prompts and verifies drafts proposed from them, as a one-call `generate` always did. So do rows joining a
running batch when the target takes packed steps (a newcomer's prompt then costs the others nothing in width) and
the speculator can join them there (`Speculator.joins_in_verify`: it proposes nothing for a row whose target states
have not arrived yet, as the EAGLE, Medusa and MLP heads do): their prompts go into the others' verify.

With `prefill_chunk`, a step feeds at most that many prompt tokens (chunked prefill): a longer prompt is fed in
pieces, in a forward of their own next to the others' step, until what is left fits and the row joins as above;
while requests run, newcomers join only as far as the budget goes. The others keep getting a token every step
instead of stalling for whole prompts, and a request arriving meanwhile starts without waiting for them all.
"""

from __future__ import annotations

from collections import deque

import torch

from ..metrics import SpeculativeMetrics
from ..runners.model_runner import TargetHiddenStates, committed_hidden_states
from ..types import SequenceBatch, gather_right_aligned
from .requests import Request
from .step import emitted_logprobs

# Prompt tokens per forward for a prompt whose log probabilities are reported (`Request.prompt_logprobs`): each
# position's logits are kept, `[tokens, vocab]` of them.
PROMPT_LOGPROBS_PIECE = 256


class Scheduler:
    """The running batch and the queue in front of it.

    Args:
        batch (`SequenceBatch`): the rows (slots) requests run in.
        target (`ModelRunner`): the target and its paged cache.
        step (`step.Step`): what one step does.
        stop (`StopRules`): EOS and stopping criteria.
        pad_token_id (`int`): written past each row's end.
        metrics (`SpeculativeMetrics`, *optional*): counts over everything this scheduler ran.
        max_num_blocks (`int`, *optional*): the target's KV pool cap; a request joins only when its worst case
            (prompt, max_new_tokens and a step's drafts) fits next to the worst cases of those running.
        collect_tokens (`bool`): keep each request's `output_ids` (and report new tokens per step). Off, only counts
            are kept and a step makes no host transfer beyond its own.
        prefix_cache (`PrefixCache`, *optional*): requests joining from the queue start from the stored keys and
            values of the longest prompt prefix seen before, and store their prompt's blocks after their first step.
        weigh_rows (`bool`): while no request waits, adaptive k weighs each row's tokens by the tokens it has left
            (`AdaptiveK.weigh`), so drafts go to the rows the remaining work waits for.
        prefill_chunk (`int`, *optional*): the most prompt tokens a step feeds (rounded up to whole KV blocks):
            longer prompts go in pieces, and while requests run newcomers share it (chunked prefill, see the module
            docstring); `None`: every prompt whole in its row's first step.
    """

    def __init__(self, batch: SequenceBatch, target, step, stop, pad_token_id: int,
                 metrics: SpeculativeMetrics | None = None, max_num_blocks: int | None = None,
                 collect_tokens: bool = True, prefix_cache=None, weigh_rows: bool = False,
                 prefill_chunk: int | None = None):
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 (None: whole prompts), got {prefill_chunk}")
        self.batch = batch
        self.target = target
        self.step_fn = step
        self.speculator = step.speculator
        self.stop = stop
        self.pad_token_id = pad_token_id
        self.metrics = metrics if metrics is not None else SpeculativeMetrics()
        self.max_num_blocks = max_num_blocks
        self.collect_tokens = collect_tokens
        self.prefix_cache = prefix_cache
        self.weigh_rows = weigh_rows
        self.prefill_chunk = prefill_chunk
        self.num_prefill_chunks = 0  # prompt pieces fed (chunked prefill)
        self._pieces: dict[int, tuple[int, list[torch.Tensor]]] = {}  # row -> first position, pieces' states
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.free_slots = list(range(len(batch.lengths)))[::-1]
        self._fresh: dict[int, None] = {}  # rows admitted but not yet fed, in order of admission
        self._reserved: dict[int, int] = {}  # row -> worst-case KV blocks
        self._refused: list[Request] = []  # ended as they left the queue: refused, or with nothing to do

    # --- the queue ---------------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def place(self, requests: list[Request], region_tokens: int | None = None) -> None:
        """Admits requests whose prompts are already in the batch, at their `slot`, before the speculator's `begin`
        (a one-call `generate`: `begin` sees them all in `batch.active`). `region_tokens`: give each row that much
        room up front, the rows' regions one after another in slot order (`ModelRunner.give_regions`)."""
        if region_tokens is not None and hasattr(self.target, "give_regions"):
            self.target.give_regions(sorted(request.slot for request in requests), region_tokens)
        for request in requests:
            self.free_slots.remove(request.slot)
            self._admit(request, announce=False)
        self.batch.active = sorted(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_blocks_in_use(self) -> int:
        return self.target.cache.manager.num_used_blocks

    def worst_case_blocks(self, num_prompt_tokens: int, max_new_tokens: int) -> int:
        return -(-(num_prompt_tokens + max_new_tokens + self._draft_tokens) // self.target.cache.manager.block_size)

    def max_request_tokens(self) -> int | None:
        """The most tokens (prompt + new) a request may hold and still be admitted under `max_num_blocks` (one block
        is the pool's scratch block); None without a cap."""
        if self.max_num_blocks is None:
            return None
        return (self.max_num_blocks - 1) * self.target.cache.manager.block_size - self._draft_tokens

    @property
    def _draft_tokens(self) -> int:  # room past a request's tokens for a step's drafts (and its bonus token)
        return max(self.step_fn.k, self.step_fn.tree_nodes or 0) + 1

    # --- one step ------------------------------------------------------------------------------------------------

    def step(self) -> list[tuple[Request, list[int], bool]]:
        """Admits what fits, runs one step, retires what finished. Returns `(request, new tokens, finished)` for every
        request that changed (new tokens only with `collect_tokens`)."""
        events = self._drop_cancelled()
        self._admit_waiting()
        events += [(request, [], True) for request in self._refused]
        self._refused.clear()
        if not self.running:
            return events
        batch, step = self.batch, self.step_fn
        step.timed = True
        chunked = self._feed_chunks()  # rows still reading a long prompt: a piece of it, and no step this time
        events += self._finish_scored(chunked)
        everyone = [r for r in sorted(self.running) if r not in chunked]
        if not everyone:
            return events
        joining = [r for r in sorted(self._fresh) if r not in chunked]
        # Rows joining a running batch are fed on their own first, or with the others (see the module docstring).
        mixed = self.target.packed and step.tree_nodes is None and step.speculator.joins_in_verify
        rows = joining if joining and len(joining) < len(everyone) and not mixed else everyone
        step.drafting = rows is everyone
        batch.active = rows
        sampling = batch.sampling
        if sampling is not None:
            # Every history a step reads: committed tokens, then up to k drafts (a model speculator's too).
            batch.do_sample = sampling.prepare(rows, batch.used_width(rows) + step.k + 1)
        budget = [self.running[r].max_new_tokens - self.running[r].num_generated for r in rows]
        if self.weigh_rows and step.policy is not None and step.drafting:
            step.policy.weigh(rows, None if self.waiting else budget)
        fed_prompts = [r for r in rows if r in self._fresh]
        if self._pieces:
            self._hand_over_pieces(fed_prompts)
        emitted, finished = step(batch, self.target, self.stop, budget, self.metrics, self.pad_token_id)
        for row in rows:
            self._fresh.pop(row, None)
        if self.prefix_cache is not None and fed_prompts:
            self._store_prefixes(fed_prompts, self.step_fn.last_states if self.prefix_cache.with_features else None)
        tokens = self._new_tokens(rows, emitted) if self.collect_tokens else [[] for _ in rows]
        # Rows whose grammar allowed no token this step: they end alone, with the reason (what they emitted, run
        # unconstrained, is dropped); the others go on.
        dead = step.constraints.take_dead_ends() if step.constraints is not None else {}
        done = set(finished)
        logprobs = step.last_logprobs
        for row, n, new in zip(rows, emitted, tokens):
            request = self.running[row]
            if row in dead:
                request.error, request.error_field, request.finish_reason = dead[row], "grammar", "error"
                events.append((request, [], True))
                continue
            request.num_generated += n
            request.output_ids += new
            if request.logprobs is not None:
                request.output_logprobs += logprobs.get(row, [])[:n]
            if sampling is not None:
                sampling.num_generated[row] = request.num_generated
            if row in done:
                request.finish_reason = "length" if request.num_generated >= request.max_new_tokens and not (
                    self._ended_by_rule(new) and not request.sampling.ignore_eos) else "stop"
            if n or row in done:
                events.append((request, new, row in done))
        self._retire(sorted(done | set(dead)))
        batch.active = sorted(self.running)
        return events

    def cancel(self, request: Request) -> None:
        """Marks a request cancelled; it leaves the batch (its blocks freed) at the next step."""
        request.cancelled = True

    # --- internals ---------------------------------------------------------------------------------------------

    def _feed_chunks(self) -> set[int]:
        """Chunked prefill: a step's prompt tokens, `prefill_chunk` at most (one block more for the oldest waiting
        prompt, so that it is never starved). While requests run, newcomers whose prompts fit join the step whole,
        oldest first, as far as the budget goes; what is left goes to the others, oldest first, as pieces ending on
        block boundaries, fed in a forward of their own. With nobody running yet, every prompt within the budget
        joins at once and only longer ones go in pieces. Prompts whose log probabilities are reported
        (`Request.prompt_logprobs`) always go in pieces, scored (`_score`), up to their last token. Returns the rows
        that sit this step out: those fed a piece, and those left waiting."""
        if not self._fresh:
            return set()
        target, batch = self.target, self.batch
        scoring = {r for r in self._fresh if self.running[r].prompt_logprobs is not None
                   and target.length(r) < batch.lengths[r] - 1}
        limit = self.prefill_chunk
        if limit is None:
            # Chunked prefill is off for this target (recurrent layers, the masked dense cache: a piece costs more
            # than its share), so a scored prompt goes whole, the oldest first, one a step (its logits are
            # `[prompt tokens, vocab]`).
            if scoring:
                row = next(r for r in self._fresh if r in scoring)
                cached = target.length(row)
                self._score([row], [batch.lengths[row] - 1 - cached], [cached])
            return scoring
        manager = getattr(getattr(target, "cache", None), "manager", None)
        block = manager.block_size if manager is not None else 1
        limit = -(-limit // block) * block  # whole blocks: the prefix cache stores whole blocks, with their states
        running = len(self.running) > len(self._fresh)  # streams a newcomer's prefill would hold up
        fresh = list(self._fresh)
        cached = {r: target.length(r) for r in fresh}
        pending = {r: batch.lengths[r] - cached[r] for r in fresh}
        budget, out = limit, set()
        for row in fresh:
            if row not in scoring and pending[row] <= limit and (not running or pending[row] <= budget):
                budget -= pending[row] if running else 0
                continue  # joins this step with its whole prompt (or what is left of it)
            out.add(row)
        rows, amounts = [], []
        for i, row in enumerate([r for r in fresh if r in out]):
            # A piece ending on a block boundary, never taking the last prompt token: its logits are the row's first
            # verify. The oldest gets a block at least (over the budget if need be), so it is never starved. A
            # scored prompt's last piece ends just before its last token, wherever that is.
            room = max(budget, block) if i == 0 else budget
            if row in scoring:
                room = min(room, max(PROMPT_LOGPROBS_PIECE, block))
            end = min(cached[row] + room, batch.lengths[row] - 1)
            amount = end - cached[row] if row in scoring and end == batch.lengths[row] - 1 else (
                end - end % block - cached[row])
            if amount >= 1:
                rows.append(row)
                amounts.append(amount)
                budget -= amount
        plain = [i for i, r in enumerate(rows) if r not in scoring]
        scored = [i for i, r in enumerate(rows) if r in scoring]
        if plain:
            self._feed([rows[i] for i in plain], [amounts[i] for i in plain], [cached[rows[i]] for i in plain])
        if scored:
            self._score([rows[i] for i in scored], [amounts[i] for i in scored], [cached[rows[i]] for i in scored])
        return out

    def _score(self, rows: list[int], amounts: list[int], cached: list[int]) -> None:
        """Feeds pieces of prompts whose log probabilities are reported, in one forward with logits at every position
        fed: position i's give prompt token i + 1's log probability (the target's raw log-softmax, with the
        requests' alternatives)."""
        batch = self.batch
        out = self._feed(rows, amounts, cached, logit_counts=amounts)
        width, rows_t = max(amounts), torch.tensor(rows, device=batch.device)
        first = batch.first_col[rows_t] + torch.tensor(cached, device=batch.device) + 1  # the tokens being scored
        cols = (first[:, None] + torch.arange(width, device=batch.device)).clamp(max=batch.token_ids.shape[1] - 1)
        tokens = batch.token_ids[rows_t[:, None], cols]
        wanted = {row: self.running[row].prompt_logprobs for row in rows}
        # Row i's positions come left-aligned (`logit_counts`): its tokens' logits are its first `amounts[i]` columns.
        # The log-softmax goes a slice of columns at a time (a whole prompt's, unchunked, may be long).
        for start in range(0, width, PROMPT_LOGPROBS_PIECE):
            end = start + PROMPT_LOGPROBS_PIECE
            entries = emitted_logprobs(out.logits[:, start:end], tokens[:, start:end], rows,
                                       [min(max(n - start, 0), PROMPT_LOGPROBS_PIECE) for n in amounts], wanted)
            for row, values in entries.items():
                self.running[row].prompt_token_logprobs += values

    def _finish_scored(self, rows) -> list[tuple[Request, list[int], bool]]:
        """Requests for a prompt's log probabilities alone (`max_new_tokens=0`) whose prompts are scored: they end
        here, without a step."""
        done = [r for r in rows if r in self.running and self.running[r].max_new_tokens == 0
                and self.target.length(r) >= self.batch.lengths[r] - 1]
        for row in done:
            self.running[row].finish_reason = "length"
        events = [(self.running[row], [], True) for row in done]
        self._retire(done)
        return events

    def _feed(self, rows: list[int], amounts: list[int], cached: list[int], logit_counts: list[int] | None = None):
        """Feeds `amounts[i]` more prompt tokens of `rows[i]` to the target's cache. A speculator reading the target's
        states gets those of the pieces when the row joins a step, ahead of that step's (`Step.prefix_states`, see
        `_hand_over_pieces`), as from a stored prefix: until then it has nothing to draft from for the row. The prefix
        cache stores each piece's whole blocks as they are fed."""
        batch, target, speculator = self.batch, self.target, self.speculator
        rows_t = torch.tensor(rows, device=batch.device)
        input_ids = gather_right_aligned(
            batch.token_ids, rows_t, batch.first_col[rows_t] + torch.tensor(cached, device=batch.device),
            torch.tensor(amounts, device=batch.device), max(amounts))
        wants_states = speculator.needs_hidden_states
        layers = tuple(speculator.hidden_state_layers) if wants_states else False
        # With `logit_counts` (scoring: every position), recurrent layers still keep only the state after the last.
        out = target.forward(rows, input_ids, amounts, num_logits=max(logit_counts) if logit_counts else 1,
                             output_hidden_states=layers, packed_states=wants_states, logit_counts=logit_counts,
                             state_window=1)
        self.num_prefill_chunks += len(rows)
        self.step_fn.timed = False  # the next step's timers may wait for this forward (a GPU runs it meanwhile)
        states = None
        if wants_states:
            states = committed_hidden_states(out.hidden_states, speculator.hidden_state_layers, rows, amounts,
                                             cached, amounts, getattr(out, "states_packed", False))
            for i, row in enumerate(rows):
                self._pieces.setdefault(row, (cached[i], []))[1].append(states.row(i))
        if self.prefix_cache is not None:
            self._store_prefixes(rows, states)
        return out

    def _hand_over_pieces(self, rows: list[int]) -> None:
        """The states of the pieces of rows joining this step, after a stored prefix's (if any), as one entry of
        `Step.prefix_states` each (concatenated once, here)."""
        for row in [r for r in rows if r in self._pieces]:
            first, pieces = self._pieces.pop(row)
            held = self.step_fn.prefix_states.get(row)
            if held is not None:
                first, pieces = held.start_positions[0], [held.row(0)] + pieces
            states = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            self.step_fn.prefix_states[row] = TargetHiddenStates(states[None], [len(states)], [first], [row])

    def _ended_by_rule(self, new: list[int]) -> bool:
        eos = self.stop.eos_token_ids
        if not new or eos is None:
            return False
        return new[-1] in set(eos.flatten().tolist())

    def _new_tokens(self, rows: list[int], emitted: list[int]) -> list[list[int]]:
        width = max(emitted, default=0)
        if width == 0:
            return [[] for _ in rows]
        batch = self.batch
        rows_t = torch.tensor(rows, device=batch.device)
        start = batch.first_col[rows_t] + torch.tensor([batch.lengths[r] - n for r, n in zip(rows, emitted)],
                                                       device=batch.device)
        cols = (start[:, None] + torch.arange(width, device=batch.device)).clamp(max=batch.token_ids.shape[1] - 1)
        picked = batch.token_ids[rows_t[:, None], cols].tolist()
        return [row[:n] for row, n in zip(picked, emitted)]

    def _drop_cancelled(self) -> list[tuple[Request, list[int], bool]]:
        events = []
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            request.finish_reason = "cancelled"
            events.append((request, [], True))
        gone = [row for row, r in self.running.items() if r.cancelled]
        for row in gone:
            self.running[row].finish_reason = "cancelled"
            events.append((self.running[row], [], True))
        self._retire(gone)
        return events

    def _admit_waiting(self) -> None:
        while self.waiting and self.free_slots:
            request = self.waiting[0]
            need = self.worst_case_blocks(len(request.prompt_ids), request.max_new_tokens)
            if self.max_num_blocks is not None and sum(self._reserved.values()) + need > self.max_num_blocks - 1:
                return  # first come, first served: it waits for blocks to come back
            self.waiting.popleft()
            if request.max_new_tokens == 0 and (request.prompt_logprobs is None or len(request.prompt_ids) < 2):
                request.finish_reason = "length"  # nothing to generate, nothing to score
                self._refused.append(request)
                continue
            # The lowest free slot: running rows stay packed at the front, where their KV regions (if the runner gave
            # the slots any) lie one after another and attention reads them in place.
            request.slot = min(self.free_slots)
            self.free_slots.remove(request.slot)
            try:
                self._write_prompt(request)
                self._admit(request, need)
                if self.prefix_cache is not None and request.prompt_logprobs is None:  # (a stored prefix has no
                    self._load_prefix(request)  # logits for the prompt's positions)
            except Exception as error:  # noqa: BLE001 - this request cannot run (a draft that cannot read its
                # prompt, say); it is refused alone and the batch runs on
                request.error = f"{type(error).__name__}: {error}"
                request.finish_reason = "error"
                self._refused.append(request)
                if request.slot in self.running:
                    self._retire([request.slot])
                else:
                    self.free_slots.append(request.slot)

    def _load_prefix(self, request: Request) -> None:
        """Starts a joining row from the stored prefix of its prompt: the target's cache then holds it, so the row's
        first step feeds only the rest (and the speculator gets the stored states first)."""
        length, states = self.prefix_cache.load(self.target.cache, request.slot, request.prompt_ids)
        if length and states is not None:
            self.step_fn.prefix_states[request.slot] = TargetHiddenStates(states[None], [length], [0], [request.slot])

    def _store_prefixes(self, rows: list[int], states: TargetHiddenStates | None) -> None:
        """Stores the prompt blocks of rows whose prompts a forward fed (a step, or a piece of chunked prefill), with
        the target's states there (`states`) when the speculator reads them."""
        index = {r: i for i, r in enumerate(states.rows)} if states is not None else {}
        for row in rows:
            prompt = self.running[row].prompt_ids
            if prompt is None:
                continue
            if states is None:
                self.prefix_cache.store(self.target.cache, row, prompt)
            elif row in index:
                i = index[row]
                self.prefix_cache.store(self.target.cache, row, prompt, states.row(i), states.start_positions[i])

    def _write_prompt(self, request: Request) -> None:
        batch, row = self.batch, request.slot
        ids = torch.tensor(request.prompt_ids, dtype=torch.long, device=batch.device)
        batch.token_ids[row] = self.pad_token_id
        batch.token_ids[row, : len(ids)] = ids
        batch.first_col[row] = 0
        batch.lengths[row] = len(ids)

    def _admit(self, request: Request, need: int | None = None, announce: bool = True) -> None:
        row = request.slot
        self.running[row] = request
        self._fresh[row] = None
        self._reserved[row] = need if need is not None else 0
        self.target.add_sequence(row, prompt_length=int(self.batch.lengths[row]))  # (its prompt, written already)
        if request.logprobs is not None:
            if self.step_fn.tree_nodes is not None:
                raise ValueError("log probabilities are not reported with draft trees; drop logprobs or serve "
                                 "without speculative_tree_nodes")
            self.step_fn.logprob_rows[row] = request.logprobs
        if self.stop.eos_token_ids is not None and (request.sampling.ignore_eos or self.stop.ignore_eos is not None):
            if self.stop.ignore_eos is None:
                self.stop.ignore_eos = torch.zeros(self.batch.token_ids.shape[0], dtype=torch.bool,
                                                   device=self.batch.device)
            self.stop.ignore_eos[row] = request.sampling.ignore_eos
        if self.batch.sampling is not None:
            start = self.batch.first_col[row]
            self.batch.sampling.set(row, request.sampling, start + self.batch.lengths[row], start)
        if self.step_fn.constraints is not None and request.grammar is not None:
            self.step_fn.constraints.admit(row, request.grammar)
        policy = self.step_fn.policy
        if policy is not None:  # a new request starts from the priors, not from its slot's previous occupant
            policy.accepted[row] = 0
            policy.tried[row] = 0
        if announce:
            self.speculator.admit(self.batch, [row])

    def _retire(self, rows: list[int]) -> None:
        # Finished rows leave the batch at once: their blocks return to the pool and they cost no more compute.
        if not rows:
            return
        for row in rows:
            self.target.free(row)
            self.running.pop(row)
            self._reserved.pop(row, None)
            self._fresh.pop(row, None)
            self.step_fn.prefix_states.pop(row, None)  # a row cancelled before its first step never read them
            self.step_fn.logprob_rows.pop(row, None)
            self._pieces.pop(row, None)
            self.free_slots.append(row)
        self.speculator.release(rows)
        if self.step_fn.constraints is not None:
            self.step_fn.constraints.release(rows)
