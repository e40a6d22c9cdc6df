"""`speculator="grammar"`: no speculator of its own; the grammar's forced tokens are the drafts."""

from __future__ import annotations

from ..types import DraftProposal, SequenceBatch
from ..decode.speculator import Speculator


class GrammarSpeculator(Speculator):
    """Drafts nothing itself. With `grammar=` (or `prefix_allowed_tokens_fn=`), every run of positions where the
    constraint allows exactly one token (`{"name": "`, closing brackets, ...) is drafted and verified in one forward
    (see `structured/constraints.py`), so constrained output needs fewer target forwards than plain constrained
    decoding."""

    drafts_are_free = True
    needs_constraint = True

    def __repr__(self) -> str:
        return "GrammarSpeculator()"

    def propose(self, batch: SequenceBatch, k: int) -> DraftProposal:
        return DraftProposal.empty(len(batch.active), batch.device)
