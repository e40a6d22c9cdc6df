"""Applies a transformers `LogitsProcessorList` to many positions at once, each with its exact history.

transformers calls a processor with `input_ids` `[batch, cur_len]`: every row at the same length. In a speculative
step row i's position j has history `prompt_i + generated_i + drafts_i[:j]`, and rows differ. We group positions by
history length (laid out as transformers lays out a batch: left-padded prompt, then generated tokens) and call the
processors once per group, so a processor sees exactly the `input_ids` plain `generate` would have given it.
Processors that never read `input_ids` (the sampling warpers) run once over all positions.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

_HISTORY_FREE = tuple(
    getattr(lp, name)
    for name in (
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
        "EpsilonLogitsWarper", "EtaLogitsWarper", "SuppressTokensLogitsProcessor", "InfNanRemoveLogitsProcessor",
        "LogitNormalization", "TopHLogitsWarper",
    )
    if hasattr(lp, name)
)

# Processors whose output depends on a row's index in the batch or on state kept between calls cannot be regrouped.
_REFUSED = tuple(
    getattr(lp, name)
    for name in ("PrefixConstrainedLogitsProcessor", "UnbatchedClassifierFreeGuidanceLogitsProcessor",
                 "ClassifierFreeGuidanceLogitsProcessor", "WatermarkLogitsProcessor",
                 "SynthIDTextWatermarkLogitsProcessor")
    if hasattr(lp, name)
)


class LogitsProcessing:
    """Wraps the call's processors. `None` or an empty list means logits pass through unchanged.

    Args:
        processors (`LogitsProcessorList`, *optional*): as built by `generate`.
    """

    def __init__(self, processors: LogitsProcessorList | None):
        self.processors = LogitsProcessorList(processors or [])
        for p in self.processors:
            if isinstance(p, _REFUSED):
                raise ValueError(
                    f"{type(p).__name__} is not supported with speculative decoding: its output depends on batch "
                    "order or on state between calls. Drop it (e.g. prefix_allowed_tokens_fn, guidance_scale, "
                    "watermarking) or call generate without speculator="
                )
        self.history_free = all(isinstance(p, _HISTORY_FREE) for p in self.processors)

    def __bool__(self) -> bool:
        return len(self.processors) > 0

    def __call__(self, token_ids: torch.Tensor, rows: torch.Tensor, history_lens: torch.Tensor,
                 scores: torch.Tensor) -> torch.Tensor:
        """Processes `scores` `[n, vocab]`; entry t belongs to buffer row `rows[t]` with history
        `token_ids[rows[t], :history_lens[t]]`. Returns new float32 scores `[n, vocab]`."""
        scores = scores.float()
        if not self.processors:
            return scores
        if self.history_free:
            return self.processors(token_ids[rows, :1], scores)
        out = scores.clone()
        lens = history_lens.tolist()
        for length in sorted(set(lens)):
            idx = torch.tensor([t for t, n in enumerate(lens) if n == length], device=scores.device)
            out[idx] = self.processors(token_ids[rows[idx], :length], scores[idx])
        return out
