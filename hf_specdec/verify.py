"""Verification: which drafts the target keeps, and the token that follows them.

Greedy: accept while the draft equals the target argmax; the first mismatching argmax is the recovered token; when
every draft matches, the argmax after them is the bonus token. Identical to plain greedy decoding.

Sampling (Leviathan et al., arXiv 2211.17192): accept draft d at a position iff `draft_prob(d) > 0` and
`target_prob(d) / draft_prob(d) >= u`, u ~ U[0, 1) drawn in float64 (float32 can give exactly 0). At the first
rejection sample a recovered token from `max(target_probs - draft_probs, 0)`; if all are accepted sample a bonus token
from the target at the next position. A deterministic speculator's draft is a point mass (draft_prob = 1 at d), so
the recovered distribution is target_probs with d removed. The output is distributed exactly as the target's.

Sampling from an unnormalised distribution w uses argmax(w / E), E ~ Exp(1): no normalisation pass, no host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .types import PAD_ID, DraftProposal, VerifyResult


def verify(target_logits: torch.Tensor, draft: DraftProposal, do_sample: bool,
           generator: torch.Generator | None = None) -> VerifyResult:
    """Verifies a ragged batch of drafts against processed target logits.

    Args:
        target_logits: `[rows, k + 1, vocab]` processed float32 target logits; position j scores the token after
            `j` drafts (so position `num_tokens[i]` is row i's bonus position).
        draft: the proposal; `draft.token_ids` is `[rows, k]`.
        do_sample: sample (rejection sampling) or greedy.
        generator: random generator; the global one when `None` (so `torch.manual_seed` makes runs reproducible).
    """
    k = draft.k
    positions = torch.arange(k + 1, device=target_logits.device)
    in_draft = positions[:k][None, :] < draft.num_tokens[:, None]  # [rows, k]
    draft_ids = draft.token_ids.clamp(min=0)
    if do_sample:
        num_accepted, next_token = _rejection_sample(target_logits, draft, draft_ids, in_draft, generator)
    else:
        target_argmax = target_logits.argmax(-1)  # [rows, k + 1]
        matches = (draft_ids == target_argmax[:, :k]) & in_draft
        num_accepted = matches.long().cumprod(-1).sum(-1)
        next_token = target_argmax.gather(1, num_accepted[:, None]).squeeze(1)
    output = torch.cat([draft_ids, draft_ids.new_zeros(len(draft_ids), 1)], dim=1)
    output = output.scatter(1, num_accepted[:, None], next_token[:, None])
    output = torch.where(positions[None, :] <= num_accepted[:, None], output, PAD_ID)
    return VerifyResult(output, num_accepted)


def _rejection_sample(target_logits, draft, draft_ids, in_draft, generator):
    rows, k = draft_ids.shape
    target_probs = torch.softmax(target_logits, dim=-1)  # [rows, k + 1, vocab]
    vocab = target_probs.shape[-1]
    draft_probs = draft.probs
    if draft_probs is not None and draft_probs.shape[-1] != vocab:  # a draft with a smaller (unpadded) vocabulary
        draft_probs = F.pad(draft_probs[..., :vocab], (0, max(0, vocab - draft_probs.shape[-1])))

    target_p = target_probs[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1).double()  # [rows, k]
    if draft_probs is None:
        draft_p = torch.ones_like(target_p)
    else:
        draft_p = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1).double()
    uniform = torch.rand(rows, k, dtype=torch.float64, device=target_logits.device, generator=generator)
    accepted = (draft_p > 0) & (target_p >= uniform * draft_p) & in_draft
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [rows]

    # The distribution at position num_accepted: residual after a rejection, the target itself for a bonus.
    idx = num_accepted[:, None, None]
    probs = target_probs.gather(1, idx.expand(-1, 1, vocab)).squeeze(1)  # [rows, vocab]
    rejected = num_accepted < draft.num_tokens
    if k > 0:
        at = num_accepted.clamp(max=k - 1)[:, None]
        if draft_probs is None:
            removed = F.one_hot(draft_ids.gather(1, at).squeeze(1), vocab).to(probs.dtype)
        else:
            removed = draft_probs.gather(1, at[..., None].expand(-1, 1, vocab)).squeeze(1).to(probs.dtype)
        probs = torch.where(rejected[:, None], (probs - removed).clamp(min=0), probs)
    return num_accepted, sample_unnormalized(probs, generator)


def sample_unnormalized(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Samples an index per row of `weights` `[n, vocab]` (non-negative, not necessarily normalised) as
    argmax(weights / E), E ~ Exp(1): no normalisation pass and no host sync. Returns `[n]`."""
    exponential = torch.empty_like(weights).exponential_(generator=generator)
    return (weights / exponential).argmax(-1)
