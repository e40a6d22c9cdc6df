"""Applies a transformers `LogitsProcessorList` to many positions at once, each with its exact history.

transformers calls a processor with `input_ids` `[batch, cur_len]`: every row at the same length. In a speculative
step row i's position j has history `prompt_i + generated_i + drafts_i[:j]`, and rows differ. We group positions by
history length (laid out as transformers lays out a batch: left-padded prompt, then generated tokens) and call the
processors once per group, so a processor sees exactly the `input_ids` plain `generate` would have given it: a
processor of the user's own (which may index rows) gets the whole batch, each row at its batch index, and only the
group's rows of its result are kept.
Processors that never read `input_ids` (the sampling warpers) run once over all positions; when they are only
temperature, top-k and top-p and the kernel backend is triton (CUDA by default), one kernel applies them to every
position without sorting (`hf_specdec.kernels.sampling`).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

from ..kernels._backend import resolve_backend
from ..kernels.sampling import apply_sampling_params

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
# (`prefix_allowed_tokens_fn` and xgrammar's processor are taken out before this and run as constraints.)
_REFUSED = tuple(
    getattr(lp, name)
    for name in ("PrefixConstrainedLogitsProcessor", "UnbatchedClassifierFreeGuidanceLogitsProcessor",
                 "ClassifierFreeGuidanceLogitsProcessor", "WatermarkLogitsProcessor",
                 "SynthIDTextWatermarkLogitsProcessor")
    if hasattr(lp, name)
)
# Structured-generation libraries whose transformers processors track each row's parse between calls.
_STATEFUL_LIBRARIES = ("outlines", "transformers_cfg", "llguidance", "guidance", "lmformatenforcer", "xgrammar")


class LogitsProcessing:
    """Wraps the call's processors. `None` or an empty list means logits pass through unchanged.

    Args:
        processors (`LogitsProcessorList`, *optional*): as built by `generate`.
    """

    def __init__(self, processors: LogitsProcessorList | None, batch_size: int | None = None):
        self.processors = LogitsProcessorList(processors or [])
        self.batch_size = batch_size  # rows of the call's batch: what a processor's row index refers to
        for p in self.processors:
            if isinstance(p, _REFUSED):
                raise ValueError(
                    f"{type(p).__name__} is not supported with speculative decoding: its output depends on batch "
                    "order or on state between calls. Drop it (e.g. guidance_scale, watermarking) or call "
                    "generate without speculator="
                )
            if type(p).__module__.split(".")[0] in _STATEFUL_LIBRARIES:
                raise ValueError(f"{_name(p)} keeps each row's parse state between calls, which speculative "
                                 "decoding cannot replay; pass the constraint as grammar=hf_specdec.Grammar."
                                 "json_schema(...) / .regex(...) / .ebnf(...) instead")
        self._unchecked = [p for p in self.processors if not type(p).__module__.startswith("transformers.")]
        # A processor of the user's own may index rows (a bias per request, say): it is called with the whole
        # batch, each row at its batch index, as plain `generate` calls it (transformers' own are row-wise).
        self._whole_batch = bool(self._unchecked)
        self.history_free = all(isinstance(p, _HISTORY_FREE) for p in self.processors)
        self.sampling_params = _sampling_params(self.processors)
        self._param_tensors: dict = {}

    def __bool__(self) -> bool:
        return len(self.processors) > 0

    def __call__(self, token_ids: torch.Tensor, rows: torch.Tensor, history_lens: torch.Tensor,
                 scores: torch.Tensor, batch_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Processes `scores` `[n, vocab]`; entry t has history `token_ids[rows[t], :history_lens[t]]` and belongs to
        row `batch_rows[t]` of the call's batch (default: `rows[t]`, when `token_ids` is the batch's own buffer).
        Returns new float32 scores `[n, vocab]`."""
        scores = scores.float()
        if not self.processors:
            return scores
        if self.sampling_params is not None:
            # The Triton kernel where it runs; on a CPU the PyTorch reference, which keeps the tokens transformers'
            # warpers keep without sorting the vocabulary (11 positions of 49152 tokens at temperature 0.7, top-k
            # 50, top-p 0.9: 2.8 ms against 8.5; top-p alone 1.8 against 26.2; docs/kernels.md). A
            # GPU without the kernel keeps transformers' own.
            backend = resolve_backend("auto", scores.device)
            if backend == "triton" or scores.device.type == "cpu":
                return apply_sampling_params(scores, *self._params(len(scores), scores.device), backend=backend)
        if self.history_free:
            return self.processors(token_ids[rows, :1], scores)
        own_buffer = batch_rows is None  # `token_ids` is the batch's buffer, row for row
        batch_rows = rows if batch_rows is None else batch_rows
        out = scores.clone()
        lens = history_lens.tolist()
        for length in sorted(set(lens)):
            group = [t for t, n in enumerate(lens) if n == length]
            if not self._whole_batch:
                idx = torch.tensor(group, device=scores.device)
                out[idx] = self._call(token_ids[rows[idx], :length], scores[idx], batch_rows[idx])
                continue
            owners = batch_rows.tolist()
            while group:  # one entry per batch row a call (a draft tree's siblings share a length)
                seen, now, later = set(), [], []
                for t in group:
                    (later if owners[t] in seen else now).append(t)
                    seen.add(owners[t])
                idx = torch.tensor(now, device=scores.device)
                out[idx] = self._call_whole(token_ids, rows[idx], length, scores[idx], batch_rows[idx], own_buffer)
                group = later
        return out

    def _call_whole(self, token_ids, rows, length, scores, batch_rows, own_buffer: bool) -> torch.Tensor:
        """The processors called as plain `generate` calls them: `[batch, length]` ids and `[batch, vocab]` scores
        with these entries at their batch rows (the other rows hold their own tokens up to `length`, or zeros);
        returns these entries' results."""
        size = self.batch_size or int(batch_rows.max()) + 1
        if own_buffer and token_ids.shape[0] == size:
            ids = token_ids[:, :length].clone()
        else:
            ids = token_ids.new_zeros((size, length))
            ids[batch_rows] = token_ids[rows, :length]
        full = scores.new_zeros((size, scores.shape[-1]))
        full[batch_rows] = scores
        out = self._guarded(ids, full) if self._unchecked else self.processors(ids, full)
        return out[batch_rows]

    def _guarded(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # A processor from outside transformers is watched on its first call: one whose attributes change when
        # called keeps state between calls, and would silently see a history it cannot handle. Its own errors are
        # reported as its own, not as a bare failure from inside the loop.
        before = {id(p): _fingerprint(p) for p in self._unchecked}
        try:
            out = self.processors(input_ids, scores)
        except Exception as error:
            culprits = ", ".join(_name(p) for p in self._unchecked) or "a logits processor"
            raise RuntimeError(
                f"logits processor {culprits} failed under speculative decoding ({type(error).__name__}: {error}). "
                "Processors are called for every verified position with that position's history, several per "
                "step; one that keeps state between calls cannot work: for structured output pass grammar="
            ) from error
        for p in self._unchecked:
            if _fingerprint(p) != before[id(p)]:
                raise ValueError(
                    f"logits processor {_name(p)} changed its own state when called, so it keeps state between "
                    "calls, which speculative decoding cannot replay; make it depend only on input_ids, or for "
                    "structured output pass grammar=hf_specdec.Grammar... (or call generate without speculator=)"
                )
        self._unchecked = []
        return out

    def _call(self, input_ids: torch.Tensor, scores: torch.Tensor, batch_rows: torch.Tensor) -> torch.Tensor:
        # A group holds any subset of the batch's rows, in any order, so settings given per batch row (the
        # repetition penalty's per-row prompt padding, say) are indexed to match for the call.
        saved = []
        try:
            return self._regrouped(input_ids, scores, batch_rows, saved)
        finally:
            for p, name, value in reversed(saved):
                setattr(p, name, value)

    def _regrouped(self, input_ids, scores, batch_rows, saved):
        for p in self.processors:
            per_row = getattr(p, "prompt_ignore_length", None)
            if isinstance(per_row, torch.Tensor) and per_row.ndim == 1:
                saved.append((p, "prompt_ignore_length", per_row))
                p.prompt_ignore_length = per_row.to(batch_rows.device)[batch_rows]
            # The encoder-prompt processors hold the prompt per batch row (`encoder_repetition_penalty`), or its
            # n-grams per row with the batch size they divide by (`encoder_no_repeat_ngram_size`).
            if isinstance(p, lp.EncoderRepetitionPenaltyLogitsProcessor):
                saved.append((p, "encoder_input_ids", p.encoder_input_ids))
                p.encoder_input_ids = p.encoder_input_ids[self._prompt_rows(batch_rows, len(p.encoder_input_ids))]
            elif isinstance(p, lp.EncoderNoRepeatNGramLogitsProcessor):
                saved += [(p, "generated_ngrams", p.generated_ngrams), (p, "batch_size", p.batch_size)]
                rows = self._prompt_rows(batch_rows, p.batch_size).tolist()
                p.generated_ngrams, p.batch_size = [p.generated_ngrams[r] for r in rows], len(rows)
        return self._guarded(input_ids, scores) if self._unchecked else self.processors(input_ids, scores)

    def _prompt_rows(self, batch_rows: torch.Tensor, num_prompts: int) -> torch.Tensor:
        """The prompt (of `num_prompts`, before `num_return_sequences` repeated each) of each of `batch_rows`."""
        per_prompt = max((self.batch_size or num_prompts) // max(num_prompts, 1), 1)
        return batch_rows.cpu() // per_prompt

    def _params(self, n: int, device) -> tuple:
        key = (n, str(device))
        if key not in self._param_tensors:
            temperature, top_k, top_p = self.sampling_params
            self._param_tensors = {key: (
                None if temperature is None else torch.full((n,), temperature, dtype=torch.float32, device=device),
                None if top_k is None else torch.full((n,), top_k, dtype=torch.int64, device=device),
                None if top_p is None else torch.full((n,), top_p, dtype=torch.float32, device=device),
            )}
        return self._param_tensors[key]


def _name(p) -> str:
    return f"{type(p).__module__}.{type(p).__qualname__}"


def _fingerprint(p) -> dict:
    """What a call may change on processor `p`: its attributes' identities, and the values of plain scalars."""
    return {name: (value if isinstance(value, (int, float, bool, str, type(None))) else id(value))
            for name, value in vars(p).items()} if hasattr(p, "__dict__") else {}


def _sampling_params(processors: LogitsProcessorList) -> tuple | None:
    """`(temperature, top_k, top_p)` (each or `None`) when the processors are exactly those warpers, in the order
    `generate` builds them and with the settings the kernel implements; otherwise `None`."""
    params, order = [None, None, None], 0
    for p in processors:
        if type(p) is lp.TemperatureLogitsWarper and order <= 0:
            params[0], order = float(p.temperature), 1
        elif type(p) is lp.TopKLogitsWarper and order <= 1 and p.filter_value == float("-inf"):
            params[1], order = int(p.top_k), 2  # top_k already includes min_tokens_to_keep
        elif (type(p) is lp.TopPLogitsWarper and order <= 2 and p.filter_value == float("-inf")
              and p.min_tokens_to_keep == 1):
            params[2], order = float(p.top_p), 3
        else:
            return None
    return tuple(params) if processors else None
