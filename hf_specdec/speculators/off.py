"""`speculator="off"`: hf_specdec's engine with speculation turned off."""

from __future__ import annotations

from ..decode.speculator import Speculator
from ..types import DraftProposal, SequenceBatch


class NoDraftSpeculator(Speculator):
    """Proposes nothing: every step feeds one token per row and keeps it, as plain greedy or sampled decoding does,
    through hf_specdec's engine (its paged KV cache, packed steps and this host's linear-layer forms). The output is
    what the target alone gives, like every speculator's; what it measures is the engine's own speed, apart from
    what speculation adds (`hf-specdec bench` reports both)."""

    drafts_are_free = True
    proposes_drafts = False

    def __repr__(self) -> str:
        return "NoDraftSpeculator()"

    def propose(self, batch: SequenceBatch, k: int) -> DraftProposal:
        return DraftProposal.empty(len(batch.active), batch.device)
