"""Medusa heads, and what every speculator that drafts from the target's final hidden state shares.

A head of this family reads one vector per row: the target's final hidden state (after its norm) at the last
position whose state is known. After a verify that is position L - 2 of a row of L committed tokens: the newest
token, at L - 1, was sampled from that very state by the target's LM head, so a head that "predicts i + 1 tokens
ahead" from it predicts the token at L + i, i.e. draft i + 1. The heads keep no KV cache and nothing to roll back.

Medusa (FasterDecoding/Medusa): head i is `num_layers` residual blocks `x + SiLU(linear(x))` and its own LM head;
heads are independent of the drafted tokens, so a step of k drafts runs heads 0 .. k - 1 on the same state. Our
format (tensors, config) is written by `hf_specdec.convert_head` and read in `hf_specdec/speculators/head_format.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..decode.speculator import Speculator, sample_or_argmax
from ..types import PAD_ID, DraftProposal, SequenceBatch
from .head_format import load_head_dir
from .heads import check_head_target


class FinalStateSpeculator(Speculator):
    """Drafts a chain of up to `max_speculative_tokens` tokens per row from the target's final hidden state.

    Subclasses give a `head` module with `start(state) -> carry` and `stage(i, carry, token) -> (carry, logits)`:
    stage i drafts token i + 1 from the carry and the token before it (the newest committed token for stage 0).
    Greedy calls draft the argmax; sampling calls sample from the processed logits and pass the draft_probs to the
    verifier, so the output is exactly the target's in both cases.

    Args:
        head (`nn.Module`): the head, built from our format's config.
    """

    needs_hidden_states = True
    joins_in_verify = True
    #: Our format's kind (`head_config.json`), the module class built from it and the tensors (names and shapes) a
    #: config of that kind holds; set by each subclass.
    kind: str = ""
    head_class: type[nn.Module]
    expected_tensors: Callable[[dict], dict[str, tuple[int, ...]]]

    def __init__(self, head: nn.Module):
        self.head = head.eval()
        self.config = head.config
        self._states: torch.Tensor | None = None  # [batch, hidden] each row's newest known target state
        self._known: torch.Tensor | None = None  # [batch] bool: the row's state is its current request's
        self._seen = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_speculative_tokens={self.max_speculative_tokens})"

    @property
    def max_speculative_tokens(self) -> int:
        """The most drafts per step (the number of heads or stages); a larger k is capped to it."""
        return self.head.num_stages

    @property
    def hidden_state_layers(self) -> tuple[int, ...]:
        """Which `output_hidden_states` entry of the target the head reads: the final (normed) state."""
        return tuple(self.config["target_hidden_states"]["layers"])

    @classmethod
    def from_pretrained(cls, path: str | Path):
        """Loads a head converted to our format by `hf_specdec.convert_head` (`hf-specdec convert-head`)."""
        config, tensors = load_head_dir(path, cls.kind, cls.expected_tensors)
        head = cls.head_class(config)
        head.load_state_dict({n: t.float() if t.is_floating_point() else t for n, t in tensors.items()})
        return cls(head)

    def validate(self, target) -> None:
        check_head_target(target, self.config["target"], self.kind)

    def relative_cost(self, target) -> float:
        return self.head.stage_numel() / target.num_parameters()

    def begin(self, target, batch: SequenceBatch) -> None:
        self.head.to(device=batch.device, dtype=target.dtype)  # where the target's states arrive (not target.device:
        width = self.config["target"]["hidden_size"]  # `meta` when offloaded to disk)
        self._states = torch.zeros(len(batch.lengths), width, device=batch.device, dtype=target.dtype)
        self._known = torch.zeros(len(batch.lengths), dtype=torch.bool, device=batch.device)
        self._seen = False

    def admit(self, batch: SequenceBatch, rows: list[int]) -> None:
        # A joining row may be fed inside the others' verify: until its first state arrives it gets no drafts (the
        # slot's state is its previous request's).
        self._known[torch.tensor(rows, device=self._known.device)] = False

    def observe_hidden_states(self, hidden) -> None:
        """Keeps each row's newest committed state (`TargetHiddenStates.newest`)."""
        device = self._states.device
        rows = torch.tensor(hidden.rows, device=device)
        fresh = torch.tensor(hidden.num_states, device=device) > 0  # a row with none keeps the state it had
        self._states[rows] = torch.where(fresh[:, None], hidden.newest().to(self._states.dtype),
                                         self._states[rows])
        self._known[rows] |= fresh
        self._seen = True

    @torch.no_grad()
    def propose(self, batch: SequenceBatch, k: int) -> DraftProposal:
        k = min(k, self.max_speculative_tokens)
        rows = list(batch.active)
        if k == 0 or not self._seen:  # the first step has no target state yet
            return DraftProposal.empty(len(rows), batch.device)
        rows_t = batch.active_tensor()
        end = batch.end_cols(rows)  # column of the first draft; the newest committed token is at end - 1
        carry = self.head.start(self._states[rows_t])
        token = batch.token_ids[rows_t, end - 1]
        tokens, probs = [], []
        for i in range(k):
            carry, logits = self.head.stage(i, carry, token)
            scores = batch.processing(batch.token_ids, rows_t, end + i, logits[..., :batch.target_vocab_size])
            token, token_probs = sample_or_argmax(scores, batch.do_sample)
            batch.token_ids[rows_t, end + i] = token  # scratch column: later positions' processors read it
            tokens.append(token)
            probs.append(token_probs)
        draft_probs = torch.stack(probs, dim=1) if batch.do_sample else None
        num_tokens = torch.where(self._known[rows_t], k, 0)
        token_ids = torch.where(num_tokens[:, None] > 0, torch.stack(tokens, dim=1), PAD_ID)
        return DraftProposal(token_ids, num_tokens, draft_probs)

    def end(self) -> None:
        self._states, self._known, self._seen = None, None, False


def expected_tensors(config: dict) -> dict[str, tuple[int, ...]]:
    """Our format's tensors for a Medusa config: name -> shape (`draft_to_target` is int64, the rest float)."""
    medusa = config["medusa"]
    hidden, draft_vocab = medusa["hidden_size"], medusa["draft_vocab_size"]
    tensors: dict[str, tuple[int, ...]] = {}
    for i in range(medusa["num_heads"]):
        for j in range(medusa["num_layers"]):
            tensors[f"blocks.{i}.{j}.weight"] = (hidden, hidden)
            if medusa["fc_bias"]:
                tensors[f"blocks.{i}.{j}.bias"] = (hidden,)
        if not medusa["shared_lm_head"]:
            tensors[f"lm_heads.{i}.weight"] = (draft_vocab, hidden)
    if medusa["shared_lm_head"]:
        tensors["lm_head.weight"] = (draft_vocab, hidden)
    if draft_vocab != config["target"]["vocab_size"]:
        tensors["draft_to_target"] = (draft_vocab,)
    return tensors


class MedusaHeads(nn.Module):
    """Medusa heads in our format: head i maps the target's final state to logits for the token i + 2 ahead of it.

    Args:
        config (`dict`): the contents of our format's `head_config.json` (kind `"medusa"`).
    """

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        medusa = config["medusa"]
        hidden, draft_vocab = medusa["hidden_size"], medusa["draft_vocab_size"]
        self.num_stages = medusa["num_heads"]
        self.vocab_size = config["target"]["vocab_size"]
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden, hidden, bias=medusa["fc_bias"]) for _ in range(medusa["num_layers"]))
            for _ in range(self.num_stages))
        if medusa["shared_lm_head"]:
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(hidden, draft_vocab, bias=False) for _ in range(self.num_stages))
        if draft_vocab != self.vocab_size:
            self.register_buffer("draft_to_target", torch.zeros(draft_vocab, dtype=torch.long))
        else:
            self.draft_to_target = None

    def lm(self, i: int) -> nn.Linear:
        return self.lm_head if self.config["medusa"]["shared_lm_head"] else self.lm_heads[i]

    def start(self, state: torch.Tensor) -> torch.Tensor:
        return state

    def stage(self, i: int, state: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head i on `state` `[rows, hidden]`; returns `(state, logits [rows, vocab])` (heads ignore `token`)."""
        x = state
        for linear in self.blocks[i]:
            x = x + nn.functional.silu(linear(x))
        draft_logits = self.lm(i)(x)
        if self.draft_to_target is None:
            return state, draft_logits
        # Tokens outside the draft vocabulary can never be drafted: their logits are -inf.
        logits = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab_size), float("-inf"))
        return state, logits.index_copy_(-1, self.draft_to_target, draft_logits)

    def stage_numel(self) -> int:
        """Weights one draft multiplies by: one head's blocks and its LM head."""
        return sum(p.numel() for p in self.blocks[0].parameters()) + self.lm(0).weight.numel()


class MedusaSpeculator(FinalStateSpeculator):
    """Drafts with Medusa heads: draft i + 1 is head i's top-1 (or sample) from the target's final hidden state.

    Chains only (no tree): a step drafts up to `num_heads` tokens; a larger `num_speculative_tokens` is capped.

    Args:
        head (`MedusaHeads`): the heads; `MedusaSpeculator.from_pretrained(path)` builds them from our format.
    """

    kind = "medusa"
    head_class = MedusaHeads
    expected_tensors = staticmethod(expected_tensors)
