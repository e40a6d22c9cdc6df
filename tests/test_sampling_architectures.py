"""Seeded speculative sampling on architectures with unusual attention: the first two generated tokens follow the
target's exact joint distribution (total-variation check), with a draft model that disagrees with the target and with
n-gram drafts. Attention sinks (gpt-oss), alternating sliding-window and global layers shorter than the prompt
(Gemma 3), a mixture of experts (Mixtral), a hybrid of Gated DeltaNet and attention layers whose recurrent state rolls
back per row (Qwen3-Next), and a model outside transformers' attention interface on the masked dense cache (Falcon
with ALiBi counted from the attention mask)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    FalconConfig, FalconForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GptOssConfig, GptOssForCausalLM,
    MixtralConfig, MixtralForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM,
)

import hf_specdec  # noqa: F401
from test_generate_sampling import tv

VOCAB = 8
SAMPLES = 8_000
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
              eos_token_id=None, tie_word_embeddings=False)
ARCHITECTURES = {
    # gpt-oss alternates sliding and full layers too; its expert kernels take float32 only.
    "gpt_oss": (lambda: GptOssForCausalLM(GptOssConfig(**COMMON, sliding_window=4, num_local_experts=4,
                                                       num_experts_per_tok=2)), torch.float32),
    "gemma3": (lambda: Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, sliding_window=4, layer_types=[
        "sliding_attention", "full_attention"])), torch.float64),
    "mixtral": (lambda: MixtralForCausalLM(MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)),
                torch.float32),
    "qwen3_next": (lambda: Qwen3NextForCausalLM(Qwen3NextConfig(
        **COMMON, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, mlp_only_layers=[0, 1])),
        torch.float64),
    # Rows roll back through holes in the attention mask, which ALiBi positions must skip.
    "falcon": (lambda: FalconForCausalLM(FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=None, tie_word_embeddings=False)), torch.float64),
}


def make(arch: str, seed: int, sharpness: float):
    build, dtype = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    model = build().to(dtype).eval()
    with torch.no_grad():
        if arch == "gpt_oss":  # sinks that absorb much of the attention, which in turn moves the logits
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(4.0, 1.0)
                layer.self_attn.o_proj.weight.mul_(10.0)
        model.lm_head.weight.mul_(sharpness)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def exact_joint(model, prompt):
    """`[VOCAB * VOCAB]` probability of each (first, second) generated token pair under `model`."""
    with torch.no_grad():
        first = torch.softmax(model(prompt).logits[0, -1].double(), -1)
        extended = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
        second = torch.softmax(model(extended).logits[:, -1].double(), -1)
    return (first[:, None] * second).flatten()


@pytest.mark.parametrize("speculator_kind", ["draft", "ngram"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_sampling_matches_the_target_joint_distribution(arch, speculator_kind):
    target, draft = make(arch, 0, sharpness=3.0), make(arch, 5, sharpness=6.0)
    prompt = torch.tensor([[1, 3, 4, 5, 3, 4, 5, 3, 4]])  # longer than the window; repetitive, so n-gram proposes
    expected = exact_joint(target, prompt)
    torch.manual_seed(0)
    out = target.generate(prompt.expand(SAMPLES, -1), max_new_tokens=2, do_sample=True,
                          speculator=draft if speculator_kind == "draft" else "ngram", num_speculative_tokens=3,
                          speculative_schedule="constant", return_dict_in_generate=True)
    assert out.speculative_metrics.num_draft_tokens > 0
    pairs = out.sequences[:, -2] * VOCAB + out.sequences[:, -1]
    # Expected TV noise for 64 outcomes and 8k samples is at most about 0.035; 0.07 leaves a margin.
    assert tv(pairs, expected) < 0.07
    # Power: the draft's own distribution is far outside that bound, and so is the target's without its sinks.
    assert 0.5 * (exact_joint(draft, prompt) - expected).abs().sum() > 0.2
    if arch == "gpt_oss":
        with torch.no_grad():
            for layer in target.model.layers:
                layer.self_attn.sinks.fill_(float("-inf"))
        assert 0.5 * (exact_joint(target, prompt) - expected).abs().sum() > 0.15
