"""EAGLE speculator: chain drafting with an EAGLE-1/2 or EAGLE-3 head that reads the target's hidden states.

An entry of the head's sequence pairs the target's feature at position p with the token at p + 1; the head's output
there stands in for the target's feature at p + 1, so its logits predict the token at p + 2. Each step the head first
catches up on the committed tokens whose target features the last verify pass produced (one forward, ragged rows),
which yields the first draft, then feeds its own outputs back for the next k - 1 drafts. Entries built from its own
outputs are rolled back after verification: the next step recomputes them from the target's real features. The
head's keys and values live in a `PagedKVCache` run by a `ModelRunner`, like a draft model's. The head modules and
our checkpoint format are in `heads.py`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..model_runner import ModelRunner, TargetHiddenStates
from ..types import DraftProposal, SequenceBatch, gather_right_aligned
from .base import Speculator, sample_or_argmax
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

    def __init__(self, head: EagleHead, block_size: int = 16):
        self.head = head.eval()
        self.config = head.config
        self.block_size = block_size
        self._runner: ModelRunner | None = None
        self._pending: TargetHiddenStates | None = None
        self._rows: list[int] = []
        self._real_lengths: list[int] | None = None

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

    def begin(self, target, batch: SequenceBatch) -> None:
        self.head.to(device=target.device, dtype=target.dtype)
        self.head.bind(target)
        self._runner = ModelRunner(self.head, block_size=self.block_size)
        for row in batch.active:
            self._runner.add_sequence(row)
        self._pending, self._real_lengths = None, None

    def observe_hidden_states(self, hidden: TargetHiddenStates) -> None:
        """Receives the target's states of newly committed tokens (called by the engine after each verify)."""
        self._pending = hidden if self._pending is None else _append_states(self._pending, hidden)

    @torch.no_grad()
    def propose(self, batch: SequenceBatch, k: int) -> DraftProposal:
        rows = list(batch.active)
        self._rows, self._real_lengths = rows, None
        if k == 0 or self._pending is None:  # nothing to draft from yet (first step): keep the states for later
            return DraftProposal.empty(len(rows), batch.device)
        rows_t = batch.active_tensor()
        features, num_states, starts = _select_rows(self._pending, rows)
        features = features[:, features.shape[1] - max(num_states):]  # rows that left may have been the widest
        self._pending = None
        runner = self._runner
        if any(runner.length(r) != s for r, s in zip(rows, starts)):
            raise RuntimeError("EAGLE head cache out of step with the target's states; this is a bug in hf_specdec")
        # Entry p pairs the target's feature at p with the token at p + 1.
        token_ids = gather_right_aligned(batch.token_ids, rows_t, batch.first_col[rows_t] + torch.tensor(
            starts, device=batch.device) + 1, torch.tensor(num_states, device=batch.device), features.shape[1])
        self._real_lengths = [s + n for s, n in zip(starts, num_states)]
        end = batch.end_cols(rows)  # column of the first draft
        tokens, probs = [], []
        hidden = runner.forward(rows, token_ids, num_states, num_logits=1, features=features, from_target=True)
        for j in range(k):
            last = hidden[:, -1]  # right-aligned: every row's newest entry
            logits = self.head.logits(last, batch.target_vocab_size)
            scores = batch.processing(batch.token_ids, rows_t, end + j, logits)
            token, token_probs = sample_or_argmax(scores, batch.do_sample)
            batch.token_ids[rows_t, end + j] = token  # scratch column: later positions' processors read it
            tokens.append(token)
            probs.append(token_probs)
            if j + 1 < k:
                hidden = runner.forward(rows, token[:, None], [1] * len(rows), num_logits=1,
                                        features=last[:, None], from_target=False)
        draft_probs = torch.stack(probs, dim=1) if batch.do_sample else None
        return DraftProposal(torch.stack(tokens, dim=1), torch.full((len(rows),), k, device=batch.device),
                             draft_probs)

    def commit(self, batch: SequenceBatch, num_accepted: list[int]) -> None:
        # Entries built from the head's own outputs go; the next step rebuilds them from the target's real states.
        if self._real_lengths is not None:
            for row, length in zip(self._rows, self._real_lengths):
                self._runner.rollback(row, length)
        self._real_lengths = None

    def release(self, rows: list[int]) -> None:
        for row in rows:
            self._runner.free(row)

    def end(self) -> None:
        self._runner, self._pending, self._real_lengths = None, None, None


def _select_rows(hidden: TargetHiddenStates, rows: list[int]) -> tuple[torch.Tensor, list[int], list[int]]:
    index = {r: i for i, r in enumerate(hidden.rows)}
    picks = [index[r] for r in rows]
    states = hidden.states[torch.tensor(picks, device=hidden.states.device)] if picks != list(
        range(len(hidden.rows))) else hidden.states
    return states, [hidden.num_states[i] for i in picks], [hidden.start_positions[i] for i in picks]


def _append_states(old: TargetHiddenStates, new: TargetHiddenStates) -> TargetHiddenStates:
    """States not consumed yet (a step that drafted nothing) followed by the next step's, per row, right-aligned."""
    old_states, old_counts, starts = _select_rows(old, new.rows)
    totals = [a + b for a, b in zip(old_counts, new.num_states)]
    width, old_width = max(totals), old_states.shape[1]
    device = new.states.device
    old_c, new_c = torch.tensor(old_counts, device=device), torch.tensor(new.num_states, device=device)
    offset = (torch.arange(width, device=device)[None, :] - (width - old_c - new_c)[:, None]).clamp(min=0)
    cols = torch.where(offset < old_c[:, None], old_width - old_c[:, None] + offset,
                       old_width + new.states.shape[1] - new_c[:, None] + offset - old_c[:, None])
    both = torch.cat([old_states, new.states], dim=1)
    merged = both[torch.arange(len(new.rows), device=device)[:, None], cols]
    return TargetHiddenStates(merged, totals, starts, list(new.rows))
