"""n-gram lookup where the text repeats, an EAGLE head everywhere else: one speculator for both kinds of prompt."""

from __future__ import annotations

import torch

from ..decode.speculator import Speculator
from ..types import PAD_ID, DraftProposal, SequenceBatch
from .eagle import EagleSpeculator
from .ngram import NgramSpeculator


class HybridSpeculator(Speculator):
    """Per row and step: the n-gram lookup's proposal when the row's recent context matches an earlier passage at
    least `min_match` tokens long, else `head_tokens` drafts from the EAGLE head.

    A row copying from its prompt (a quote, a code edit) matches long and its lookup drafts are accepted far more
    often than a head's, at no cost; in free text the lookup finds nothing useful and the head drafts. The head runs
    only in steps where some row needs it, and always catches up on every committed token, so it is in step whichever
    proposer drafted.

    Adaptive k keeps acceptance per confidence class: the lookup's classes (the match length), then one class for the
    head's drafts. Drafts are made before k is chosen (`drafts_are_free`): the head's drafts are already paid for
    when k is chosen, so they are weighed as free there, and `head_tokens` bounds what they cost. With a packed
    verify the head runs only in steps where adaptive k would verify some of its drafts and they would pay for its
    forwards (`AdaptiveK.drafting_pays`).

    Args:
        head (`EagleSpeculator`): the head that drafts where the lookup does not.
        ngram (`NgramSpeculator`, *optional*): the lookup (default `NgramSpeculator()`).
        min_match (`int`): shortest matched context for which a row takes the lookup's proposal.
        head_tokens (`int`): drafts the head proposes per row and step (a chain).
    """

    drafts_are_free = True
    default_num_speculative_tokens = 10  # as the lookup's (`NgramSpeculator`)
    needs_hidden_states = True
    joins_in_verify = True

    def __init__(self, head: EagleSpeculator, ngram: NgramSpeculator | None = None, min_match: int = 3,
                 head_tokens: int = 2):
        if not isinstance(head, EagleSpeculator):
            raise TypeError(f"HybridSpeculator needs an EagleSpeculator as head, got {type(head).__name__}; load one "
                            "with EagleSpeculator.from_pretrained(DIR or hf_specdec.trained_head(NAME))")
        ngram = NgramSpeculator() if ngram is None else ngram
        if not isinstance(ngram, NgramSpeculator):
            raise TypeError(f"HybridSpeculator's ngram must be an NgramSpeculator, got {type(ngram).__name__}")
        longest = len(ngram.confidence_priors) - 1  # the lookup reports match lengths up to this (its top class)
        if not ngram.min_ngram <= min_match <= longest:
            raise ValueError(f"min_match must lie in {ngram.min_ngram}-{longest}, the match lengths the lookup "
                             f"reports, got {min_match}")
        if head_tokens < 1:
            raise ValueError(f"head_tokens must be at least 1, got {head_tokens}")
        self.head, self.ngram = head, ngram
        self.min_match, self.head_tokens = min_match, head_tokens
        self.head_class = len(ngram.confidence_priors)
        self._policy = None
        self.confidence_priors = (*ngram.confidence_priors, head.confidence_priors[0])

    def __repr__(self) -> str:
        return (f"HybridSpeculator({self.head!r}, {self.ngram!r}, min_match={self.min_match}, "
                f"head_tokens={self.head_tokens})")

    @property
    def hidden_state_layers(self) -> tuple[int, ...]:
        return self.head.hidden_state_layers

    def validate(self, target) -> None:
        self.head.validate(target)
        self.ngram.validate(target)

    def bind_policy(self, policy) -> None:
        self._policy = policy

    def begin(self, target, batch: SequenceBatch) -> None:
        for part in (self.ngram, self.head):  # the head's forwards compile
            part.graph_settings, part.graph_switches = self.graph_settings, self.graph_switches
        self.ngram.begin(target, batch)
        self.head.begin(target, batch)

    def observe_hidden_states(self, hidden) -> None:
        self.head.observe_hidden_states(hidden)

    @torch.no_grad()
    def propose(self, batch: SequenceBatch, k: int) -> DraftProposal:
        lookup = self.ngram.propose(batch, k)
        self.draft_forwards, self.draft_unread = 0, 0.0
        if k == 0:
            self.head.propose(batch, 0)  # keeps the head's row bookkeeping; it drafts nothing
            return lookup
        copying = (lookup.num_tokens > 0) & (lookup.confidence >= self.min_match)
        # One host read per step: whether the head has to run at all (it costs a forward per draft).
        offered, classes = torch.stack([lookup.num_tokens.clamp(max=k), lookup.confidence]).tolist()
        copies = [n > 0 and c >= self.min_match for n, c in zip(offered, classes)]
        head_k = 0 if all(copies) else min(k, self.head_tokens)
        policy = self._policy
        # The states the head reads before drafting, where the policy counts them.
        unread = self.head.unread(batch) if head_k and policy is not None and policy.reads_backlog else 0.0
        if head_k and policy is not None and policy.packed:
            # Only where adaptive k would verify some of the head's drafts, and they beat the lookup's alone by more
            # than the head's forwards cost (at a large batch, drafts of the head's acceptance often do not).
            alternative = [n if c else head_k for n, c in zip(offered, copies)]
            kinds = [cls if c else self.head_class for cls, c in zip(classes, copies)]
            if not policy.drafting_pays(batch.active, offered, classes, alternative, kinds, head_k, unread=unread):
                head_k = 0
        drafted = self.head.propose(batch, head_k)
        # The head's forwards this step and what it read first (`Step` prices them for adaptive k's check).
        self.draft_forwards, self.draft_unread = drafted.k, unread if drafted.k else 0.0
        if drafted.k == 0:  # every row copies, or the head has no states yet (the first step): the lookup alone
            return lookup
        width = max(lookup.k, drafted.k)
        token_ids = torch.where(copying[:, None], _pad(lookup.token_ids, width), _pad(drafted.token_ids, width))
        num_tokens = torch.where(copying, lookup.num_tokens, drafted.num_tokens)
        confidence = torch.where(copying, lookup.confidence, self.head_class)
        probs = None
        if drafted.probs is not None:  # sampling: the lookup's drafts are point masses
            vocab = drafted.probs.shape[-1]
            point = torch.nn.functional.one_hot(_pad(lookup.token_ids, width).clamp(min=0), vocab).to(
                drafted.probs.dtype)
            head_probs = torch.nn.functional.pad(drafted.probs, (0, 0, 0, width - drafted.k))
            probs = torch.where(copying[:, None, None], point, head_probs)
        return DraftProposal(token_ids, num_tokens, probs, confidence)

    def commit(self, batch: SequenceBatch, num_accepted: list[int]) -> None:
        self.ngram.commit(batch, num_accepted)
        self.head.commit(batch, num_accepted)

    def admit(self, batch: SequenceBatch, rows: list[int]) -> None:
        self.ngram.admit(batch, rows)
        self.head.admit(batch, rows)

    def release(self, rows: list[int]) -> None:
        self.ngram.release(rows)
        self.head.release(rows)

    def end(self) -> None:
        self.ngram.end()
        self.head.end()


def _pad(token_ids: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(token_ids, (0, width - token_ids.shape[1]), value=PAD_ID)
