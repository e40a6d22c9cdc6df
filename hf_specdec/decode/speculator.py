"""The one interface every speculator implements; the engine knows nothing else about them."""

from __future__ import annotations

import torch

from ..runners.graphed import GraphSettings, requested_settings
from ..types import DraftProposal, DraftTree, SequenceBatch
from .verify import sample_unnormalized


class Speculator:
    """Proposes draft tokens for the rows of a `SequenceBatch`.

    The engine calls, per `generate` call: `begin(target, batch)`, then per step `propose(batch, k)` followed by
    `commit(batch, num_accepted)`, `release(rows)` for rows that finished, `admit(batch, rows)` for rows that join
    (a server's requests), and `end()`. A speculator owns only its
    own state (a draft model's KV cache, say) and rolls it back in `commit`.
    """

    #: The engine passes the target's hidden states from the verify pass only to speculators that ask.
    needs_hidden_states: bool = False
    #: Which of the target's hidden states to pass (indices into transformers' `output_hidden_states` tuple: 0 is
    #: the embeddings, i the output of layer i - 1); read only when `needs_hidden_states`.
    hidden_state_layers: tuple[int, ...] = ()
    #: Drafting costs next to nothing (a lookup, no model): the engine asks for `num_speculative_tokens` drafts each
    #: step and then chooses how many to verify from what each row offers and its proposal's confidence class.
    drafts_are_free: bool = False
    #: Proposes drafts at all: False only for `speculator="off"` (`NoDraftSpeculator`), which the engine runs without
    #: adaptive k.
    proposes_drafts: bool = True
    #: `propose(batch, k, rows=...)` drafts for the given rows only (the others get none and keep what they have
    #: not read yet): adaptive k can then choose which rows a model speculator drafts for (`AdaptiveK.choose_drafters`)
    #: and pay its forwards and its backlog for those rows alone.
    drafts_row_subsets: bool = False
    #: `propose_tree` is implemented: the engine can verify draft trees (`generate(..., speculative_tree_nodes=N)`).
    supports_trees: bool = False
    #: The most drafts a row verifies per step when `generate` is not given `num_speculative_tokens`.
    default_num_speculative_tokens: int = 5
    #: Acceptance assumed for each confidence class (`DraftProposal.confidence`) before a call has any evidence.
    confidence_priors: tuple[float, ...] = (0.6,)

    def modules(self) -> list[torch.nn.Module]:
        """The modules this speculator runs (a draft model, a head), found in its attributes and its parts'; empty for
        one that runs no module (n-gram lookup). Its measured draft cost is cached under their fingerprints."""
        found = []
        for value in vars(self).values():
            if isinstance(value, torch.nn.Module):
                found.append(value)
            elif isinstance(value, Speculator):
                found += value.modules()
        return found

    @property
    def joins_in_verify(self) -> bool:
        """Rows joining a running batch may be fed their prompts inside the others' verify (packed steps): the
        speculator then proposes nothing for a row it has nothing to draft from yet (no target states). One that
        cannot says False, and such rows get a step of their own first. By default only speculators that do not
        read the target's states join this way."""
        return not self.needs_hidden_states

    # How the speculator's own model forwards compile (`runners/graphed.py`), as the call's switches ask; set by the
    # engine before `begin`. None: eagerly. `graph_switches`: the device type those settings are for and the call's
    # generation config (its switches), for a model on another kind of device (`graph_settings_on`).
    graph_settings: GraphSettings | None = None
    graph_switches: tuple | None = None

    def graph_settings_on(self, device: torch.device) -> GraphSettings | None:
        """How the speculator's own model compiles on `device`: as the target's where that is the same kind of
        device, else as the call's switches ask there (a draft on the CPU beside a CUDA target stays eager by
        default; one on a GPU beside a CPU target records CUDA graphs)."""
        if self.graph_switches is None or device.type == self.graph_switches[0]:
            return self.graph_settings
        return requested_settings(device, self.graph_switches[1])

    def begin(self, target, batch: SequenceBatch) -> None:
        """Prepares per-call state. `target` is the model being decoded."""

    def propose(self, batch: SequenceBatch, k: int) -> DraftProposal:
        """Returns up to `k` drafts for each row of `batch.active` (in that order)."""
        raise NotImplementedError

    def propose_tree(self, batch: SequenceBatch, depth: int, num_nodes: int, branching: int) -> DraftTree:
        """Returns a draft tree per row of `batch.active`: at most `num_nodes` nodes, none deeper than `depth`, a
        node having at most `branching` children. Only speculators with `supports_trees` implement it."""
        raise NotImplementedError(f"{type(self).__name__} does not draft trees")

    def admit(self, batch: SequenceBatch, rows: list[int]) -> None:
        """Rows joining the batch after `begin` (continuous batching): their prompts are in `batch`. Speculators with
        per-row state start it here. Their first step feeds their prompts, inside the others' verify where the target
        takes packed steps and `joins_in_verify`, else in a step of their own without drafts."""

    def observe_hidden_states(self, hidden) -> None:
        """Called after each verify, before `commit`, when `needs_hidden_states`: the target's hidden states at
        `hidden_state_layers` for each active row's newly committed tokens (a `model_runner.TargetHiddenStates`).
        Read a row's states with `hidden.row(i)` and the newest of each with `hidden.newest()`: after a packed step
        `hidden.states` is ragged (`[sum(num_states), features]`, rows one after another), not `[rows, width, ...]`."""

    def commit(self, batch: SequenceBatch, num_accepted: list[int]) -> None:
        """Called after verification with the accepted drafts per active row; `batch.lengths` is already updated."""

    def release(self, rows: list[int]) -> None:
        """Rows that finished: free anything held for them."""

    def end(self) -> None:
        """Frees per-call state."""

    def validate(self, target) -> None:
        """Raises a clear error if this speculator cannot serve `target`."""

    def bind_policy(self, policy) -> None:
        """Called with the call's adaptive k (`AdaptiveK`, or None without one) before `begin`: a speculator whose
        drafts are free for the policy but cost something to make (the hybrid's head) can ask it whether they
        would be verified."""

    def relative_cost(self, target) -> float:
        """Cost of drafting one token relative to one target decode step (adaptive k weighs drafts with it)."""
        return 0.0

    def unread_rows(self, batch: SequenceBatch) -> list[float | None]:
        """`unread`, per row of `batch.active`: what drafting for that row alone would read first; `None` for a row
        it cannot draft for this step (an EAGLE head holds no states yet for a row joining in this step)."""
        return [0.0] * len(batch.active)

    def unread(self, batch: SequenceBatch) -> float:
        """What this speculator must read before it can draft for `batch.active` this step, in target tokens: the
        committed tokens (or target states) it has not processed yet beyond each row's newest one (which the first
        draft's forward reads anyway, priced with the drafts), weighed by its cost per token relative to the
        target's. A model speculator reads lazily (nothing while adaptive k keeps drafting off), so the first
        drafting step after a stretch without drafts, or after requests joined, reads the backlog; adaptive k
        prices it with the drafts. 0 for speculators that read nothing (a lookup), and by default: a backlog priced
        must stay bounded while drafting is off (an EAGLE head keeps `IDLE_WINDOW` states a row), or its price
        would keep drafting off for good. A draft model's is not (every token since it last drafted, a newcomer's
        whole prompt), so it is not priced."""
        return 0.0


def sample_or_argmax(scores: torch.Tensor, do_sample: bool, generator=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens `[n]` from processed scores `[n, vocab]`, and the draft_probs they were sampled from (or None)."""
    if not do_sample:
        return scores.argmax(-1), None
    probs = torch.softmax(scores, dim=-1)
    return sample_unnormalized(probs, generator), probs
