"""Runs a causal LM that attends by its own code over ragged rows whose KV lives in a `MaskedKVCache`.

`make_runner` is the one place where a model's runner is chosen, once per model: models that attend through
transformers' attention interface get the paged `ModelRunner`; the others (Bloom, GPT-Neo, MPT, XGLM, ...)
get a `DenseRunner`, which has the same interface (`forward`, `add_sequence`, `length`, `rollback`, `free`), so the
engine, the step and the scheduler never ask which one they hold. What a dense runner cannot do is refused up front:
draft trees (their attention mask is not a per-row column mask) and a KV block cap (the cache is as wide as the
batch's longest row).

A step's rows arrive right-aligned (`[rows, q]`, row i's tokens in its last `num_tokens[i]` columns, as the paged
runner takes them); the dense runner feeds them left-aligned, so a row's new tokens follow its cached ones with no
hole between them, with explicit `position_ids` (each row's own) and the cache's 2D attention mask, and hands the
logits (and hidden states) back right-aligned.
"""

from __future__ import annotations

import inspect
from contextlib import ExitStack, contextmanager

import torch

from ..cache.masked import MaskedKVCache
from ..errors import UnsupportedModelError
from .distributed import RankZeroDecides, tp_group
from .model_runner import CacheRows, ModelRunner, input_device, paged_attention

# Config fields of attention windows counted in cache columns: holes would widen them, so rows stay contiguous.
_WINDOW_FIELDS = ("sliding_window", "window_size", "attention_window", "local_attention_window")
# Compact once a quarter of the width is holes: attending over holes and copying rows to remove them both move cache
# cells, and this moved the fewest (the retired benchmarks/masked_cache_holes.py; docs/reliability.md).
DEFAULT_MAX_HOLE_FRACTION = 0.25


def uses_paged_cache(model) -> bool:
    """Whether `model` attends through transformers' attention interface (then our paged attention serves it), and
    its attention needs nothing from the model's own mask: an ALiBi model (Falcon with `alibi=True`, on the interface
    from transformers 5.25) adds its position bias to the mask it passes, which paged attention, masking by the
    step plan, would drop; it keeps its own attention over the masked cache."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config.get_text_config(), "alibi", False):
        return False
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return model._can_set_attn_implementation() or (
        decoder is not None and decoder is not model and type(decoder)._can_set_attn_implementation())


def make_runner(model, block_size: int = 16, num_blocks: int = 64, max_num_blocks: int | None = None):
    """The runner for `model`: a paged `ModelRunner` or, for models outside the attention interface, a
    `DenseRunner`."""
    if uses_paged_cache(model):
        return ModelRunner(model, block_size=block_size, num_blocks=num_blocks, max_num_blocks=max_num_blocks)
    return DenseRunner(model, block_size=block_size, max_num_blocks=max_num_blocks)


@contextmanager
def runner_attention(*models):
    """Switches the models that run on the paged cache to our paged attention for the duration (the others keep
    their own attention)."""
    with ExitStack() as stack:
        paged = [m for m in models if uses_paged_cache(m)]
        if paged:
            stack.enter_context(paged_attention(*paged))
        yield


def needs_contiguous_rows(model) -> bool:
    """Whether the model's attention depends on how far apart cache columns are, so rows must hold no holes: an
    attention window in its config, or what `check_dense_supported`'s trial found (ALiBi by column, as MPT's)."""
    found = getattr(model, "_hf_specdec_contiguous_rows", None)
    return found if found is not None else True  # untried: the layout every such model takes


def _has_attention_window(model) -> bool:
    config = model.config.get_text_config()
    return any(getattr(config, name, None) for name in _WINDOW_FIELDS)


class DenseRunner(CacheRows):
    """One model and its `MaskedKVCache`. Rows are identified by the caller's integer ids.

    Args:
        model (`PreTrainedModel`): a decoder-only model that takes a cache object and a 2D attention mask.
        block_size (`int`): the unit of the cache's block accounting (`cache.manager`).
        max_num_blocks (`int`, *optional*): must be `None`: a dense cache has no block pool to cap.
        contiguous (`bool`, *optional*): keep every row free of holes (compact before each forward that needs it);
            by default what `needs_contiguous_rows` says.
        max_hole_fraction (`float`, *optional*): otherwise, compact once holes would be this fraction of the width
            (default `DEFAULT_MAX_HOLE_FRACTION`).
    """

    supports_trees = False
    packed = False  # rows share the cache's columns: every step is padded to the widest row

    def __init__(self, model, block_size: int = 16, max_num_blocks: int | None = None,
                 contiguous: bool | None = None, max_hole_fraction: float | None = None):
        if max_num_blocks is not None:
            raise UnsupportedModelError(
                f"{type(model).__name__} runs on hf_specdec's masked cache (it does not use transformers' attention "
                "interface), which is as wide as the batch's longest row and has no block pool to cap; drop "
                "max_num_blocks="
            )
        self.model = model
        self.device = input_device(model)
        self.agree = RankZeroDecides(tp_group(model), self.device)
        self.num_forwards = 0
        contiguous = needs_contiguous_rows(model) if contiguous is None else contiguous
        config = model.config.get_text_config()
        if max_hole_fraction is None:
            max_hole_fraction = DEFAULT_MAX_HOLE_FRACTION
        self.cache = MaskedKVCache(self.device, block_size, 0.0 if contiguous else max_hole_fraction,
                                   max_width=getattr(config, "max_position_embeddings", None))
        parameters = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in parameters else "past_key_values"
        self._takes_positions = "position_ids" in parameters
        self._takes_logits_to_keep = "logits_to_keep" in parameters

    def forward(self, seq_ids: list[int], input_ids: torch.Tensor, num_tokens: list[int], num_logits: int,
                output_hidden_states: bool | tuple[int, ...] = False, tree=None, logit_counts: list[int] | None = None,
                packed_states: bool = False, state_window: int | None = None, packed_logits: bool = False,
                **model_kwargs):
        """Appends `num_tokens[i]` tokens to row `seq_ids[i]` and returns the model output.

        Args:
            input_ids: `[rows, q]` right-aligned tokens (row i's are its last `num_tokens[i]` columns).
            num_logits: how many trailing positions need logits (at most each row's `num_tokens`).
            logit_counts: as `ModelRunner.forward`: row i's last `logit_counts[i]` positions, left-aligned.
            packed_states: as `ModelRunner.forward`; a dense step is never packed, so its states come padded.
            state_window: as `ModelRunner.forward`; the masked cache keeps no recurrent state, so it is not used.
            packed_logits: as `ModelRunner.forward`; a dense step is never packed, so its logits come padded.
        Returns:
            The model output; `logits` is `[rows, num_logits, vocab]` and `hidden_states` right-aligned like the input.
        """
        if tree is not None:
            raise ValueError(f"{type(self.model).__name__} runs on hf_specdec's masked cache, which cannot attend "
                             "by a draft tree; drop speculative_tree_nodes=")
        caller = input_ids.device
        input_ids = input_ids.to(self.device)
        q = input_ids.shape[1]
        attention_mask, starts = self.cache.begin_step(seq_ids, num_tokens)
        counts = torch.tensor(num_tokens, device=self.device)
        columns = torch.arange(q, device=self.device)[None, :]
        # Left-align: row i's j-th token sits at column q - n_i + j; columns past its tokens repeat its last one.
        left = input_ids.gather(1, ((q - counts)[:, None] + columns).clamp(max=q - 1))
        positions = torch.tensor(starts, device=self.device)[:, None] + torch.minimum(columns, counts[:, None] - 1)
        keep = min(q, q - min(num_tokens) + num_logits)  # trailing columns holding every row's last num_logits
        kwargs = {"position_ids": positions} if self._takes_positions else {}
        if self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        self.num_forwards += 1
        try:
            out = self.model(input_ids=left, attention_mask=attention_mask, **{self._cache_kwarg: self.cache},
                             use_cache=True, output_hidden_states=bool(output_hidden_states), **kwargs,
                             **{name: _to(value, self.device) for name, value in model_kwargs.items()})
        finally:
            self.cache.end_step()
        logits = out.logits[:, -keep:]
        # Row i's last `want` tokens: left columns n_i - want .., i.e. kept columns minus (q - keep); past its own,
        # its last again (left-aligned), or all `num_logits` of them (right-aligned).
        want = torch.tensor(logit_counts if logit_counts is not None else [num_logits] * len(num_tokens),
                            device=self.device)
        within = torch.minimum(torch.arange(num_logits, device=self.device)[None, :], want[:, None] - 1)
        picks = (counts[:, None] - want[:, None] + within - (q - keep)).clamp(min=0)
        out.logits = _to(logits.gather(1, picks.to(logits.device)[..., None].expand(-1, -1, logits.shape[-1])), caller)
        if getattr(out, "hidden_states", None) is not None:
            right = (columns - (q - counts)[:, None]).clamp(min=0)  # right-aligned column j <- left column
            out.hidden_states = tuple(_to(h.gather(1, right.to(h.device)[..., None].expand(-1, -1, h.shape[-1])),
                                          caller) for h in out.hidden_states)
        return out


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) and value.device != device else value


def check_dense_supported(model, role: str, name: str) -> None:
    """Up-front check of a model outside the attention interface: it must keep its keys and values in the cache it
    is given, and a row's logits must not depend on the holes and padding around it.

    The trial feeds two rows of different lengths through a `DenseRunner`, rolls both back past a token (a hole
    inside each row), feeds one more token, and compares each row's logits with the model's uncached forward of that
    row alone. It tries holes first, then contiguous rows (for attention that depends on column distances, as MPT's
    ALiBi does); what passes is remembered on the model, so it costs at most eight small forwards once per model."""

    if getattr(model, "_hf_specdec_trial_passed", False):
        return
    parameters = inspect.signature(model.forward).parameters
    missing = [arg for arg in ("attention_mask", "cache|past_key_values")
               if not any(a in parameters for a in arg.split("|"))]
    if missing:
        raise UnsupportedModelError(
            f"the {role} {name} does not use transformers' AttentionInterface and its forward takes no "
            f"{' or '.join(missing[0].split('|'))}, so hf_specdec can neither page its KV cache nor roll rows back "
            "through an attention mask"
        )
    failures = []
    for contiguous in (False, True):
        try:
            with torch.no_grad():
                mismatch, num_updates = _dense_trial(model, contiguous)
        except Exception as error:  # noqa: BLE001 - whatever failed, the model cannot run on the masked cache
            reason = f"{type(error).__name__}: {error}".splitlines()[0]
            raise UnsupportedModelError(
                f"the {role} {name} failed a trial forward through hf_specdec's masked cache ({reason})"
            ) from None
        if num_updates == 0:
            raise UnsupportedModelError(
                f"the {role} {name} keeps no keys and values in the cache it is given, so hf_specdec cannot roll it "
                "back"
            )
        if not mismatch:
            model._hf_specdec_contiguous_rows = contiguous or _has_attention_window(model)
            model._hf_specdec_trial_passed = True
            return
        failures.append(mismatch)
    raise UnsupportedModelError(
        f"the {role} {name} gives a row of a ragged batch other logits than the same row alone ({failures[-1]}; it "
        "likely takes positions from the cache length rather than from position_ids or its attention mask), so "
        "hf_specdec cannot batch it"
    )


def _dense_trial(model, contiguous: bool) -> tuple[str, int]:
    """Returns what differed (empty when nothing did) and how many layer updates the cache saw."""
    vocab = model.config.get_text_config().vocab_size
    device = input_device(model)
    a, b = [t % vocab for t in range(3, 8)], [t % vocab for t in range(8, 11)]
    runner = DenseRunner(model, contiguous=contiguous)
    runner.add_sequence(0)
    runner.add_sequence(1)
    ids = lambda rows: torch.tensor(rows, device=device)  # noqa: E731
    runner.forward([0, 1], ids([a[0:3], [b[0]] * 3]), [3, 1], num_logits=1)
    runner.forward([0, 1], ids([[a[3], a[0]], [b[1], b[0]]]), [2, 2], num_logits=2)  # a draft each, rejected
    runner.rollback(0, 4)
    runner.rollback(1, 2)
    batched = runner.forward([0, 1], ids([[a[4]], [b[2]]]), [1, 1], num_logits=1).logits[:, -1]
    for i, row in enumerate((a, b)):
        alone = model(input_ids=ids([row]), use_cache=False).logits[0, -1]
        tolerance = (1e-3 if alone.dtype in (torch.float32, torch.float64) else 1e-1) * float(alone.abs().max()) + 1e-5
        if float((batched[i] - alone.to(batched.device)).abs().max()) > tolerance:
            return f"row {i} {'with contiguous rows' if contiguous else 'with holes'}", runner.cache.num_updates
    return "", runner.cache.num_updates
