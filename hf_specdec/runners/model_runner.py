"""Runs a transformers causal LM over ragged rows whose KV lives in a `PagedKVCache`."""

from __future__ import annotations

import inspect
import itertools
import os
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..cache.attention import ATTENTION_NAME, PLAN_KWARG
from ..cache.layout import host_to_device, ragged
from ..cache.paged import KeptPools, PagedKVCache
from ..cache.recurrent import make_cache, recurrent_layers_split
from ..cache.rope import RopeRows, rope_factors
from ..errors import UnsupportedModelError
from ..kernels._backend import resolve_backend
from .distributed import RankZeroDecides, tp_group
from .graphed import GraphedSteps, GraphSettings, say_once


@contextmanager
def paged_attention(*models):
    """Switches the models to hf_specdec's paged attention (and per-row recurrent state, `cache/recurrent.py`) for
    the duration, then restores what they had."""
    saved = [m.config._attn_implementation for m in models]
    try:
        with ExitStack() as stack:
            for m in models:
                m.set_attn_implementation(ATTENTION_NAME)
                stack.enter_context(recurrent_layers_split(m))
            yield
    finally:
        for m, name in zip(models, saved):
            m.set_attn_implementation(name)


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where `module` computes. For a model dispatched by accelerate (`device_map`, CPU or disk offload) that is its
    hook's execution device, and `module.device` may be `meta`; otherwise the device of its first parameter."""
    for hook in _hooks(getattr(module, "_hf_hook", None)):
        if getattr(hook, "execution_device", None) is not None:
            return torch.device(hook.execution_device)
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")  # a module without tensors (or all on meta without a hook) computes on the host


def _hooks(hook) -> list:
    return [] if hook is None else list(getattr(hook, "hooks", None) or [hook])  # accelerate's SequentialHook


def input_device(model) -> torch.device:
    """Where a model's token ids must go: its input embedding's execution device (the first GPU of a model spread
    over several, the host for a fully offloaded one), never `model.device`, which is `meta` when weights live on
    disk."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    try:
        return execution_device(embeddings) if embeddings is not None else execution_device(model)
    except NotImplementedError:
        return execution_device(model)


def _to(value, device: torch.device):
    return value.to(device) if isinstance(value, torch.Tensor) and value.device != device else value


class CacheRows:
    """A runner's rows, each kept by its `cache` (rollback is the cache's declared capability)."""

    cache = None

    def add_sequence(self, seq_id: int, prompt_length: int = 0) -> None:
        """A new row. `prompt_length`: the tokens its first forward would feed in plain decoding (its prompt), where
        the model's rotary embedding depends on it (`rope.TokenRope`); 0 where unknown (a draft's rows)."""
        self.cache.add_sequence(seq_id)

    def length(self, seq_id: int) -> int:
        return self.cache.length(seq_id)

    def rollback(self, seq_id: int, length: int) -> None:
        self.cache.rollback(seq_id, length)

    def rollback_many(self, seq_ids: list[int], lengths: list[int]) -> None:
        """`rollback` for several rows (a step's commit): in one pass where the cache has one."""
        many = getattr(self.cache, "rollback_many", None)
        if many is not None:
            many(seq_ids, lengths)
            return
        for seq_id, length in zip(seq_ids, lengths):
            self.rollback(seq_id, length)

    def free(self, seq_id: int) -> None:
        self.cache.free(seq_id)

    def draft_room(self, seq_ids: list[int], lengths) -> list[int] | None:
        """The most drafts each row may verify in its next forward after `lengths[seq_id]` committed tokens, where
        the model limits it (LongRoPE: `rope.RopeRows`); None: no limit."""
        return None

    def recompute_due(self, seq_ids: list[int]) -> list[int]:
        """Rows whose next forward must feed their whole sequence again first (`ModelRunner.recompute`)."""
        return []


class ModelRunner(CacheRows):
    """One model and its paged cache. Rows are identified by the caller's integer ids.

    Args:
        model (`PreTrainedModel`): a decoder-only model using transformers' attention interface.
        block_size (`int`): KV block size in tokens.
        max_num_blocks (`int`, *optional*): cap on the KV pool.
    """

    def __init__(self, model, block_size: int = 16, num_blocks: int = 64, max_num_blocks: int | None = None,
                 packed: bool | None = None):
        self.model = model
        self.cache = make_cache(model, block_size=block_size, num_blocks=num_blocks, max_num_blocks=max_num_blocks)
        # Ragged steps go through the model as one stream of real tokens (`PackedLayout`) where the model passed the
        # packed trial (support.py); `packed=False` keeps every step padded (benchmarks compare the two). Recurrent
        # layers step each row through its own positions, so their models stay padded.
        self.packed = (packs(model) if packed is None else packed) and type(self.cache) is PagedKVCache
        # Context groups (`layout.context_groups`) only where the model passed their trial (support.py).
        if not getattr(model, "_hf_specdec_context_groups", False) and hasattr(self.cache, "context_split"):
            self.cache.context_split = False
        self.num_packed_forwards = 0
        self.device = input_device(model)  # where inputs and the step plan go; layers copy the plan to their own
        # Under tensor parallelism, rank 0's drafts and verified tokens on every rank (see `distributed.py`).
        self.agree = RankZeroDecides(tp_group(model), self.device)
        self.num_forwards = 0
        # transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name is deprecated there).
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # LongRoPE's factors chosen per token as plain decoding chooses them, from each row's prompt length
        # (`cache/rope.py`).
        self.rope = RopeRows.of(model)
        self.graphs: GraphedSteps | None = None  # compiled narrow steps (`use_graphs`)

    def use_graphs(self, settings: GraphSettings | None) -> None:
        """Runs this runner's narrow steps compiled (`runners/graphed.py`) with these settings; None: eagerly. Only
        where the runner's cache and positions fit the compiled step (a `PagedKVCache`, no per-row rotary factors,
        one device)."""
        fits = type(self.cache) is PagedKVCache and self.rope is None and self.agree.group is None
        if settings is not None and not fits:
            say_once(self.model, f"hf_specdec runs {type(self.model).__name__}'s steps eagerly: compiled steps "
                                 "serve models on the paged cache alone, without per-row rotary factors (LongRoPE) "
                                 "or tensor parallelism")
        self.graphs = GraphedSteps(self.model, self._cache_kwarg, settings) if settings is not None and fits else None
        if self.graphs is not None and settings.bucket:  # CUDA graphs: the pools of the model's last call, if free
            self.cache.keep_pools(self.model.__dict__.setdefault("_hf_specdec_pools", KeptPools()))

    def add_sequence(self, seq_id: int, prompt_length: int = 0) -> None:
        super().add_sequence(seq_id)
        if self.rope is not None:
            self.rope.add(seq_id, prompt_length)

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        if self.rope is not None:
            self.rope.free(seq_id)

    def draft_room(self, seq_ids: list[int], lengths) -> list[int] | None:
        return None if self.rope is None else self.rope.draft_room(seq_ids, lengths)

    def recompute_due(self, seq_ids: list[int]) -> list[int]:
        return [] if self.rope is None else self.rope.due(seq_ids, [self.length(s) for s in seq_ids])

    def recompute(self, seq_ids: list[int], input_ids: torch.Tensor) -> None:
        """Feeds rows `recompute_due` named their whole cached sequence again (`input_ids`, `[rows, tokens]`), rotated
        with LongRoPE's long factors from their start, as the model's `generate` does when a sequence crosses the
        switch (`rope.RopeRows`)."""
        width = input_ids.shape[1]
        for seq_id in seq_ids:
            self.rollback(seq_id, 0)
            self.rope.rotated_long(seq_id)
        self.forward(seq_ids, input_ids, [width] * len(seq_ids), num_logits=1)

    def give_regions(self, seq_ids: list[int], num_tokens: int) -> bool:
        """Gives these row ids room for `num_tokens` tokens each in one region of the pool, the regions one after
        another (`PagedKVCache.give_regions`), where attention gathers each row's context before attending (the
        PyTorch path): while rows with consecutive regions step together, it reads their keys and values in place
        instead. Returns False, giving nothing, where that does not apply (the Triton kernel reads blocks in place
        anyway; pools kept between calls for CUDA graphs)."""
        if (not isinstance(self.cache, PagedKVCache) or self.cache.kept is not None
                or resolve_backend(self.cache.kernel_backend, self.device) != "torch"):
            return False  # (pools kept between calls would grow by the regions in every call)
        self.cache.give_regions(seq_ids, num_tokens)
        return True

    def forward(self, seq_ids: list[int], input_ids: torch.Tensor, num_tokens: list[int], num_logits: int,
                output_hidden_states: bool | tuple[int, ...] = False, tree=None, logit_counts: list[int] | None = None,
                packed_states: bool = False, state_window: int | None = None, packed_logits: bool = False,
                **model_kwargs):
        """Appends `num_tokens[i]` tokens to row `seq_ids[i]` and returns the model output.

        Args:
            input_ids: `[rows, q]` right-aligned tokens (row i's are its last `num_tokens[i]` columns).
            num_logits: how many trailing positions need logits.
            output_hidden_states: True, or the indices of the entries the caller reads (the others may be None).
            packed_states: a packed step leaves the entries asked for as its `[1, T, hidden]` stream (row i's
                `num_tokens[i]` tokens one after another, rows in order) and sets `out.states_packed`, for
                `committed_hidden_states` to pick from, instead of padding them to `[rows, q, hidden]`.
            tree (`TreeAttention`, *optional*): the step feeds draft-tree nodes (see `layout.TreeAttention`).
            logit_counts: row i needs only its last `logit_counts[i]` positions (at most `num_logits`): they come
                left-aligned, columns past them repeating its last. A packed step then runs the LM head over those
                positions alone, not over `num_logits` per row (a row verifying 10 drafts beside rows feeding one
                token would otherwise pay for 11 positions in every row).
            state_window: recurrent layers keep their state after each of each row's last this many positions (the
                positions a row may roll back to; default `num_logits`): a prompt scored at every position rolls
                back nowhere, and keeps one.
            packed_logits: with `logit_counts`, a packed step leaves its logits as computed, `[1, K, vocab]` (each
                row's kept positions one after another), and sets `out.logit_index`, `[rows * num_logits]`, the kept
                position each left-aligned entry shows, instead of spreading them to `[rows, num_logits, vocab]`
                (at a 262k vocabulary 16 rows of up to 3 positions make a 50 MB copy a step). A step that is not
                packed returns its logits as usual and sets no index.
            model_kwargs: passed on to the model (a draft head's input features, say).
        Returns:
            The model output; `logits` is `[rows, num_logits, vocab]`, right-aligned (each row's trailing positions)
            or, with `logit_counts`, left-aligned.
        """
        caller = input_ids.device  # outputs go back there: the model may sit on other devices than the batch
        input_ids = _to(input_ids, self.device)
        model_kwargs = {name: _to(value, self.device) for name, value in model_kwargs.items()}
        rows, width = input_ids.shape
        # Packed only where padding would be fed: rows of different widths, every row feeding something. Tensor
        # arguments must be per token (`[rows, q, ...]`, a draft head's input features) to be packed alongside.
        pack = (self.packed and tree is None and sum(num_tokens) < rows * width and min(num_tokens) > 0
                and width == max(num_tokens) and all(not isinstance(v, torch.Tensor) or v.shape[:2] == (rows, width)
                                                     for v in model_kwargs.values()))
        if (self.graphs is not None and self.graphs.eligible(num_tokens, tree, model_kwargs, width)
                and self.cache.key_pools):
            return self._graphed(seq_ids, input_ids, num_tokens, num_logits, output_hidden_states, logit_counts,
                                 caller, model_kwargs)
        starts = self.cache.reserve(seq_ids, num_tokens)
        # Recurrent layers keep their state after each of these positions.
        self.cache.num_logits = num_logits if state_window is None else state_window
        plan = self.cache.plan_step(seq_ids, starts, num_tokens, self.device, _tree_to(tree, self.device), pack)
        self.num_forwards += 1
        layout, keep, expand = plan.packed, num_logits, None
        position_ids = plan.query_positions
        if layout is not None:
            self.num_packed_forwards += 1
            input_ids = input_ids.reshape(-1).index_select(0, layout.pack_index)[None]
            model_kwargs = {name: v.reshape(rows * width, *v.shape[2:]).index_select(0, layout.pack_index)[None]
                            if isinstance(v, torch.Tensor) else v for name, v in model_kwargs.items()}
            position_ids = layout.positions
            num_logits = min(num_logits, width)
            if logit_counts is not None:  # only the positions asked for, each once; spread to columns after
                keep, expand = host_to_device(_packed_logit_index(num_tokens, logit_counts, num_logits),
                                              self.device)
            else:  # each row's trailing `num_logits` positions, by their place in the stream
                keep = layout.unpack_index.view(rows, width)[:, width - num_logits:].reshape(-1)
        factors = None  # LongRoPE's factors for this forward's tokens (`cache/rope.py`)
        if self.rope is not None:
            factors = self.rope.factors(seq_ids, starts, num_tokens, plan.query_positions, self.device)
            if factors[1] is not None and layout is not None:
                factors = (factors[0], factors[1].reshape(-1).index_select(0, layout.pack_index)[None])
        out = self._call(plan, input_ids, position_ids, keep, output_hidden_states, model_kwargs, factors)
        if isinstance(out, torch.Tensor):  # a draft head returns its hidden states
            if layout is not None:  # `[1, T, hidden]` to `[rows, q, hidden]`, as the padded layout returns them
                out = out[0].index_select(0, layout.unpack_index.to(out.device)).view(rows, width, -1)
            return _to(out, caller)
        if layout is not None:
            layers = output_hidden_states if isinstance(output_hidden_states, tuple) else None
            _unpack_output(out, layout, keep, rows, num_logits, layers, expand, packed_states, packed_logits)
            if packed_logits and expand is not None:  # left packed: only moved to the caller's device
                out.logit_index = _to(out.logit_index, caller)
                return self._finish(out, out.logits.shape[1], None, caller)
        return self._finish(out, num_logits, logit_counts if expand is None else None, caller)

    def _call(self, plan, input_ids, position_ids, keep, output_hidden_states, model_kwargs, factors=None):
        """The model's forward over the planned step (eagerly)."""
        with self.cache.active(plan), rope_factors(factors):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                **{self._cache_kwarg: self.cache},
                use_cache=True,
                logits_to_keep=keep,
                output_hidden_states=bool(output_hidden_states),
                **model_kwargs,
                **{PLAN_KWARG: plan},
            )
        if plan.num_attended < plan.num_updates:  # (differential attention attends twice per layer: fine)
            raise UnsupportedModelError(
                f"{type(self.model).__name__} attended in {plan.num_updates - plan.num_attended} of its "
                f"{plan.num_updates} layers without transformers' attention interface, so hf_specdec's paged "
                "attention cannot serve it"
            )
        return out

    def _graphed(self, seq_ids, input_ids, num_tokens, num_logits, output_hidden_states, logit_counts, caller,
                 model_kwargs):
        """A narrow step through the compiled forward (`runners/graphed.py`), padded (right-aligned rows, as the
        unpacked eager step); eagerly where that cannot run it."""
        width = input_ids.shape[1]
        starts = self.cache.reserve(seq_ids, num_tokens)
        self.cache.num_logits = num_logits
        plan = self.cache.plan_step(seq_ids, starts, num_tokens, self.device, None, False)
        self.num_forwards += 1

        def eager():
            return self._call(plan, input_ids, plan.query_positions, width, output_hidden_states, model_kwargs)

        num_context = max(s + n for s, n in zip(starts, num_tokens))
        out = self.graphs.run(self.cache, plan, input_ids, num_context, bool(output_hidden_states), eager,
                              model_kwargs)
        if out is None:
            out = eager()
        if isinstance(out, torch.Tensor):  # a draft head returns its hidden states
            return _to(out, caller)
        return self._finish(out, num_logits, logit_counts, caller)

    @staticmethod
    def _finish(out, num_logits: int, logit_counts: list[int] | None, caller):
        """The output's logits to `[rows, num_logits, vocab]` (left-aligned with `logit_counts`) and everything on
        the caller's device."""
        logits = getattr(out, "logits", None)
        if logits is not None and logits.shape[1] > num_logits:  # the model ignored logits_to_keep (Whisper)
            out.logits = logits = logits[:, -num_logits:]
        if logits is not None and logit_counts is not None:
            out.logits = logits = left_aligned(logits, logit_counts)
        if logits is not None:
            out.logits = _to(logits, caller)
        if getattr(out, "hidden_states", None) is not None:
            out.hidden_states = tuple(None if h is None else _to(h, caller) for h in out.hidden_states)
        return out


def packs(model) -> bool:
    """Whether `model` takes ragged steps packed: it passed the packed trial (`support._trial_forward`), and the
    `HF_SPECDEC_PACKED=0` switch (for comparisons) is not set."""
    return bool(getattr(model, "_hf_specdec_packable", False)) and os.environ.get("HF_SPECDEC_PACKED", "1") != "0"


def _unpack_output(out, layout, keep: torch.Tensor, rows: int, num_logits: int, layers=None,
                   expand: torch.Tensor | None = None, packed_states: bool = False,
                   packed_logits: bool = False) -> None:
    """A packed forward's logits at the `keep` positions of the stream (or the whole stream's, where the model
    ignored `logits_to_keep`) to `[rows, num_logits, vocab]` (through `expand`, the kept position of each output
    entry, when given), and its hidden states `[1, T, hidden]` to the padded `[rows, q, hidden]` (padding repeats the
    row's first token), as the padded layout returns them: those at `layers` only, when given (the others become
    None; a newcomer's prompt makes every row as wide as it). `packed_states`: those stay packed
    (`out.states_packed`). `packed_logits`, with `expand`: the logits stay `[1, K, vocab]` and `expand` becomes
    `out.logit_index`."""
    logits = getattr(out, "logits", None)
    if logits is not None:
        if logits.shape[1] != keep.numel():
            logits = logits[:, keep.to(logits.device)]
        if expand is not None and packed_logits:
            out.logits, out.logit_index = logits, expand.to(logits.device)
        else:
            if expand is not None:
                logits = logits[0].index_select(0, expand.to(logits.device))
            out.logits = logits.view(rows, num_logits, logits.shape[-1])
    if getattr(out, "hidden_states", None) is not None:
        if packed_states:
            out.states_packed = True
            out.hidden_states = tuple(h if layers is None or i in layers else None
                                      for i, h in enumerate(out.hidden_states))
            return
        out.hidden_states = tuple(
            h[0].index_select(0, layout.unpack_index.to(h.device)).view(rows, -1, h.shape[-1])
            if layers is None or i in layers else None for i, h in enumerate(out.hidden_states))


def _packed_logit_index(num_tokens: list[int], logit_counts: list[int], num_logits: int
                        ) -> list[np.ndarray]:
    """For a packed stream of rows holding `num_tokens` each: the stream positions of each row's last
    `logit_counts[i]` tokens (row by row), and for each entry of a left-aligned `[rows, num_logits]` the index of
    the kept position it shows (past a row's own, its last). Host arrays, from host lists: nothing waits."""
    if any(not 1 <= w <= min(f, num_logits) for f, w in zip(num_tokens, logit_counts)):
        raise ValueError(f"logit_counts must be between 1 and each row's tokens (at most num_logits={num_logits}), "
                         f"got {logit_counts} for {num_tokens}")
    fed = np.asarray(num_tokens, dtype=np.int64)
    want = np.asarray(logit_counts, dtype=np.int64)
    row_of, within = ragged(want)
    keep = np.cumsum(fed)[row_of] - want[row_of] + within
    first = np.cumsum(want) - want
    expand = first[:, None] + np.minimum(np.arange(num_logits)[None, :], want[:, None] - 1)
    return [keep, expand.reshape(-1)]


def left_aligned(logits: torch.Tensor, logit_counts: list[int]) -> torch.Tensor:
    """Right-aligned `[rows, n, vocab]` (each row's trailing positions) to left-aligned: row i's last
    `logit_counts[i]` from column 0, later columns repeating its last (a copy only where the counts differ)."""
    width = logits.shape[1]
    if all(c == width for c in logit_counts):
        return logits
    own = torch.tensor(logit_counts, device=logits.device)
    cols = torch.minimum(torch.arange(width, device=logits.device)[None, :], own[:, None] - 1) + (width - own)[:, None]
    return logits.gather(1, cols[:, :, None].expand(-1, -1, logits.shape[-1]))


def _tree_to(tree, device):
    if tree is None or tree.region_start.device == device:
        return tree
    return type(tree)(*(_to(getattr(tree, f), device) for f in ("region_start", "query_positions", "region_mask",
                                                                   "region_positions")))


@dataclass
class TargetHiddenStates:
    """The target's hidden states at committed positions a speculator has not seen yet (from the verify forward).

    Attributes:
        states: `[rows, width, features]` right-aligned: row i's states are its last `num_states[i]` columns and
            belong to positions `start_positions[i], start_positions[i] + 1, ...` of that row. `features` is the
            concatenation, in the order asked for, of the requested `output_hidden_states` entries. With `ragged`,
            `[sum(num_states), features]` instead: the rows' states one after another, no padding (a packed step
            where a newcomer's prompt would make every row as wide as it).
        num_states: states per row, on the host.
        start_positions: position of each row's first state, on the host.
        rows: the batch rows, in the order of `states`.
        ragged: `states` holds the rows one after another (read them through `row` and `newest`).
    """

    states: torch.Tensor
    num_states: list[int]
    start_positions: list[int]
    rows: list[int]
    ragged: bool = False

    def __post_init__(self):
        self._starts = list(itertools.accumulate(self.num_states, initial=0)) if self.ragged else None

    def row(self, i: int) -> torch.Tensor:
        """`[num_states[i], features]`: the i-th row's states, oldest first (a view)."""
        if not self.ragged:
            return self.states[i, self.states.shape[1] - self.num_states[i]:]
        return self.states[self._starts[i]:self._starts[i + 1]]

    def newest(self) -> torch.Tensor:
        """`[rows, features]`: each row's newest state (any value for a row with none)."""
        if not self.ragged:
            return self.states[:, -1]
        if not len(self.states):
            return self.states.new_zeros(len(self.rows), self.states.shape[-1])
        return self.states[(torch.tensor(self._starts[1:], device=self.states.device) - 1).clamp(min=0)]


def committed_hidden_states(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...], rows: list[int],
                            num_fed: list[int], start_positions: list[int], num_committed: list[int],
                            packed: bool = False) -> TargetHiddenStates:
    """Keeps, per row, the hidden states of the first `num_committed[i]` fed tokens (the rest were rejected drafts).

    Args:
        hidden_states: a model output's `hidden_states`, each `[rows, q, hidden]`, fed right-aligned (row i's tokens
            are its last `num_fed[i]` columns); or, with `packed`, a packed step's `[1, T, hidden]` stream.
            Index i is the input to decoder layer i; the last entry is the final hidden state after the model's norm
            (transformers' convention).
        layers: which entries to keep, concatenated in this order along the last dimension.
        packed: `hidden_states` are a packed step's stream (`ModelRunner.forward(..., packed_states=True)`): row
            i's fed tokens one after another from position `sum(num_fed[:i])`. The committed states are then
            picked from it, ragged, with no padding made, at positions worked out on the host (no device read).
    """
    if packed:  # only the committed entries, row after row: no [rows, width, features] tensor
        keep = torch.tensor(num_committed)
        first = torch.tensor(list(itertools.accumulate(num_fed, initial=0))[:-1])  # each row's first in the stream
        stream = torch.repeat_interleave(first - (keep.cumsum(0) - keep), keep) + torch.arange(int(keep.sum()))
        stream = stream.to(hidden_states[layers[0]].device)
        picked = [hidden_states[i][0].index_select(0, stream) for i in layers]
        return TargetHiddenStates(torch.cat(picked, dim=-1) if len(picked) > 1 else picked[0], list(num_committed),
                                  list(start_positions), list(rows), ragged=True)
    states = torch.cat([hidden_states[i] for i in layers], dim=-1) if len(layers) > 1 else hidden_states[layers[0]]
    q = states.shape[1]
    width = max(max(num_committed), 1)
    device = states.device
    fed = torch.tensor(num_fed, device=device)
    keep = torch.tensor(num_committed, device=device)
    offset = torch.arange(width, device=device)[None, :] - (width - keep)[:, None]  # [rows, width]; < 0 is padding
    cols = (q - fed)[:, None] + offset.clamp(min=0)
    picked = states[torch.arange(len(rows), device=device)[:, None], cols]
    return TargetHiddenStates(picked, list(num_committed), list(start_positions), list(rows))
