"""LongRoPE's factors chosen per token, as one-token decoding chooses them.

LongRoPE (Phi-3's 128k models, Phi-3.5-mini, Phi-4-mini) rotates with its short factors while a sequence fits
`original_max_position_embeddings` and with its long factors past it. transformers picks one set for a whole forward
by that forward's largest position (`dynamic_rope_update`). Plain decoding feeds the prompt in one forward and then
one token at a time, so what it computes is a rule per token: a token at position `p` of a row whose prompt holds `L`
tokens is rotated with the long factors exactly when `max(L, p + 1) > original_max_position_embeddings` (its "rope
length"). A speculative step feeds several tokens of several rows in one forward (a verify spanning the switch, a
row beside a longer one, a piece of a chunked prompt), where the per-forward choice would rotate some of them
differently from plain decoding. `TokenRope` computes the rotary tables with both sets and picks per token by that
rule, while a runner's forward says what its tokens need (`rope_factors`); outside such a forward the model's rotary
embedding works as before.

Phi-3's own `generate` also feeds a sequence again, every token with the long factors, when it reaches that length
(`recomputes_at_switch`); for such models a runner's rows do the same (`RopeRows`).

Keys are cached after rotation, so a stored prompt prefix is reusable only by a prompt rotated the same way:
`RopeRows.prefix_key` (the prefix cache keeps the two sets apart).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar

import torch

# What the forward in progress asks of the models' `TokenRope` modules: ("short" | "long", None) when every token
# takes one set, ("mixed", lengths) with each token's rope length (`[rows, q]`, or the packed `[1, T]`, shaped like
# the forward's `position_ids`) otherwise; None outside a runner's forward.
_FACTORS: ContextVar[tuple[str, torch.Tensor | None] | None] = ContextVar("hf_specdec_rope_factors", default=None)


def longrope_parameters(config) -> list[dict]:
    """The LongRoPE parameter sets of a text config (one, or one per layer type), each with its
    `original_max_position_embeddings`."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = [rope] if "rope_type" in rope or "type" in rope else [p for p in rope.values() if isinstance(p, dict)]
    found = []
    for p in params:
        if p.get("rope_type", p.get("type")) == "longrope":
            original = p.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None)
            found.append({**p, "original_max_position_embeddings": original})
    return found


@contextmanager
def rope_factors(factors: tuple[str, torch.Tensor | None] | None):
    """Makes `factors` (`RopeRows.factors`) what the models' `TokenRope` modules read during the forward."""
    token = _FACTORS.set(factors)
    try:
        yield
    finally:
        _FACTORS.reset(token)


class TokenRope:
    """A model's LongRoPE rotary embeddings, switched per token (module docstring).

    Each module's own forward (without transformers' per-forward choice) computes the tables, given the short or the
    long inverse frequencies through a view of the module (`_Frequencies`): the module itself is never written, so a
    plain `generate` on the same model in another thread is not disturbed. A module qualifies only where that
    forward's tables follow the inverse frequencies alone, token by token (`_agrees`): PhiMoE's, which switches a
    scale by the forward's largest position itself, does not.

    Args:
        modules (`list[torch.nn.Module]`): the model's rotary embedding modules that use LongRoPE.
        original (`int`): `original_max_position_embeddings`, the longest rope length rotated with the short factors.
    """

    def __init__(self, modules: list[torch.nn.Module], original: int):
        self.modules = modules
        self.original = original
        for module in modules:
            _install(module)

    @classmethod
    def of(cls, model) -> TokenRope | None:
        """The model's `TokenRope`, installed on its LongRoPE rotary modules; None where `supported` is False."""
        return cls(_rotary_modules(model), _original(model)) if cls.supported(model) else None

    @staticmethod
    def supported(model) -> bool:
        """Whether `of(model)` switches the model's LongRoPE per token: it has LongRoPE, in transformers' rotary
        modules, whose tables follow the inverse frequencies alone."""
        modules = _rotary_modules(model) if _original(model) is not None else []
        return bool(modules) and all(_agrees(m) for m in modules)


class RopeRows:
    """A runner's rows under LongRoPE: each row's prompt length, from which its tokens' rope lengths follow, and, for
    a model whose `generate` recomputes a sequence at the switch (`recomputes_at_switch`), which rows are due for that
    recompute and how far a row may draft before it.

    A row whose prompt fits `original_max_position_embeddings` ("short") verifies nothing past position
    `original - 1` (`draft_room`): logits there come from the short factors in plain decoding. Its next forward
    then starts at position `original`, where plain decoding feeds the whole sequence again with the long factors:
    the runner does the same (`ModelRunner.recompute`), and the row is rotated long from then on. A row whose prompt
    is longer is rotated long from its first forward, as plain decoding's whole-prompt forward rotates it.

    Args:
        original (`int`): `original_max_position_embeddings` (`TokenRope.original`).
        recompute (`bool`): the model's `generate` recomputes a sequence crossing the switch.
    """

    def __init__(self, original: int, recompute: bool):
        self.original = original
        self.recompute = recompute
        self._prompt_lengths: dict[int, int] = {}

    @classmethod
    def of(cls, model) -> RopeRows | None:
        """The model's rows under LongRoPE, its `TokenRope` installed; None where it has none."""
        rope = TokenRope.of(model)
        return None if rope is None else cls(rope.original, recomputes_at_switch(model))

    def add(self, seq_id: int, prompt_length: int) -> None:
        self._prompt_lengths[seq_id] = prompt_length

    def free(self, seq_id: int) -> None:
        self._prompt_lengths.pop(seq_id, None)

    def prefix_key(self, prompt_length: int) -> int:
        """Which rotation a prompt of this length gives its tokens (all long or all short), for the prefix cache."""
        return int(prompt_length > self.original)

    def factors(self, seq_ids: list[int], starts: list[int], num_tokens: list[int],
                query_positions: torch.Tensor, device) -> tuple[str, torch.Tensor | None]:
        """What a forward feeding `num_tokens[i]` tokens of row `seq_ids[i]` from storage index `starts[i]` (at
        `query_positions`, `[rows, q]`) asks of the rotary modules (`_FACTORS`): one set for all, decided on the host
        from bounds on the tokens' rope lengths, or each token's rope length."""
        prompts = [self._prompt_lengths.get(s, 0) for s in seq_ids]
        # A token's position is below its storage index plus one (draft-tree nodes sit by depth).
        if max(max(p, start + n) for p, start, n in zip(prompts, starts, num_tokens)) <= self.original:
            return "short", None
        if min(max(p, start + 1) for p, start in zip(prompts, starts)) > self.original:
            return "long", None
        return "mixed", torch.maximum(torch.tensor(prompts, device=device)[:, None], query_positions + 1)

    def draft_room(self, seq_ids: list[int], lengths) -> list[int] | None:
        """The most drafts each row may verify after its `lengths[seq_id]` committed tokens (None: no limit)."""
        if not self.recompute:
            return None
        unlimited = 1 << 30
        return [max(0, self.original - lengths[s]) if self._prompt_lengths.get(s, 0) <= self.original else unlimited
                for s in seq_ids]

    def due(self, seq_ids: list[int], cached: list[int]) -> list[int]:
        """The short rows whose next forward starts at the switch, with `cached[i]` tokens cached."""
        if not self.recompute:
            return []
        return [s for s, c in zip(seq_ids, cached)
                if c == self.original and self._prompt_lengths.get(s, 0) <= self.original]

    def rotated_long(self, seq_id: int) -> None:
        """Row `seq_id` was fed again from its start with the long factors: every token it feeds takes them."""
        self._prompt_lengths[seq_id] = self.original + 1


def recomputes_at_switch(model) -> bool:
    """Whether the model's `generate` recomputes a sequence's earlier tokens with the long factors when it passes
    `original_max_position_embeddings` (Phi-3, PhiMoE and Phi-4-multimodal drop their cache there, in
    `prepare_inputs_for_generation`). Assumed where that method's source cannot be read."""
    return _recomputes(type(model))


@functools.lru_cache(maxsize=None)
def _recomputes(model_class) -> bool:
    import inspect

    from transformers import GenerationMixin

    prepare = getattr(model_class, "prepare_inputs_for_generation", None)
    if prepare is None or prepare is GenerationMixin.prepare_inputs_for_generation:
        return False
    try:
        return "original_max_position_embeddings" in inspect.getsource(prepare)
    except (OSError, TypeError):
        return True


def _original(model) -> int | None:
    config = getattr(model, "config", None)
    if not hasattr(config, "get_text_config"):  # not a transformers config (an EAGLE head's is a dict)
        return None
    config = config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    originals = {p["original_max_position_embeddings"] for p in longrope_parameters(config)}
    if len(originals) != 1:
        return None  # none, or per-layer sets that disagree (not seen in any published model)
    original = originals.pop()
    return int(original) if original and (limit is None or original < limit) else None


def _rotary_modules(model) -> list[torch.nn.Module]:
    """Modules with LongRoPE whose forward is transformers' rotary embedding under `dynamic_rope_update`."""
    found = []
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        if "longrope" in kinds and _undecorated(type(module)) is not None:
            found.append(module)
    return found


def _undecorated(cls):
    """`cls.forward` without transformers' per-forward choice (`dynamic_rope_update`'s wrapper), or None where the
    forward is not so wrapped."""
    forward = getattr(cls, "forward", None)
    while forward is not None:
        code = getattr(forward, "__code__", None)
        if code is not None and code.co_name == "wrapper" and code.co_filename.endswith("modeling_rope_utils.py"):
            return getattr(forward, "__wrapped__", None)
        forward = getattr(forward, "__wrapped__", None)
    return None


def _layer(module, layer_type) -> tuple[str, dict, dict]:
    """For a rotary module's `layer_type` (None: its only one): its attributes' prefix, its rope parameters, and the
    keyword arguments its forward takes."""
    if layer_type is None:
        return "", module.config.rope_parameters, {}
    return f"{layer_type}_", module.config.rope_parameters[layer_type], {"layer_type": layer_type}


class _Frequencies:
    """A rotary module as its own forward reads it, with other inverse frequencies at `name` (the module is not
    written)."""

    def __init__(self, module: torch.nn.Module, name: str, inv_freq: torch.Tensor):
        self._module = module
        self.__dict__[name] = inv_freq

    def __getattr__(self, name):
        return getattr(self._module, name)


def _tables(module, x, position_ids, layer_type, which: str):
    """The module's own rotary tables (`(cos, sin)`) at `position_ids` with the `which` ("short" or "long")
    inverse frequencies."""
    prefix, params, kwargs = _layer(module, layer_type)
    if which == "short":
        inv_freq = getattr(module, f"{prefix}original_inv_freq")
    else:
        inv_freq = getattr(module, f"{prefix}long_inv_freq", None)
        if inv_freq is None:  # what transformers computes on the first long forward
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](
                module.config, x.device, seq_len=params["original_max_position_embeddings"] + 1, **kwargs)
            module.__dict__[f"{prefix}long_inv_freq"] = inv_freq  # (transformers keeps it as a plain attribute too)
    view = _Frequencies(module, f"{prefix}inv_freq", inv_freq.to(x.device))
    with torch.no_grad():  # (rotary tables carry no gradient)
        return _undecorated(type(module))(view, x, position_ids, **kwargs)


def _per_token_forward(module, x, position_ids, layer_type=None):
    """The rotary tables with each token's factors (module docstring); the module's own forward outside a runner's
    forward, or for a rotary type other than LongRoPE."""
    factors = _FACTORS.get()
    _, params, kwargs = _layer(module, layer_type)
    rope_type = module.rope_type if layer_type is None else module.rope_type[layer_type]
    if factors is None or rope_type != "longrope":
        return type(module).forward(module, x, position_ids, **kwargs)
    mode, lengths = factors
    if mode != "mixed":
        return _tables(module, x, position_ids, layer_type, mode)
    if lengths.shape != position_ids.shape:
        raise RuntimeError(f"{type(module).__name__} was called with positions of shape {tuple(position_ids.shape)} "
                           f"in a forward feeding {tuple(lengths.shape)} tokens: hf_specdec cannot pick its LongRoPE "
                           "factors per token for this model")
    use_long = (lengths.to(position_ids.device) > params["original_max_position_embeddings"])[..., None]
    short = _tables(module, x, position_ids, layer_type, "short")
    long = _tables(module, x, position_ids, layer_type, "long")
    return tuple(torch.where(use_long, long_part, short_part) for short_part, long_part in zip(short, long))


def _install(module: torch.nn.Module) -> None:
    """Makes `_per_token_forward` the module's forward (a partial, so a pickled model loads back). Under accelerate's
    hooks (an offloaded model) it replaces the forward the hook calls, which keeps the hook's device placement."""
    name = "_old_forward" if "_old_forward" in module.__dict__ else "forward"
    current = module.__dict__.get(name)
    if not (isinstance(current, functools.partial) and current.func is _per_token_forward):
        module.__dict__[name] = functools.partial(_per_token_forward, module)


def _agrees(module: torch.nn.Module) -> bool:
    """Whether the module's own forward, given the short or the long inverse frequencies, gives the tables
    transformers' per-forward choice gives, and gives each position the same table whatever the forward's other
    positions (checked once per module, at `original_max_position_embeddings`)."""
    known = module.__dict__.get("_hf_specdec_rope_agrees")
    if known is not None:
        return known
    rope_type = module.rope_type
    layer_types = [t for t, kind in rope_type.items() if kind == "longrope"] if isinstance(rope_type, dict) else [None]
    try:
        agrees = all(_agrees_for(module, layer_type) for layer_type in layer_types)
    except Exception:  # noqa: BLE001 - a module the check cannot run (weights on meta, say) is not switched
        agrees = False
    module.__dict__["_hf_specdec_rope_agrees"] = agrees
    return agrees


def _agrees_for(module, layer_type) -> bool:
    prefix, params, kwargs = _layer(module, layer_type)
    original = params["original_max_position_embeddings"]
    buffer = getattr(module, f"{prefix}inv_freq")
    x = torch.zeros(1, dtype=torch.float32, device=buffer.device)
    below = torch.arange(original, device=buffer.device)[None]
    past = torch.arange(original + 1, device=buffer.device)[None]
    saved = buffer.clone()
    try:
        with torch.no_grad():  # transformers' choice, which writes the buffer (restored below)
            chosen_below = type(module).forward(module, x, below, **kwargs)
            chosen_past = type(module).forward(module, x, past, **kwargs)
    finally:
        buffer.copy_(saved)
    short = _tables(module, x, below, layer_type, "short")
    long = _tables(module, x, past, layer_type, "long")
    long_below = _tables(module, x, below, layer_type, "long")
    same = all(torch.equal(a, b) for a, b in zip(short, chosen_below))
    same = same and all(torch.equal(a, b) for a, b in zip(long, chosen_past))
    return same and all(torch.equal(a, b[:, :original]) for a, b in zip(long_below, long))
