"""Rejection sampling over a padded batch of drafts: the plain PyTorch spec the Triton kernel is tested against.

Glossary: each row proposes `num_draft_tokens[i] <= k` draft tokens; the target keeps a prefix of them (accepted),
then adds one token of its own: the recovered token at the first rejected position, or the bonus token after the
last draft when every draft was accepted. Output = accepted + (recovered or bonus), padded with -1 to `k + 1`.

Greedy rows: accept while the draft equals the target's argmax; the argmax at the first mismatch is the recovered
token, the argmax after the last draft the bonus token. The scores may be logits or probabilities: only their
argmax matters (first index on ties, as `torch.argmax`).

Sampled rows (Leviathan et al., arXiv 2211.17192): accept draft d at position j iff `draft_prob > 0` and
`target_prob / draft_prob >= u_j`, i.e. `target_prob >= u_j * draft_prob` in float64. At a rejection the recovered
token is drawn from `max(target_probs - draft_probs, 0)`; a deterministic draft (no draft probabilities) is a point
mass, so the recovered token is drawn from the target with the draft token removed. A bonus token is drawn from the
target. Draws from an unnormalised `w` take `argmax(w / e)` with `e ~ Exp(1)` per vocabulary entry, computed in
float32: no normalisation pass, no host sync (the kernel draws its noise in place). Or, given one uniform per row
instead of the noise, by the inverse of the cumulative distribution in float64 (`sample_with_uniforms`): what the
CPU takes, where drawing a vocabulary's worth of Exp(1) noise per row costs more than the rest of the verify (16 rows
of 49152 entries: 17 ms for `exponential_` against 0.6 ms for a float64 cumulative sum, 2 threads of an AMD EPYC).
"""

from __future__ import annotations

import torch

PAD_ID = -1


def rejection_sample_reference(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    is_greedy: torch.Tensor | bool,
    uniforms: torch.Tensor | None,
    noise: torch.Tensor | None,
    final_uniforms: torch.Tensor | None = None,
    target_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec, fully determined by its random inputs.

    Args:
        draft_token_ids: `[batch, k]` int64 drafts; entries past `num_draft_tokens` are ignored (conventionally -1).
        num_draft_tokens: `[batch]` int64 drafts per row, in `[0, k]`.
        target_probs: `[batch, k + 1, vocab]` target probabilities per position (position j scores the token after j
            drafts); for greedy rows any scores with the same argmax (the engine passes logits).
        draft_probs: `[batch, k, draft_vocab]` probabilities the drafts were sampled from, or `None` for deterministic
            drafts. A smaller `draft_vocab` counts as zero probability past its end.
        is_greedy: `[batch]` bool per row, or one Python bool for all rows (no host sync to find out).
        uniforms: `[batch, k]` float64 in [0, 1), acceptance draws for sampled rows (`None` if all rows are greedy).
        noise: `[batch, vocab]` float32 Exp(1) draws for the recovered/bonus token of sampled rows (`None` if all
            rows are greedy, or where `final_uniforms` is given).
        final_uniforms: `[batch]` float64 in [0, 1), instead of `noise`: the recovered/bonus token by the inverse of
            its cumulative distribution (`sample_with_uniforms`).
        target_index: `[batch, k + 1]` int64, where `target_probs` is `[n, vocab]`, packed: the entry of each
            position's probabilities (a packed verify computes them only at the positions rows feed; positions past
            a row's drafts repeat its last). Only the entries the rule reads are gathered.

    Returns:
        `(output_token_ids, num_accepted)`: `[batch, k + 1]` int64 padded with -1, and `[batch]` int64.
    """
    batch, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    positions = torch.arange(k + 1, device=device)
    in_draft = positions[:k][None, :] < num_draft_tokens[:, None]  # [batch, k]
    draft_ids = torch.where(in_draft, draft_token_ids, 0).clamp(min=0)
    in_vocab = draft_ids < vocab
    draft_ids_t = draft_ids.clamp(max=vocab - 1)

    if isinstance(is_greedy, bool):
        all_greedy, any_greedy = is_greedy, is_greedy
        is_greedy = torch.full((batch,), is_greedy, dtype=torch.bool, device=device)
    else:
        all_greedy, any_greedy = bool(is_greedy.all()), bool(is_greedy.any())
    packed = target_index is not None
    target_argmax = target_probs.argmax(-1) if any_greedy else None  # [batch, k + 1]
    if packed and any_greedy:
        target_argmax = target_argmax[target_index]
    accepted = (draft_ids == target_argmax[:, :k]) & in_draft if any_greedy else None  # greedy rule
    if not all_greedy:
        target_p = (target_probs[target_index[:, :k], draft_ids_t] if packed else
                    target_probs[:, :k].gather(-1, draft_ids_t[..., None]).squeeze(-1)).double()
        target_p = torch.where(in_vocab, target_p, 0)
        draft_p = _draft_prob_of(draft_probs, draft_ids, target_p)
        stochastic = (draft_p > 0) & (target_p >= uniforms * draft_p) & in_draft
        accepted = torch.where(is_greedy[:, None], accepted, stochastic) if any_greedy else stochastic
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [batch]

    final = target_argmax.gather(1, num_accepted[:, None]).squeeze(1) if any_greedy else None
    if not all_greedy:
        # Each row's final position, rows copied whole (a `gather` with a vocabulary-wide index took 2.7 times as long)
        weights = (target_probs[target_index.gather(1, num_accepted[:, None]).squeeze(1)] if packed else
                   target_probs[torch.arange(batch, device=device), num_accepted]).float()
        rejected = num_accepted < num_draft_tokens
        if k > 0:
            at = num_accepted.clamp(max=k - 1)[:, None]
            rejected_id = draft_ids.gather(1, at).squeeze(1)
            if draft_probs is None:
                removed = torch.zeros_like(weights).scatter_(1, rejected_id[:, None].clamp(max=vocab - 1),
                                                             in_vocab.gather(1, at).float())
            else:
                removed = _draft_row(draft_probs, at.squeeze(1), vocab).float()
            weights = torch.where(rejected[:, None], (weights - removed).clamp(min=0), weights)
        sampled = sample_with_noise(weights, noise) if noise is not None else sample_with_uniforms(weights,
                                                                                                    final_uniforms)
        final = torch.where(is_greedy, final, sampled) if any_greedy else sampled

    output = torch.cat([draft_ids, draft_ids.new_zeros(batch, 1)], dim=1)
    output = output.scatter(1, num_accepted[:, None], final[:, None])
    output = torch.where(positions[None, :] <= num_accepted[:, None], output, PAD_ID)
    return output, num_accepted


def greedy_accept(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                  scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample_reference` for a batch whose rows are all greedy, in a third of its operations (a step's
    verify runs once per token; on a GPU each operation is a kernel launch). Every kept position's token is the
    target's argmax there: an accepted draft equals it, and the token after the accepted drafts is it."""
    return greedy_accept_argmax(draft_token_ids, num_draft_tokens, scores.argmax(-1))


def greedy_accept_argmax(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                         target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_accept` from the target's argmax at each position, `[batch, k + 1]`, for a caller that has it
    without the scores laid out per row (a packed step's logits)."""
    batch, k = draft_token_ids.shape
    if k == 0:
        return target_argmax, torch.zeros(batch, dtype=torch.long, device=target_argmax.device)
    positions = torch.arange(k + 1, device=target_argmax.device)
    matched = (draft_token_ids == target_argmax[:, :k]) & (positions[:k] < num_draft_tokens[:, None])
    num_accepted = matched.long().cumprod(-1).sum(-1)
    return torch.where(positions <= num_accepted[:, None], target_argmax, PAD_ID), num_accepted


def _draft_prob_of(draft_probs, draft_ids, like):
    if draft_probs is None:
        return torch.ones_like(like)
    draft_vocab = draft_probs.shape[-1]
    p = draft_probs.gather(-1, draft_ids.clamp(max=draft_vocab - 1)[..., None]).squeeze(-1).double()
    return torch.where(draft_ids < draft_vocab, p, 0)


def _draft_row(draft_probs, position, vocab):
    """`[batch, vocab]` draft probabilities at `position[i]`, cut or zero-padded to the target's vocabulary."""
    row = draft_probs.gather(1, position[:, None, None].expand(-1, 1, draft_probs.shape[-1])).squeeze(1)
    if row.shape[-1] >= vocab:
        return row[:, :vocab]
    return torch.nn.functional.pad(row, (0, vocab - row.shape[-1]))


def sample_with_noise(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`argmax(weights / noise)` per row over `[n, vocab]`; zero weights never win (not even against zero noise)."""
    return torch.where(weights > 0, weights / noise, -1.0).argmax(-1)


def sample_with_uniforms(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of `weights` `[n, vocab]` (non-negative, not necessarily normalised), the first index whose cumulative
    weight (float64) exceeds `uniforms[i]` `[n]` (in [0, 1)) times the row's total: index v with probability
    `weights[v] / total`. A zero weight never wins (its cumulative sum equals the one before it); rounding that lands
    past the last entry with weight takes that entry; a row of zeros gives 0, as `sample_with_noise` does."""
    cdf = weights.double().cumsum(-1)
    total = cdf[:, -1:].contiguous()
    picks = torch.searchsorted(cdf, uniforms.double()[:, None] * total, right=True)
    return torch.minimum(picks, torch.searchsorted(cdf, total)).squeeze(-1)
