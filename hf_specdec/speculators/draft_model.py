"""A smaller causal LM proposes drafts autoregressively, with its own KV cache (paged, or masked for models outside
transformers' attention interface: `runners.dense.make_runner`)."""

from __future__ import annotations

from contextlib import ExitStack

import torch

from ..decode.speculator import Speculator, sample_or_argmax
from ..runners.dense import make_runner, runner_attention
from ..runners.graphed import for_model
from ..runners.model_runner import ModelRunner
from ..runners.support import check_model_supported, check_vocab_compatible
from ..types import DraftProposal, SequenceBatch, gather_right_aligned


class DraftModelSpeculator(Speculator):
    """Drafts with any decoder-only transformers model that shares the target's tokenizer.

    Each step feeds the draft the tokens it has not seen yet (the whole prompt at first, then the one or two tokens
    committed since), then `k - 1` of its own drafts. The call's logits processors are applied to the draft too, at
    each position with the history that position will have, so it proposes what the target is likely to keep. When
    sampling, drafts are sampled and their draft_probs go to the verifier; greedy drafts are argmax.
    After verification the draft's cache rolls back, per row, to the longest prefix it saw that was committed.

    A draft whose vocabulary is smaller than the target's (embedding padding, as in the Qwen2.5 family) is refused
    when the prompt holds ids it cannot read; ids the target emits past it (untrained padding rows) reach the draft
    as its last id: drafts only propose, so the output stays the target's.

    Args:
        model (`PreTrainedModel`): the draft model.
        block_size (`int`): KV block size in tokens.
        catch_up_tokens (`int`, *optional*): the most unread tokens a row feeds the draft in one step (a newcomer's
            long prompt, a long stretch without drafts); a row with more drafts nothing that step and reads the rest
            in later steps, so no step waits for the draft to read a whole long prompt at once. `None`: no limit
            (a one-call `generate`); the serving engine sets its chunked-prefill budget.
    """

    def __init__(self, model, block_size: int = 16, catch_up_tokens: int | None = None):
        if catch_up_tokens is not None and (isinstance(catch_up_tokens, bool) or catch_up_tokens < 1):
            raise ValueError(f"catch_up_tokens must be an int >= 1 (None: no limit), got {catch_up_tokens!r}")
        self.model = model
        self.block_size = block_size
        self.catch_up_tokens = catch_up_tokens
        self._read_until: dict[int, int] = {}  # rows still catching up -> the tokens of theirs the draft has read
        self.reading_backlog = False  # the latest proposal read a long backlog for some rows (they drafted nothing)
        self._runner: ModelRunner | None = None
        self._stack: ExitStack | None = None
        self._rows: list[int] = []
        self._committed_at_propose: list[int] = []

    def __repr__(self) -> str:
        return f"DraftModelSpeculator({type(self.model).__name__})"

    @property
    def num_forwards(self) -> int:
        return self._runner.num_forwards if self._runner is not None else 0

    def validate(self, target) -> None:
        check_model_supported(self.model, role="draft model (speculator)")
        check_vocab_compatible(target, self.model)  # its device may differ: its runner moves ids and logits

    def relative_cost(self, target) -> float:
        # A decode step of a small model is bound by reading its weights, so cost scales with parameter count.
        return self.model.num_parameters() / target.num_parameters()

    def begin(self, target, batch: SequenceBatch) -> None:
        self._num_embeddings = self.model.get_input_embeddings().num_embeddings
        self._check_prompts_readable(batch)
        self._stack = ExitStack()
        self._stack.enter_context(runner_attention(self.model))
        self._runner = make_runner(self.model, block_size=self.block_size)
        if isinstance(self._runner, ModelRunner):
            self._runner.use_graphs(for_model(self.graph_settings_on(self._runner.device), self.model))
        for row in batch.active:  # (a prompt's length decides its rotary factors where they depend on it)
            self._runner.add_sequence(row, prompt_length=int(batch.lengths[row]))

    def _check_prompts_readable(self, batch: SequenceBatch) -> None:
        if self._num_embeddings >= batch.target_vocab_size:
            return
        cols = torch.arange(batch.token_ids.shape[1], device=batch.device)[None, :] - batch.first_col[:, None]
        real = (cols >= 0) & (cols < batch.lengths_tensor(list(range(len(batch.lengths))))[:, None])
        unreadable = real & (batch.token_ids >= self._num_embeddings)
        if bool(unreadable.any()):
            rows = sorted({int(r) for r in unreadable.nonzero()[:, 0]})
            raise ValueError(
                f"the draft model's vocabulary has {self._num_embeddings} tokens, fewer than the target's "
                f"{batch.target_vocab_size}, and the prompt of rows {rows} holds ids it cannot read (up to "
                f"{int(batch.token_ids[unreadable].max())}); the two models do not share one tokenizer. Pick a "
                "draft from the target's family, or use speculator='ngram', which needs no draft model"
            )

    def propose(self, batch: SequenceBatch, k: int) -> DraftProposal:
        rows = list(batch.active)
        rows_t = batch.active_tensor()
        self._rows = rows
        self._committed_at_propose = [batch.lengths[r] for r in rows]
        self._read_until, self.reading_backlog = {}, False
        if k == 0:
            return DraftProposal.empty(len(rows), batch.device)
        runner = self._runner
        cached = [runner.length(r) for r in rows]
        num_fed = [batch.lengths[r] - c for r, c in zip(rows, cached)]
        # Never below what a row reads in ordinary steps (its last token, k accepted drafts and the bonus token).
        limit = None if self.catch_up_tokens is None else max(self.catch_up_tokens, k + 2)
        if limit is not None and max(num_fed) > limit:
            self.reading_backlog = True
            # Rows with more unread tokens read `limit` of them and draft nothing this step: their drafts would
            # follow the part read, not the committed tokens. The rest of the batch drafts as usual.
            for i, (row, n) in enumerate(zip(rows, num_fed)):
                if n > limit:
                    num_fed[i] = limit
                    self._read_until[row] = cached[i] + limit
        first = batch.first_col[rows_t]
        input_ids = gather_right_aligned(
            batch.token_ids, rows_t, first + torch.tensor(cached, device=batch.device),
            torch.tensor(num_fed, device=batch.device), max(num_fed),
        ).clamp(max=self._num_embeddings - 1)
        end = batch.end_cols(rows)  # column of the first draft
        vocab = min(batch.target_vocab_size, self.model.config.get_text_config().vocab_size)
        tokens, probs = [], []
        for j in range(k):
            logits = runner.forward(rows, input_ids, num_fed, num_logits=1).logits[:, -1]
            scores = batch.processing(batch.token_ids, rows_t, end + j, logits)[:, :vocab]
            token, token_probs = sample_or_argmax(scores, batch.do_sample)
            batch.token_ids[rows_t, end + j] = token  # scratch column: later positions' processors read it
            tokens.append(token)
            probs.append(token_probs)
            input_ids, num_fed = token[:, None].clamp(max=self._num_embeddings - 1), [1] * len(rows)
        token_ids = torch.stack(tokens, dim=1)
        draft_probs = torch.stack(probs, dim=1) if batch.do_sample else None
        counts = torch.full((len(rows),), k, device=batch.device)
        if self._read_until:
            counts[torch.tensor([i for i, r in enumerate(rows) if r in self._read_until], device=batch.device)] = 0
        return DraftProposal(token_ids, counts, draft_probs)

    def commit(self, batch: SequenceBatch, num_accepted: list[int]) -> None:
        # The draft saw the committed tokens plus its own drafts; keep what verification confirmed (for a row still
        # catching up, the committed tokens it read).
        for row, committed, accepted in zip(self._rows, self._committed_at_propose, num_accepted):
            keep = min(self._runner.length(row), committed + accepted, self._read_until.get(row, committed + accepted))
            self._runner.rollback(row, keep)

    def admit(self, batch: SequenceBatch, rows: list[int]) -> None:
        self._check_prompts_readable(batch)
        for row in rows:
            self._runner.add_sequence(row, prompt_length=int(batch.lengths[row]))

    def release(self, rows: list[int]) -> None:
        for row in rows:
            self._runner.free(row)

    def end(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._runner, self._stack = None, None
