"""Up-front checks: which models and model pairs speculative decoding can serve, with errors that say why."""

from __future__ import annotations

import logging

from ..cache.recurrent import is_recurrent
from ..cache.rope import TokenRope, longrope_parameters, recomputes_at_switch
from ..errors import UnsupportedModelError
from .dense import check_dense_supported, uses_paged_cache
from .model_runner import ModelRunner, input_device, paged_attention

logger = logging.getLogger("hf_specdec")

# Layer kinds our paged cache handles exactly; anything else (chunked attention, say) is refused.
_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Layer kinds of models whose recurrent layers keep their state through the cache (`cache/recurrent.py`), and the
# stateless blocks hybrids interleave with them.
_RECURRENT_LAYER_TYPES = {"linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding", "mlp", "moe"}
# Vocabulary sizes of models sharing a tokenizer differ only by embedding padding (e.g. 151936 vs 152064).
_MAX_VOCAB_PADDING = 1024
# Models whose attention layers compute a mask of their own from the cached states; our attention masks by the step
# plan and would ignore it (it refuses such a mask at run time; these are known before the first forward).
_OWN_ATTENTION_MASKS = {
    "doge": "computes a dynamic attention mask from its cached value states",
}


def check_model_supported(model, role: str = "model") -> None:
    """Raises `UnsupportedModelError` unless `model` is a decoder-only LM whose KV cache (and recurrent state) we can
    roll back per row: paged, for models on transformers' attention interface, else masked (`dense.py`)."""

    config = model.config
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"the {role} {name} is an encoder-decoder model; speculative decoding supports decoder-only causal LMs"
        )
    own_mask = _OWN_ATTENTION_MASKS.get(getattr(config.get_text_config(), "model_type", None))
    if own_mask:
        raise UnsupportedModelError(
            f"the {role} {name} {own_mask}, which hf_specdec's paged attention cannot apply"
        )
    layer_types = set(getattr(config.get_text_config(), "layer_types", None) or [])
    recurrent = is_recurrent(model)
    supported = _SUPPORTED_LAYER_TYPES | (_RECURRENT_LAYER_TYPES if recurrent else set())
    if not layer_types <= supported or (getattr(model, "_is_stateful", False) and not recurrent):
        raise UnsupportedModelError(
            f"the {role} {name} has layers of kinds {sorted(layer_types - supported) or ['stateful']} "
            "whose state cannot be rolled back to an earlier token; only full and sliding-window attention and "
            "recurrent layers that keep their state through transformers' cache methods are supported"
        )

    if not uses_paged_cache(model):  # it attends by its own code: served through its cache and attention mask
        check_dense_supported(model, role, name)
        return
    _trial_forward(model, role, name)


def _trial_forward(model, role: str, name: str) -> None:
    """A trial before anything is generated: two rows of different lengths through the paged cache, two steps.

    Every layer must write the cache and attend through our function (some models dispatch only part of their
    attention through the interface, or keep their own state), and the shorter row's logits must equal what it gives
    alone (a model that takes positions from the cache length instead of `position_ids`, as the decoders of BART and
    its kin do, fails that). This is what lets models that do not declare support for transformers' attention
    backends (StableLM, BioGPT, ...) run. Passing is remembered on the model, so it costs four forwards of at most 3
    tokens once per model."""
    if getattr(model, "_hf_specdec_trial_passed", False):
        return
    import torch


    vocab = model.config.get_text_config().vocab_size
    device = input_device(model)  # never model.device: `meta` for a model offloaded to disk
    tokens = [t % vocab for t in range(1, 7)]
    try:
        with torch.no_grad(), paged_attention(model):
            together = ModelRunner(model, num_blocks=4)
            alone = ModelRunner(model, num_blocks=4)
            for seq_id in (0, 1):
                together.add_sequence(seq_id)
            alone.add_sequence(1)
            first = torch.tensor([tokens[0:3], [tokens[3]] * 3], device=device)  # right-aligned rows
            together.forward([0, 1], first, [3, 1], num_logits=1)
            batched = together.forward([0, 1], torch.tensor([[tokens[4]], [tokens[5]]], device=device),
                                       [1, 1], num_logits=1).logits[1, -1]
            alone.forward([1], torch.tensor([[tokens[3]]], device=device), [1], num_logits=1)
            single = alone.forward([1], torch.tensor([[tokens[5]]], device=device), [1],
                                   num_logits=1).logits[0, -1]
            for runner, seq_ids in ((together, (0, 1)), (alone, (1,))):
                for seq_id in seq_ids:
                    runner.free(seq_id)
    except UnsupportedModelError as error:
        raise UnsupportedModelError(f"the {role} {error}") from None
    except Exception as error:  # noqa: BLE001 - whatever failed, the model cannot run on the paged cache
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        raise UnsupportedModelError(
            f"the {role} {name} failed a trial forward through hf_specdec's paged attention ({reason})"
        ) from None
    if together.cache.plan.num_updates == 0 and not getattr(together.cache, "num_state_writes", 0):
        raise UnsupportedModelError(
            f"the {role} {name} keeps no keys and values in the cache it is given, so hf_specdec cannot roll it back"
        )
    # Rounding differs between a batch and a single row; a wrong position changes logits by their own magnitude.
    tolerance = (1e-3 if single.dtype in (torch.float32, torch.float64) else 1e-1) * float(single.abs().max()) + 1e-5
    if float((batched - single).abs().max()) > tolerance:
        raise UnsupportedModelError(
            f"the {role} {name} gives a row of a ragged batch other logits than the same row alone (it likely takes "
            "positions from the cache length rather than from position_ids), so hf_specdec cannot batch it"
        )
    with torch.no_grad(), paged_attention(model):
        model._hf_specdec_packable = _packs_exactly(model, device, tokens, tolerance)
        model._hf_specdec_context_groups = _groups_exactly(model, device, tokens, tolerance)
    model._hf_specdec_trial_passed = True


def _packs_exactly(model, device, tokens: list[int], tolerance: float) -> bool:
    """Whether ragged steps may go through `model` packed (`layout.PackedLayout`): two steps of two rows
    with different widths, padded and packed, must give the same logits. A model that mixes tokens across the batch
    outside attention, or cannot take a tensor `logits_to_keep`, keeps the padded layout (nothing is refused)."""
    import torch


    logits = []
    try:
        for packed in (False, True):
            runner = ModelRunner(model, num_blocks=4, packed=packed)
            for seq_id in (0, 1):
                runner.add_sequence(seq_id)
            first = runner.forward([0, 1], torch.tensor([tokens[0:3], [tokens[3]] * 3], device=device), [3, 1],
                                   num_logits=2).logits
            second = runner.forward([0, 1], torch.tensor([tokens[4:6], [tokens[5]] * 2], device=device), [2, 1],
                                    num_logits=2).logits
            for seq_id in (0, 1):
                runner.free(seq_id)
            if packed and runner.num_packed_forwards != 2:
                return False
            # Row 1's first column is padding in both steps: its logits are not compared.
            logits.append(torch.cat([first[0], first[1, -1:], second[0], second[1, -1:]]).float())
    except Exception:  # noqa: BLE001 - whatever failed packed, the padded layout serves the model
        logger.debug("%s keeps the padded layout: the packed trial failed", type(model).__name__, exc_info=True)
        return False
    return logits[0].shape == logits[1].shape and float((logits[0] - logits[1]).abs().max()) <= tolerance


def _groups_exactly(model, device, tokens: list[int], tolerance: float) -> bool:
    """Whether the PyTorch attention path may gather rows' contexts in groups (`layout.context_groups`): then
    the cache's `update` hands attention the KV pools rather than each row's gathered context, which a model that
    reshapes keys or values in between (multi-head latent attention expands its cached latents there) cannot take.
    Two rows of different lengths, in one group and in two, must give the same logits; a model that fails keeps one
    group (nothing is refused)."""
    import torch


    logits = []
    try:
        for split in (False, True):
            runner = ModelRunner(model, num_blocks=4, packed=False)
            runner.cache.context_split = split
            for seq_id in (0, 1):
                runner.add_sequence(seq_id)
            runner.forward([0, 1], torch.tensor([tokens[0:3], [tokens[3]] * 3], device=device), [3, 1], num_logits=1)
            out = runner.forward([0, 1], torch.tensor([[tokens[4]], [tokens[5]]], device=device), [1, 1],
                                 num_logits=1)
            grouped = runner.cache.plan.context_groups is not None  # (never on the Triton path: untested there)
            for seq_id in (0, 1):
                runner.free(seq_id)
            if split and not grouped:
                return False
            logits.append(out.logits[:, -1].float())
    except Exception:  # noqa: BLE001 - whatever failed in groups, one group serves the model
        logger.debug("%s keeps one context group: the grouped trial failed", type(model).__name__, exc_info=True)
        return False
    return float((logits[0] - logits[1]).abs().max()) <= tolerance


def exact_context(model) -> tuple[int | None, str | None]:
    """The longest sequence (prompt + new tokens) whose speculative decoding equals plain decoding: the model's
    context (`max_position_embeddings`), or less, with the reason.

    LongRoPE (Phi-3's 128k models, Phi-3.5-mini, Phi-4-mini) rotates with its long factors once a sequence passes
    `original_max_position_embeddings`, and transformers picks the factors for a whole forward. hf_specdec picks them
    per token as plain decoding does, and recomputes a sequence crossing that length where the model's `generate` does
    (`cache/rope.py`), for models whose rotary modules are transformers' kind on the paged cache (without recurrent
    layers, where a recompute is needed). Elsewhere it serves them up to that length, below which every forward takes
    the short factors."""

    config = model.config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    for p in longrope_parameters(config):
        original = p["original_max_position_embeddings"]
        if not original or (limit is not None and original >= limit):
            continue
        if not (uses_paged_cache(model) and TokenRope.supported(model)
                and not (recomputes_at_switch(model) and is_recurrent(model))):
            return int(original), (
                f"its LongRoPE factors switch past original_max_position_embeddings ({original}) by the largest "
                "position in each forward, which a verify step or a batch of rows shares and one-token decoding "
                "does not, and hf_specdec cannot pick them per token for this model (its rotary module is not "
                "transformers' kind whose tables follow the inverse frequencies alone, as PhiMoE's picks a scale by "
                "the forward's largest position itself; or it runs outside the paged KV cache; or its recurrent "
                "layers cannot recompute a sequence): speculative decoding reproduces plain decoding up to that "
                "length")
    return limit, None


def check_vocab_compatible(target, draft) -> None:
    """Refuses pairs whose vocabularies clearly cannot match (without tokenizers, only sizes can be compared)."""
    target_vocab = target.config.get_text_config().vocab_size
    draft_vocab = draft.config.get_text_config().vocab_size
    if abs(target_vocab - draft_vocab) > _MAX_VOCAB_PADDING:
        raise ValueError(
            f"the draft model's vocabulary ({draft_vocab} tokens) cannot match the target's ({target_vocab}); "
            "speculative decoding needs both models to share one tokenizer. Pick a draft from the target's family"
        )
