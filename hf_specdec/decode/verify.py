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

from ..kernels.rejection_sample import greedy_accept_argmax, rejection_sample, sample_with_uniforms
from ..types import PAD_ID, DraftProposal, DraftTree, VerifyResult


def verify(target_logits: torch.Tensor, draft: DraftProposal, do_sample: bool,
           generator: torch.Generator | None = None, backend: str = "auto", is_greedy: torch.Tensor | None = None,
           seeded: tuple[list[int], list[int]] | None = None,
           seeded_logits: torch.Tensor | None = None, index: torch.Tensor | None = None) -> VerifyResult:
    """Verifies a ragged batch of drafts against processed target logits.

    Args:
        target_logits: `[rows, k + 1, vocab]` processed float32 target logits; position j scores the token after
            `j` drafts (so position `num_tokens[i]` is row i's bonus position).
        draft: the proposal; `draft.token_ids` is `[rows, k]`.
        do_sample: sample (rejection sampling) or greedy.
        generator: random generator; the global one when `None` (so `torch.manual_seed` makes runs reproducible).
        backend: kernel backend, `"auto"`, `"torch"` or `"triton"` (see `hf_specdec.kernels`).
        is_greedy: `[rows]` bool, with `do_sample`: rows that decode greedily in a batch that also samples.
        seeded: `(rows, streams)`: these sampled rows draw each token from their own stream, `streams[i] + j` for
            the token after `j` drafts (`sample_by_position`), so their output does not depend on the drafts.
        seeded_logits: what those rows sample from, when `target_logits` was rewritten for rejection sampling (a
            grammar's residual at a forbidden draft).
        index: `[rows, k + 1]`, where `target_logits` is packed `[n, vocab]` (a packed verify's, computed only at
            the positions rows fed): each position's entry there. The rule then reads only the entries it needs;
            rows with settings of their own (`is_greedy`, `seeded`) get the logits laid out per row first.
    """
    if index is not None and (is_greedy is not None or seeded is not None):
        target_logits, index = target_logits[index], None
    # Greedy needs only the argmax, which the logits give exactly (softmax could merge near-ties in float32).
    target_probs = torch.softmax(target_logits, dim=-1) if do_sample else target_logits
    if do_sample and is_greedy is not None:  # greedy rows get a point mass on their exact argmax
        point = torch.zeros_like(target_probs).scatter_(-1, target_logits.argmax(-1, keepdim=True), 1.0)
        target_probs = torch.where(is_greedy[:, None, None], point, target_probs)
    output, num_accepted = rejection_sample(
        draft.token_ids, draft.num_tokens, target_probs, draft.probs,
        is_greedy=not do_sample if is_greedy is None or not do_sample else is_greedy, generator=generator,
        backend=backend, target_index=index)
    if seeded is not None and seeded[0]:
        rows = torch.tensor(seeded[0], device=output.device)
        probs = target_probs[rows] if seeded_logits is None else torch.softmax(seeded_logits[rows], dim=-1)
        picked, accepted = sample_by_position(probs, draft.token_ids[rows], draft.num_tokens[rows], seeded[1])
        output, num_accepted = output.index_copy(0, rows, picked), num_accepted.index_copy(0, rows, accepted)
    return VerifyResult(output, num_accepted)


def verify_argmax(target_argmax: torch.Tensor, draft: DraftProposal) -> VerifyResult:
    """Greedy verification from the target's argmax at each position, `[rows, k + 1]` (as `verify` computes it from
    logits laid out per row): for a step whose logits stay packed."""
    return VerifyResult(*greedy_accept_argmax(draft.token_ids, draft.num_tokens, target_argmax))


def sample_by_position(target_probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                       streams: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification that makes a row's tokens a function of its seed and their positions alone.

    The token after `j` drafts is the target's sample drawn with the uniform of stream `streams[i] + j`, by the
    inverse of the cumulative distribution (vocabulary order; the winner is `v` with probability `p(v)`, and a token
    of probability 0 never wins). A draft is accepted when it equals that sample; at the first that does not, the
    sample is the emitted token. Every emitted token is thus the target's own sample at its position, whatever was
    drafted (any drafts, from any distribution, or none), so the output is exactly the target's distribution and a
    seeded request repeats itself whatever k, speculator or company its steps had. The price: a draft is accepted
    with probability `p(d)`, not `min(1, p(d) / q(d))`. One uniform per position, from a counter hash of the
    stream (`_stream_uniform`): nothing vocabulary-sized is drawn.

    Args:
        target_probs: `[rows, k + 1, vocab]` the processed target distributions.
        draft_ids: `[rows, k]`; num_drafts: `[rows]`.
        streams: per row, the stream of its first position (positions after it add 1).
    Returns:
        `(output, num_accepted)` as `rejection_sample` returns them.
    """
    rows, width, _ = target_probs.shape
    device = target_probs.device
    uniforms = torch.tensor([[_stream_uniform(stream + j) for j in range(width)] for stream in streams],
                            dtype=torch.float64, device=device)
    cdf = target_probs.double().cumsum(-1)
    total = cdf[..., -1:].contiguous()
    picks = torch.searchsorted(cdf, uniforms[..., None] * total, right=True)
    # rounding may land past the last token with mass: take that one (the first whose cumulative sum is the total)
    picks = torch.minimum(picks, torch.searchsorted(cdf, total)).squeeze(-1)
    k = width - 1
    positions = torch.arange(width, device=device)
    in_draft = positions[None, :k] < num_drafts[:, None]
    matches = (draft_ids == picks[:, :k]) & in_draft
    num_accepted = matches.long().cumprod(-1).sum(-1)
    output = torch.where(positions[None, :] <= num_accepted[:, None], picks, PAD_ID)
    return output, num_accepted


def _stream_uniform(counter: int) -> float:
    """A uniform in [0, 1) that depends on `counter` alone (splitmix64's output function, top 53 bits)."""
    z = (counter * 0x9E3779B97F4A7C15 + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def verify_tree(target_logits: torch.Tensor, tree: DraftTree, do_sample: bool, max_depth: int, generator: torch.Generator | None = None) -> tuple[VerifyResult, torch.Tensor]:
    """Verifies draft trees: walks each row's tree from the root along the target's own choices.

    At every node the target picks its token (argmax, or a sample from its processed distribution); if a valid child
    carries that token the walk moves there and the child is accepted, otherwise the picked token is the recovered
    token (the bonus token after a leaf) and the walk ends. The output is the target's own greedy continuation, or a
    sample of exactly its distribution: each emitted token is the target's pick given the tokens before it, and the
    tree, fixed before the target's randomness is drawn, only decides how many picks one forward checks. (A
    deterministic tree node is a point-mass draft: accepting it with probability `p(token)`, else renormalising
    without it and trying its next sibling, is the same as this walk.)

    Args:
        target_logits: `[rows, n + 1, vocab]` processed float32 logits: entry 0 after the root, entry i + 1 after
            node i.
        tree: the drafts.
        max_depth: at least the depth of the deepest valid node (the walk takes this many steps at most).
    Returns:
        `(VerifyResult, path)`: output `[rows, max_depth + 1]` (accepted node tokens, then the recovered or bonus
        token, `PAD_ID` after), accepted counts `[rows]`, and `path` `[rows, max_depth]`, the accepted node at each
        depth (-1 past the accepted ones).
    """
    rows = target_logits.shape[0]
    device = target_logits.device
    rows_index = torch.arange(rows, device=device)
    parent_entry = tree.parents + 1  # the logits entry of each node's parent (0: the root)
    current = torch.zeros(rows, dtype=torch.long, device=device)  # logits entry of the node the walk is at
    alive = torch.ones(rows, dtype=torch.bool, device=device)
    output = torch.full((rows, max_depth + 1), PAD_ID, dtype=torch.long, device=device)
    path = torch.full((rows, max_depth), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(rows, dtype=torch.long, device=device)
    for depth in range(max_depth + 1):
        here = target_logits[rows_index, current]  # [rows, vocab]: only the nodes the walk reaches are drawn for
        pick = sample_unnormalized(torch.softmax(here, dim=-1), generator) if do_sample else here.argmax(-1)
        output[:, depth] = torch.where(alive, pick, PAD_ID)
        if depth == max_depth:
            break
        match = tree.valid & (parent_entry == current[:, None]) & (tree.token_ids == pick[:, None])
        alive &= match.any(-1)
        child = match.long().argmax(-1)  # the first matching child
        path[:, depth] = torch.where(alive, child, -1)
        num_accepted += alive.long()
        current = torch.where(alive, child + 1, current)
    return VerifyResult(output, num_accepted), path


def sample_unnormalized(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Samples an index per row of `weights` `[n, vocab]` (non-negative, not necessarily normalised) by the inverse
    of its cumulative distribution, one uniform per row (`sample_with_uniforms`): no normalisation pass, no host
    sync, and no vocabulary's worth of random draws (on a CPU those cost 25 times the cumulative sum). Returns `[n]`."""
    uniforms = torch.rand(weights.shape[0], dtype=torch.float64, device=weights.device, generator=generator)
    return sample_with_uniforms(weights, uniforms)
