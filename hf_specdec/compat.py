"""Up-front checks: which models and model pairs speculative decoding can serve, with errors that say why."""

from __future__ import annotations

# Layer kinds our paged cache handles exactly; anything else (recurrent, linear or chunked attention) is refused.
_SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Vocabulary sizes of models sharing a tokenizer differ only by embedding padding (e.g. 151936 vs 152064).
_MAX_VOCAB_PADDING = 1024


class UnsupportedModelError(ValueError):
    """The model cannot be decoded speculatively by hf_specdec."""


def check_model_supported(model, role: str = "model") -> None:
    """Raises `UnsupportedModelError` unless `model` is a decoder-only LM whose KV cache we can page and roll back."""
    config = model.config
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"the {role} {name} is an encoder-decoder model; speculative decoding supports decoder-only causal LMs"
        )
    if not (getattr(model, "_supports_attention_backend", False) and model._can_set_attn_implementation()):
        raise UnsupportedModelError(
            f"the {role} {name} does not use transformers' AttentionInterface, so its KV cache cannot be paged or "
            "rolled back per row; use a model that supports attn_implementation switching (Llama, Mistral, Qwen2/3, "
            "Phi-3, Gemma 3, ...)"
        )
    layer_types = set(getattr(config.get_text_config(), "layer_types", None) or [])
    if not layer_types <= _SUPPORTED_LAYER_TYPES or getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(
            f"the {role} {name} has layers of kinds {sorted(layer_types - _SUPPORTED_LAYER_TYPES) or ['stateful']} "
            "whose state cannot be rolled back to an earlier token; only full and sliding-window attention are "
            "supported"
        )


def check_vocab_compatible(target, draft) -> None:
    """Refuses pairs whose vocabularies clearly cannot match (without tokenizers, only sizes can be compared)."""
    target_vocab = target.config.get_text_config().vocab_size
    draft_vocab = draft.config.get_text_config().vocab_size
    if abs(target_vocab - draft_vocab) > _MAX_VOCAB_PADDING:
        raise ValueError(
            f"the draft model's vocabulary ({draft_vocab} tokens) cannot match the target's ({target_vocab}); "
            "speculative decoding needs both models to share one tokenizer. Pick a draft from the target's family"
        )
