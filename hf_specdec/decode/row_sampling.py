"""Sampling settings per row of a batch whose requests differ (`RowSampling`): each row's penalties, logit biases and
`min_tokens` applied to the target's logits with each position's own history, then its temperature, top-k and top-p;
which rows are greedy; and the random streams of seeded rows.
"""

from __future__ import annotations

import torch

from ..kernels.sampling import apply_sampling_params
from .requests import SamplingParams


class RowSampling:
    """Each row's own sampling settings, for batches whose requests differ (the server's).

    As the batch's `processing`, it applies each row's penalties and biases (with each position's history), then its
    temperature, top-k and top-p (`kernels.sampling`); as its
    `sampling`, it tells the verifier which rows are greedy and draws the random numbers of rows with a seed from
    their own stream (seed, tokens generated so far), so such a row does not depend on which others share its steps.
    """

    def __init__(self, num_rows: int, device, vocab_size: int | None = None, eos_token_ids=None):
        self.device = device
        # End-of-sequence tokens, which `min_tokens` holds back.
        self.eos_token_ids = torch.as_tensor(list(eos_token_ids or []), dtype=torch.long, device=device)
        self.min_tokens = torch.zeros(num_rows, dtype=torch.long, device=device)
        self._eos_masks: dict[int, torch.Tensor] = {}
        self.vocab_size = vocab_size  # for logit biases
        self.temperature = torch.ones(num_rows, device=device)
        self.top_k = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.top_p = torch.ones(num_rows, device=device)
        self.greedy = torch.ones(num_rows, dtype=torch.bool, device=device)
        self.settings: list[SamplingParams | None] = [None] * num_rows
        self.num_generated = [0] * num_rows
        self._rows_sample = self._top_k = self._top_p = False
        # Penalties and biases (`SamplingParams.penalized`): per row, and the column where its output begins.
        self.presence = torch.zeros(num_rows, device=device)
        self.frequency = torch.zeros(num_rows, device=device)
        self.repetition = torch.ones(num_rows, device=device)
        self.output_start = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.history_start = torch.zeros(num_rows, dtype=torch.long, device=device)
        self._width: int | None = None  # columns holding every history of the step (`prepare`)
        self.bias: torch.Tensor | None = None  # [rows, vocab], made when a row first asks for a logit bias
        self._penalized = self._repeats = self._biased = self._held = self._counted = False

    def set(self, row: int, params: SamplingParams | None, output_start: int | torch.Tensor = 0,
            history_start: int | torch.Tensor = 0) -> None:
        """Row `row`'s settings; its tokens begin at column `history_start` of the batch's `token_ids` (its prompt:
        what the repetition penalty counts from) and its output at `output_start` (what the frequency and presence
        penalties count from)."""
        self.settings[row] = params
        params = params or SamplingParams()
        self.temperature[row] = params.temperature if not params.greedy else 1.0
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.greedy[row] = params.greedy
        self.num_generated[row] = 0
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        self.output_start[row] = output_start
        self.history_start[row] = history_start
        self.min_tokens[row] = params.min_tokens
        if self.bias is not None:
            self.bias[row] = 0
        if params.logit_bias:
            if self.vocab_size is None:
                raise ValueError("logit_bias needs the vocabulary size: RowSampling(..., vocab_size=)")
            if self.bias is None:
                self.bias = torch.zeros(len(self.settings), self.vocab_size, device=self.device)
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=self.device)
            if int(ids.max()) >= self.vocab_size:
                raise ValueError(f"logit_bias names token {int(ids.max())}, outside the model's vocabulary of "
                                 f"{self.vocab_size}")
            self.bias[row, ids] = torch.tensor(list(params.logit_bias.values()), device=self.device)

    def prepare(self, rows: list[int], width: int | None = None) -> bool:
        """Called before each step with its rows (`width`: columns of `token_ids` that hold every position's history
        this step, drafts included; `None`: all); returns whether any of them samples."""
        self._width = width
        used = [self.settings[r] for r in rows]
        sampled = [s for s in used if s is not None and not s.greedy]
        self._rows_sample = bool(sampled)
        self._top_k = any(s.top_k for s in sampled)
        self._top_p = any(s.top_p < 1 for s in sampled)
        penalized = [s for s in used if s is not None and s.penalized]
        self._repeats = any(s.repetition_penalty != 1 for s in penalized)
        self._biased = any(s.logit_bias for s in penalized)
        self._held = any(s.min_tokens for s in penalized)
        # Penalties that count a history's tokens (a bias or min_tokens alone needs no counting).
        self._counted = any(s.presence_penalty or s.frequency_penalty for s in penalized) or self._repeats
        self._penalized = bool(penalized)
        return self._rows_sample

    @property
    def history_free(self) -> bool:
        """Whether the scores of a position depend only on the row (not on its tokens): not with penalties."""
        return not self._penalized

    def __bool__(self) -> bool:
        return True

    def __call__(self, token_ids, rows: torch.Tensor, history_lens, scores: torch.Tensor,
                 batch_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Scores `[n, vocab]` of n positions: position i is of row `rows[i]` of `token_ids`, its history the first
        `history_lens[i]` columns there (`batch_rows[i]`: the batch row whose settings apply, when `token_ids` holds
        one history per position)."""
        settings = rows if batch_rows is None else batch_rows
        if self._penalized:
            if history_lens is None:
                raise ValueError("penalties need each position's history")
            history = None
            if self._counted:
                history = token_ids[rows] if self._width is None else token_ids[rows, :self._width]
            scores = self._penalize(history, settings, history_lens, scores.float())
        if not self._rows_sample:  # greedy rows take the target's argmax of the raw scores
            return scores.float()
        return apply_sampling_params(scores.float(), self.temperature[settings],
                                     self.top_k[settings] if self._top_k else None,
                                     self.top_p[settings] if self._top_p else None)

    def _penalize(self, history: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                  scores: torch.Tensor) -> torch.Tensor:
        """Bias, then repetition, frequency and presence penalties (vLLM's order), every position counting the
        tokens of its own history: `history` `[n, width]`, each position's first `lengths[i]` columns. Rows
        without penalties come out unchanged (their settings are neutral)."""
        n, vocab = scores.shape
        if self._biased:
            scores = scores + self.bias[rows, :vocab] if vocab <= self.vocab_size else torch.nn.functional.pad(
                self.bias[rows], (0, vocab - self.vocab_size)) + scores
        if self._counted:
            scores = self._count_penalties(history, rows, lengths, scores)
        if self._held:  # fewer than min_tokens generated before this position: no end-of-sequence token yet
            early = (lengths - self.output_start[rows]) < self.min_tokens[rows]
            scores = scores.masked_fill(early[:, None] & self._eos_mask(vocab), float("-inf"))
        return scores

    def _eos_mask(self, vocab: int) -> torch.Tensor:
        """`[vocab]` whether each token ends a sequence, made once per logits width."""
        if vocab not in self._eos_masks:
            mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            mask[self.eos_token_ids[self.eos_token_ids < vocab]] = True
            self._eos_masks[vocab] = mask
        return self._eos_masks[vocab]

    def _count_penalties(self, history, rows, lengths, scores) -> torch.Tensor:
        n, vocab = scores.shape
        cols = torch.arange(history.shape[1], device=history.device)
        seen = (cols < lengths[:, None]) & (cols >= self.history_start[rows][:, None])
        tokens = history.clamp(0, vocab - 1)
        output = seen & (cols >= self.output_start[rows][:, None])
        counts = scores.new_zeros(n, vocab + 1).scatter_add_(1, torch.where(output, tokens, vocab),
                                                             torch.ones_like(tokens, dtype=scores.dtype))[:, :vocab]
        if self._repeats:
            anywhere = scores.new_zeros(n, vocab + 1, dtype=torch.bool).scatter_(
                1, torch.where(seen, tokens, vocab), True)[:, :vocab]
            factor = self.repetition[rows][:, None]
            scores = torch.where(anywhere, torch.where(scores > 0, scores / factor, scores * factor), scores)
        return scores - self.frequency[rows][:, None] * counts - self.presence[rows][:, None] * (counts > 0)

    def verify_arguments(self, rows: list[int], k: int) -> dict:
        rows_t = torch.tensor(rows, device=self.device)
        arguments = {"is_greedy": self.greedy[rows_t]}
        # A sampled row with a seed draws each token from its own stream (seed, position): its output is the same
        # whatever the drafts, k, speculator or company (`verify.sample_by_position`).
        seeded = [i for i, r in enumerate(rows) if self.settings[r] is not None and self.settings[r].seed is not None
                  and not self.settings[r].greedy]
        if seeded:
            streams = [(self.settings[rows[i]].seed * 1_000_003 + self.num_generated[rows[i]]) % (2**63 - 1)
                       for i in seeded]
            arguments["seeded"] = (seeded, streams)
        return arguments
