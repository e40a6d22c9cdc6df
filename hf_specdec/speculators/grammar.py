"""`speculator="grammar"`: no speculator of its own; the grammar's forced tokens are the drafts."""

from __future__ import annotations

from .off import NoDraftSpeculator


class GrammarSpeculator(NoDraftSpeculator):
    """Drafts nothing itself. With `grammar=` (or `prefix_allowed_tokens_fn=`), every run of positions where the
    constraint allows exactly one token (`{"name": "`, closing brackets, ...) is drafted and verified in one forward
    (see `structured/constraints.py`), so constrained output needs fewer target forwards than plain constrained
    decoding; adaptive k weighs those drafts like any speculator's."""

    proposes_drafts = True
    # It drafts only tokens the grammar forces, which are always accepted: verify long runs of them.
    default_num_speculative_tokens = 16
    needs_constraint = True

    def __repr__(self) -> str:
        return "GrammarSpeculator()"
