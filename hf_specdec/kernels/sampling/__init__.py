"""Temperature, top-k and top-p over target logits at every draft position in one pass:
`apply_sampling_params(...)` with `backend="auto" | "torch" | "triton"`."""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from .reference import apply_sampling_params_reference

__all__ = ["apply_sampling_params", "apply_sampling_params_reference"]


def apply_sampling_params(
    logits: torch.Tensor,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Applies per-row temperature, then top-k, then top-p, as transformers' warpers do (with
    `min_tokens_to_keep=1`).

    Args:
        logits: `[n, vocab]` float32, bfloat16 or float16 (n = rows x positions).
        temperature: `[n]` float32 (> 0), or `None`.
        top_k: `[n]` int64 (0 = off), or `None`.
        top_p: `[n]` float32 in (0, 1] (1 = off), or `None`.
        backend: `"auto"`, `"torch"` (sorts) or `"triton"` (a threshold search, no sort).

    Returns:
        `[n, vocab]` float32 scores with -inf where a filter removed the token.
    """
    if resolve_backend(backend, logits.device) == "triton":
        from .triton_kernel import apply_sampling_params_triton

        return apply_sampling_params_triton(logits, temperature, top_k, top_p)
    return apply_sampling_params_reference(logits, temperature, top_k, top_p)
