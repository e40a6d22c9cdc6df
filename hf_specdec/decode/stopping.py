"""Where each row stops inside the tokens a step emits: EOS, the length budget, and the user's stopping criteria."""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList


class StopRules:
    """Built from the call's `StoppingCriteriaList`. Max length and EOS are handled with tensor ops; any other
    criterion is called after each emitted token with exactly the `input_ids` plain `generate` would pass.

    Args:
        criteria (`StoppingCriteriaList`): as built by `generate`.
        eos_token_ids (`torch.Tensor`, *optional*): `[num_eos]` ids that end a row.
    """

    def __init__(self, criteria: StoppingCriteriaList | None, eos_token_ids: torch.Tensor | None):
        self.custom = [c for c in (criteria or []) if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        self.eos_token_ids = eos_token_ids
        # `[batch]` rows that go on past EOS (a server request's `ignore_eos`), or None: none do.
        self.ignore_eos: torch.Tensor | None = None

    def apply(self, token_ids, rows, end_cols, output, num_emit, budget, scores):
        """Shortens `num_emit` to where each row stops; returns `(num_emit, finished)`, both `[rows]`.

        Args:
            token_ids: `[batch, width]` buffer in which `output` is already written from `end_cols` on.
            output: `[rows, k + 1]` emitted tokens (padding past `num_emit`).
            num_emit: `[rows]` tokens each row would emit; budget: `[rows]` tokens each row may still emit.
            scores: `[rows, k + 1, vocab]` processed scores that produced each output token.
        """
        num_emit = torch.minimum(num_emit, budget)
        positions = torch.arange(output.shape[1], device=output.device)[None, :]
        emitted = positions < num_emit[:, None]
        finished = num_emit >= budget
        if self.eos_token_ids is not None:
            is_eos = torch.isin(output, self.eos_token_ids) & emitted
            if self.ignore_eos is not None:
                is_eos &= ~self.ignore_eos[rows][:, None]
            has_eos = is_eos.any(-1)
            first_eos = is_eos.long().argmax(-1)
            num_emit = torch.where(has_eos, first_eos + 1, num_emit)
            finished |= has_eos
        if self.custom:
            num_emit, finished = self._apply_custom(token_ids, rows, end_cols, num_emit, finished, scores)
        return num_emit, finished

    def _apply_custom(self, token_ids, rows, end_cols, num_emit, finished, scores):
        # Per emitted position, rows are grouped by history length so each criterion sees rectangular input_ids:
        # the whole batch's, as plain `generate` passes them (a criterion may index rows, or read row 0 only), with
        # the group's rows at their batch index; only theirs of the answer count. A criterion may answer one bool
        # for the batch (a Python bool or a 0-d tensor), as plain `generate` allows.
        emit = num_emit.tolist()
        ends = end_cols.tolist()
        stopped = [False] * len(emit)
        for j in range(max(emit, default=0)):
            by_length: dict[int, list[int]] = {}
            for i in range(len(emit)):
                if j < emit[i] and not stopped[i]:
                    by_length.setdefault(ends[i] + j + 1, []).append(i)
            for length, members in by_length.items():
                idx = torch.tensor(members, device=rows.device)
                owners = rows[idx]
                full = scores.new_zeros((token_ids.shape[0], scores.shape[-1]))
                full[owners] = scores[idx, j]
                hit = torch.zeros(len(members), dtype=torch.bool, device=rows.device)
                for criterion in self.custom:
                    answer = torch.as_tensor(criterion(token_ids[:, :length], full), dtype=torch.bool)
                    hit |= answer.to(rows.device).expand(token_ids.shape[0])[owners]
                for i, stop in zip(members, hit.tolist()):
                    if stop:
                        stopped[i], emit[i] = True, j + 1
        stopped_t = torch.tensor(stopped, dtype=torch.bool, device=rows.device)
        return torch.tensor(emit, dtype=num_emit.dtype, device=rows.device), finished | stopped_t
