"""Benchmarks only: random-init models in the shapes of published checkpoints, built directly on the device.

The engine's speed at real sizes does not depend on the weights' values, only on their shapes, so `hf-specdec bench
--shape NAME` measures it without downloads: each shape is the published configuration's sizes (layers, widths,
heads, vocabulary, RoPE), the values random. `DRAFTS` pairs a target shape with a smaller one of the same vocabulary.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)

# The published configurations' sizes (config.json of each checkpoint).
SHAPES = {
    "llama-3.2-1b": (LlamaConfig, dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters=dict(rope_theta=500000.0, factor=32.0, **_LLAMA3_ROPE), bos_token_id=128000,
        eos_token_id=128001)),
    "llama-3.1-8b": (LlamaConfig, dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, rope_parameters=dict(rope_theta=500000.0, factor=8.0, **_LLAMA3_ROPE),
        bos_token_id=128000, eos_token_id=128001)),
    "qwen2.5-0.5b": (Qwen2Config, dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), bos_token_id=151643, eos_token_id=151643)),
    "qwen2.5-7b": (Qwen2Config, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), bos_token_id=151643, eos_token_id=151643)),
}
# A target shape's draft: a 1B-class model of the same vocabulary (Qwen2.5's 0.5B pads its embeddings to 151936, as
# the published pair does).
DRAFTS = {"llama-3.1-8b": "llama-3.2-1b", "qwen2.5-7b": "qwen2.5-0.5b"}

def shape_config(name: str, **overrides):
    """The configuration of shape `name` (`SHAPES`), with `overrides` (e.g. fewer layers for a smoke test)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    config_class, sizes = SHAPES[name]
    sizes = {**sizes, **overrides}
    if sizes["eos_token_id"] >= sizes["vocab_size"]:  # a vocabulary shrunk for a test: special tokens inside it
        sizes.update(bos_token_id=sizes["vocab_size"] - 2, eos_token_id=sizes["vocab_size"] - 1)
    return config_class(**sizes)

def build_shape(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                **overrides):
    """A random-init causal LM of shape `name`, its parameters created on `device` in `dtype` (never first in
    float32 on the host: an 8B model in bfloat16 takes 16 GB where it runs). `device="meta"` builds it without
    memory (for its parameter count)."""
    config = shape_config(name, **overrides)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.pad_token_id = config.eos_token_id
    return model.eval()
