"""Temperature, top-k and top-p over target logits: the plain PyTorch spec, row by row as transformers' warpers.

Per row r (each parameter optional, per row): scores = logits / temperature[r]; top-k keeps every token whose score
is >= the k-th largest (ties kept, as `TopKLogitsWarper`; k = 0 or k >= vocab keeps all); top-p then removes the
lowest-scored tokens while their cumulative probability (softmax over what top-k kept) is <= 1 - top_p[r], always
keeping the highest-scored token (as `TopPLogitsWarper` with `min_tokens_to_keep=1`; top_p = 1 keeps all). Removed
tokens get -inf. Scores are float32. On a CPU, top-k and top-p look for their cut among each row's highest scores
before sorting anything (the same tokens kept; see `_top_p_remove_from_candidates` for top-p's rounding and ties).
"""

from __future__ import annotations

import torch


def apply_sampling_params_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The spec.

    Args:
        logits: `[n, vocab]` float32, bfloat16 or float16.
        temperature: `[n]` float32 (> 0), or `None`.
        top_k: `[n]` int64 (0 = off), or `None`.
        top_p: `[n]` float32 in (0, 1] (1 = off), or `None`.

    Returns:
        `[n, vocab]` float32 scores, -inf where removed.
    """
    scores = logits.float()
    vocab = scores.shape[-1]
    if temperature is not None:
        scores = scores / temperature.float()[:, None]
    if top_k is not None:
        off = (top_k <= 0) | (top_k >= vocab)
        if scores.device.type == "cpu":  # the largest k, read on the host (free here; a GPU would stall on it)
            k = torch.where(off, 1, top_k)
            # the k-th largest score from the top max(k) only: at 26 rows of a 49152-token vocabulary 0.9 ms
            # against 46 ms for a full sort on a 2-core CPU
            kth = scores.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        else:
            k = torch.where(off, vocab, top_k)
            kth = scores.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        scores = scores.masked_fill((scores < kth) & ~off[:, None], float("-inf"))
    if top_p is not None:
        if scores.device.type == "cpu" and vocab > TOP_P_CANDIDATES:
            remove = _top_p_remove_from_candidates(scores, top_p)
        else:
            remove = _top_p_remove(scores, top_p)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


# On a CPU, top-p looks for its cut among each row's highest-scored tokens first: at 80 rows of a 49152-token
# vocabulary `topk` of 256 and a log-sum-exp took 12 ms against 185 ms for a full sort (2-core CPU). A GPU keeps the
# sort on this path (the Triton kernel has no sort at all).
TOP_P_CANDIDATES = 256


def _top_p_remove(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`[n, vocab]` True where top-p removes a token, by sorting each row, as `TopPLogitsWarper`."""
    sorted_scores, order = scores.sort(dim=-1, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p.float())[:, None]
    remove[:, -1] = False
    remove &= (top_p < 1)[:, None]  # top_p = 1 keeps all, tokens whose probability underflows to 0 included
    return remove.scatter(1, order, remove)


def _top_p_remove_from_candidates(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_top_p_remove` without a full sort where it can. A token survives top-p when the probability of the tokens
    scored above it is below top_p (the sorted form's cumulative sum from the bottom, read from the top). Among a
    row's `TOP_P_CANDIDATES` highest-scored tokens, once their probability reaches top_p the cut lies among them and
    every other token goes; rows where it does not (a flat distribution) are sorted. Probabilities are float64: a
    token within float32 rounding of the cut may land on the other side of it than under the sorted form's float32
    cumulative sum. Ties at the cut keep whichever of them `topk` put first, as the sort's order decides there."""
    vocab = scores.shape[-1]
    active = top_p < 1
    remove = torch.zeros_like(scores, dtype=torch.bool)
    if not bool(active.any()):
        return remove
    values, index = scores.topk(TOP_P_CANDIDATES, dim=-1)  # descending
    p = (values.double() - torch.logsumexp(scores, dim=-1, keepdim=True).double()).exp()
    above = p.cumsum(dim=-1) - p
    limit = top_p.double()[:, None]
    resolved = (above[:, -1:] + p[:, -1:] >= limit).squeeze(1) & active
    if bool(resolved.any()):
        rows = resolved.nonzero().squeeze(1)
        cut = ~(above[rows] < limit[rows])
        cut[:, 0] = False  # the highest-scored token stays whatever top_p is (top_p = 0 included)
        removed = torch.ones(len(rows), vocab, dtype=torch.bool)
        removed.scatter_(1, index[rows], cut)
        remove[rows] = removed
    flat = active & ~resolved
    if bool(flat.any()):
        rows = flat.nonzero().squeeze(1)
        remove[rows] = _top_p_remove(scores[rows], top_p[rows])
    return remove
