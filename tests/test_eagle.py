"""Synthetic EAGLE checkpoints in the exact reference layouts (real names and shapes, random values), for a tiny
Llama target, and a quick fit of an EAGLE-1 head to such a target."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import COMMON
from transformers import LlamaConfig, LlamaForCausalLM


def make_target(num_layers: int = 2, seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": num_layers})).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _layer_tensors(prefix: str, config, attn_in: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    return {
        f"{prefix}self_attn.q_proj.weight": rand(q_out, attn_in),
        f"{prefix}self_attn.k_proj.weight": rand(kv_out, attn_in),
        f"{prefix}self_attn.v_proj.weight": rand(kv_out, attn_in),
        f"{prefix}self_attn.o_proj.weight": rand(hidden, q_out),
        f"{prefix}mlp.gate_proj.weight": rand(inter, hidden),
        f"{prefix}mlp.up_proj.weight": rand(inter, hidden),
        f"{prefix}mlp.down_proj.weight": rand(hidden, inter),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(hidden),
    }


def head_config(target_config, **extra) -> dict:
    """A reference head's config.json: the target's Llama config with one layer."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "hidden_act")
    config = {k: getattr(target_config, k) for k in keys}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
            "rope_theta": 10000.0, "tie_word_embeddings": False, **config, **extra}


def eagle1_reference(target, bias: bool | None = True, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """EAGLE-1/2 layout (yuhuili/EAGLE-*): embed_tokens, fc [H, 2H] (+ bias), layers.0.* without input norm.

    `bias=None` leaves the config's "bias" key out (the reference then defaults to a bias)."""
    config = target.config
    g = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    tensors = {"embed_tokens.weight": target.get_input_embeddings().weight.detach().float().clone(),
               "fc.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.2,
               **_layer_tensors("layers.0.", config, hidden, g)}
    if bias is not False:
        tensors["fc.bias"] = torch.randn(hidden, generator=g) * 0.1
    extra = {} if bias is None else {"bias": bias}
    return head_config(config, **extra), tensors


def eagle3_reference(target, draft_vocab: int = 40, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """EAGLE-3 layout (yuhuili/EAGLE3-*): fc [H, 3H], midlayer.* with 2H-wide q/k/v, norms, reduced lm_head, d2t/t2d."""
    config = target.config
    g = torch.Generator().manual_seed(seed)
    hidden, vocab = config.hidden_size, config.vocab_size
    used = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values  # the draft vocabulary, ascending
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    tensors = {
        "fc.weight": torch.randn(hidden, 3 * hidden, generator=g) * 0.2,
        **_layer_tensors("midlayer.", config, 2 * hidden, g),
        "midlayer.hidden_norm.weight": 1 + torch.randn(hidden, generator=g) * 0.1,
        "midlayer.input_layernorm.weight": 1 + torch.randn(hidden, generator=g) * 0.1,
        "norm.weight": 1 + torch.randn(hidden, generator=g) * 0.1,
        "lm_head.weight": torch.randn(draft_vocab, hidden, generator=g) * 0.5,
        "d2t": used - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    cfg = head_config(config, draft_vocab_size=draft_vocab)
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    return cfg, tensors


def write_reference(directory: Path, config: dict, tensors: dict[str, torch.Tensor], fmt: str = "safetensors") -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(directory / "model.safetensors"))
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    return directory
