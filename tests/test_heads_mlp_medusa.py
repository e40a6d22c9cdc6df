"""MLP speculators (ibm-fms accelerators) and Medusa heads: reference checkpoints converted and run, losslessly,
batched; the draft logits equal the reference formulas; fitted heads reach real acceptance and lose it when they
read the wrong state; bad checkpoints get clear errors.

Checkpoints are synthetic but in the exact reference layouts (real names and shapes, random values) for a tiny
Llama target: fms-extras / vLLM `mlp_speculator` (untied, tied, `scale_input`, a narrower `inner_dim`), Medusa-1
(`medusa_lm_head.pt`), Medusa-2 (`medusa_head.*` beside the base model) and vLLM's Medusa (`blocks.*`, `lm_heads.*`,
`token_map`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import COMMON, VOCAB, ragged_batch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_specdec import HeadCheckpointError, MedusaSpeculator, MlpSpeculator, convert_head
from hf_specdec.speculators.medusa import MedusaHeads
from hf_specdec.speculators.mlp import MlpSpeculatorHead

HIDDEN = COMMON["hidden_size"]


def make_target(num_layers: int = 2, seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": num_layers})).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# --- reference layouts -----------------------------------------------------------------------------------------------
def mlp_reference(n_predict: int = 3, inner_dim: int = 0, tie: bool = False, scale_input: bool = False,
                  seed: int = 0, prefix: str = "speculator.", store_tied_copies: bool = False):
    """fms-extras `MLPSpeculatorPreTrainedModel` layout: config.json and `speculator.{emb,proj,head,ln}.{i}.*`."""
    g = torch.Generator().manual_seed(seed)
    inner = inner_dim or HIDDEN

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    tensors = {}
    for i in range(n_predict):
        tensors[f"emb.{i}.weight"] = rand(VOCAB, inner, scale=1 / math.sqrt(inner))
        tensors[f"proj.{i}.weight"] = rand(inner, HIDDEN if i == 0 else inner, scale=1 / math.sqrt(inner))
        tensors[f"head.{i}.weight"] = rand(VOCAB, inner, scale=1 / math.sqrt(inner))
        tensors[f"ln.{i}.weight"] = 1 + rand(inner, scale=0.1)
        tensors[f"ln.{i}.bias"] = rand(inner, scale=0.1)
    if tie:  # as fms ties them: one emb, head and ln for all stages, proj 1 for every stage after the first
        for i in range(n_predict):
            for group in ("emb", "head"):
                tensors[f"{group}.{i}.weight"] = tensors[f"{group}.0.weight"]
            tensors[f"ln.{i}.weight"], tensors[f"ln.{i}.bias"] = tensors["ln.0.weight"], tensors["ln.0.bias"]
            if i >= 2:
                tensors[f"proj.{i}.weight"] = tensors["proj.1.weight"]
        if not store_tied_copies:  # what safetensors keeps of shared tensors
            tensors = {n: t for n, t in tensors.items()
                       if n.split(".")[1] == "0" or n == "proj.1.weight"}
    config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
              "vocab_size": VOCAB, "emb_dim": HIDDEN, "inner_dim": inner_dim, "n_predict": n_predict,
              "top_k_tokens_per_head": [1] * n_predict, "n_candidates": 1, "tie_weights": tie,
              "scale_input": scale_input}
    return config, {prefix + n: t.clone() for n, t in tensors.items()}


def medusa_reference(num_heads: int = 3, num_layers: int = 1, style: str = "medusa1", seed: int = 0,
                     truncated: torch.Tensor | None = None):
    """Medusa heads in a reference layout.

    style: "medusa1" (`{i}.{j}.linear.*`, `{i}.{L}.weight`, as `medusa_lm_head.pt`), "medusa2" (the same under
    `medusa_head.`, beside base-model tensors) or "vllm" (`blocks.{i}.layers.{j}.*`, `lm_heads.{i}.weight`,
    `token_map` when `truncated` gives the draft vocabulary's target ids).
    """
    g = torch.Generator().manual_seed(seed)
    draft_vocab = VOCAB if truncated is None else truncated.shape[0]
    tensors = {}
    for i in range(num_heads):
        for j in range(num_layers):
            weight = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.3
            bias = torch.randn(HIDDEN, generator=g) * 0.1
            if style == "vllm":
                tensors[f"blocks.{i}.layers.{j}.weight"], tensors[f"blocks.{i}.layers.{j}.bias"] = weight, bias
            else:
                tensors[f"{i}.{j}.linear.weight"], tensors[f"{i}.{j}.linear.bias"] = weight, bias
        lm = torch.randn(draft_vocab, HIDDEN, generator=g) * 0.5
        tensors[f"lm_heads.{i}.weight" if style == "vllm" else f"{i}.{num_layers}.weight"] = lm
    if style == "vllm":
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": HIDDEN,
                  "vocab_size": VOCAB, "num_heads": num_heads, "num_hidden_layers": num_layers,
                  "medusa_fc_bias": True, "truncated_vocab_size": None if truncated is None else draft_vocab}
        if truncated is not None:
            tensors["token_map"] = truncated.clone()
        return config, tensors
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
              "base_model_name_or_path": "tiny-llama"}
    if style == "medusa2":
        tensors = {f"medusa_head.{n}": t for n, t in tensors.items()}
        tensors["model.norm.weight"], tensors["lm_head.weight"] = torch.ones(HIDDEN), torch.zeros(VOCAB, HIDDEN)
    return config, tensors


def write_reference(directory: Path, config: dict, tensors: dict, fmt: str = "safetensors") -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(directory / "model.safetensors"))
    elif fmt == "pt":
        torch.save(tensors, directory / "medusa_lm_head.pt")
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    return directory


def convert_reference(tmp_path: Path, target, config, tensors, fmt: str = "safetensors", name: str = "src") -> Path:
    src = write_reference(tmp_path / name, config, tensors, fmt)
    return convert_head(src, tmp_path / f"{name}-ours", target=target)


def speculate(target, spec, input_ids, attention_mask=None, k: int = 3, max_new_tokens: int = 20, **kwargs):
    return target.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                           speculator=spec, num_speculative_tokens=k, speculative_schedule="constant",
                           return_dict_in_generate=True, **kwargs)


def load(directory: Path):
    config = json.loads((directory / "head_config.json").read_text())
    return (MlpSpeculator if config["kind"] == "mlp_speculator" else MedusaSpeculator).from_pretrained(directory)


VARIANTS = {
    "mlp": lambda: mlp_reference(),
    "mlp-tied-scaled-narrow": lambda: mlp_reference(n_predict=4, inner_dim=24, tie=True, scale_input=True),
    "medusa1": lambda: medusa_reference(style="medusa1"),
    "medusa2-two-layers": lambda: medusa_reference(num_layers=2, style="medusa2"),
    "vllm-medusa-truncated": lambda: medusa_reference(style="vllm", truncated=torch.arange(4, VOCAB, 2)),
}


# --- conversion: every tensor round-trips ----------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_tensor_round_trips(tmp_path, variant):
    from safetensors.torch import load_file

    target = make_target()
    config, tensors = VARIANTS[variant]()
    fmt = "pt" if variant == "medusa1" else "bin" if variant.startswith("medusa2") else "safetensors"
    dst = convert_reference(tmp_path, target, config, tensors, fmt)
    ours = load_file(str(dst / "model.safetensors"))
    ours_config = json.loads((dst / "head_config.json").read_text())
    assert ours_config["target_hidden_states"]["layers"] == [2]  # the final (normed) state of the 2-layer target
    expected = {}
    for name, tensor in tensors.items():
        if variant.startswith("mlp"):
            expected[name.removeprefix("speculator.")] = tensor
        elif name.startswith(("model.", "lm_head.")):
            continue  # a Medusa-2 checkpoint's base model
        else:
            parts = name.removeprefix("medusa_head.").split(".")
            if name == "token_map":
                expected["draft_to_target"] = tensor
            elif parts[0] == "blocks":
                expected[f"blocks.{parts[1]}.{parts[3]}.{parts[4]}"] = tensor
            elif parts[0] == "lm_heads":
                expected[name] = tensor
            elif parts[2] == "linear":
                expected[f"blocks.{parts[0]}.{parts[1]}.{parts[3]}"] = tensor
            else:
                expected[f"lm_heads.{parts[0]}.weight"] = tensor
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


# --- lossless, batched, ragged ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [1, 3])
def test_output_equals_target_greedy(tmp_path, variant, rows):
    target = make_target()
    spec = load(convert_reference(tmp_path, target, *VARIANTS[variant]()))
    input_ids, mask = ragged_batch(rows)
    out = speculate(target, spec, input_ids, mask, k=3)
    expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(out.sequences, expected)
    assert out.speculative_metrics.num_draft_tokens > 0


def test_k_beyond_the_heads_is_capped(tmp_path):
    target = make_target()
    spec = load(convert_reference(tmp_path, target, *mlp_reference(n_predict=2)))
    input_ids, mask = ragged_batch(2)
    out = speculate(target, spec, input_ids, mask, k=6, max_new_tokens=12)
    metrics = out.speculative_metrics
    assert torch.equal(out.sequences, target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=12,
                                                      do_sample=False))
    assert 0 < metrics.num_draft_tokens <= 2 * 2 * metrics.num_steps
