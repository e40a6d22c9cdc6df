"""Temperature/top-k/top-p benchmark: the sort-free Triton kernel against the sorting reference and transformers'
warpers, over every draft position of a batch."""

from __future__ import annotations

import torch

from .._timing import median_ms
from . import apply_sampling_params


def bench(device: torch.device, rows: int = 256 * 6, vocab: int = 128256, repeats: int = 10) -> list[dict]:
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(rows, vocab, device=device) * 3
    results = []
    for name, temperature, top_k, top_p in (("top-k 50", 0.7, 50, None), ("top-p 0.9", 0.7, None, 0.9),
                                            ("top-k 50 + top-p 0.9", 0.7, 50, 0.9)):
        params = (torch.full((rows,), temperature, device=device),
                  None if top_k is None else torch.full((rows,), top_k, device=device),
                  None if top_p is None else torch.full((rows,), top_p, device=device))
        warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                      + ([TopKLogitsWarper(top_k)] if top_k else [])
                                      + ([TopPLogitsWarper(top_p)] if top_p else []))
        triton_ms = median_ms(lambda: apply_sampling_params(logits, *params, backend="triton"), device, repeats)
        torch_ms = median_ms(lambda: apply_sampling_params(logits, *params, backend="torch"), device, repeats)
        hf_ms = median_ms(lambda: warpers(None, logits), device, repeats)
        results.append({"op": "sampling_params", "case": name, "shape": f"{rows} positions, vocab {vocab}, fp32",
                        "triton_ms": triton_ms, "torch_ms": torch_ms, "transformers_ms": hf_ms,
                        "speedup": torch_ms / triton_ms})
    return results
