"""Verification: which drafts the target keeps, and the token that follows them.

Greedy: accept while the draft equals the target argmax; the first mismatching argmax is the recovered token; when
every draft matches, the argmax after them is the bonus token. Identical to plain greedy decoding.

Sampling (Leviathan et al., arXiv 2211.17192): accept draft d at a position iff `draft_prob(d) > 0` and
`target_prob(d) / draft_prob(d) >= u`, u ~ U[0, 1) drawn in float64 (float32 can give exactly 0). At the first
rejection sample a recovered token from `max(target_probs - draft_probs, 0)`; if all are accepted sample a bonus token
from the target at the next position. A deterministic speculator's draft is a point mass (draft_prob = 1 at d), so
the recovered distribution is target_probs with d removed. The output is distributed exactly as the target's.

The rule itself lives in `hf_specdec.kernels.rejection_sample`: a PyTorch reference (the spec, used on the CPU) and
a Triton kernel (used on CUDA, or anywhere `HF_SPECDEC_KERNEL_BACKEND=triton` asks for it).
"""

from __future__ import annotations

import torch

from .kernels.rejection_sample import rejection_sample, sample_with_noise
from .types import DraftProposal, VerifyResult


def verify(target_logits: torch.Tensor, draft: DraftProposal, do_sample: bool,
           generator: torch.Generator | None = None, backend: str = "auto") -> VerifyResult:
    """Verifies a ragged batch of drafts against processed target logits.

    Args:
        target_logits: `[rows, k + 1, vocab]` processed float32 target logits; position j scores the token after
            `j` drafts (so position `num_tokens[i]` is row i's bonus position).
        draft: the proposal; `draft.token_ids` is `[rows, k]`.
        do_sample: sample (rejection sampling) or greedy.
        generator: random generator; the global one when `None` (so `torch.manual_seed` makes runs reproducible).
        backend: kernel backend, `"auto"`, `"torch"` or `"triton"` (see `hf_specdec.kernels`).
    """
    # Greedy needs only the argmax, which the logits give exactly (softmax could merge near-ties in float32).
    target_probs = torch.softmax(target_logits, dim=-1) if do_sample else target_logits
    output, num_accepted = rejection_sample(draft.token_ids, draft.num_tokens, target_probs, draft.probs,
                                            is_greedy=not do_sample, generator=generator, backend=backend)
    return VerifyResult(output, num_accepted)


def sample_unnormalized(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Samples an index per row of `weights` `[n, vocab]` (non-negative, not necessarily normalised) as
    argmax(weights / E), E ~ Exp(1): no normalisation pass and no host sync. Returns `[n]`."""
    return sample_with_noise(weights, torch.empty_like(weights).exponential_(generator=generator))
