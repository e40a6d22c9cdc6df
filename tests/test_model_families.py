"""What the architecture sweep's small batch does not reach (tests/model_sweep.py): latent attention (DeepSeek's value
heads narrower than its queries) in a step where rows feed very different numbers of tokens, and LongRoPE (Phi-3's
128k models), whose factors follow each forward's largest position."""

from __future__ import annotations

import pytest
import torch

import hf_specdec  # noqa: F401  (registers speculator=)
from model_sweep import VOCAB, build, tiny_config


def ragged(lengths, seed: int = 0):
    """Left-padded rows of repeated phrases (n-gram drafts find matches), of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = [(torch.randint(3, VOCAB, (5,), generator=g).repeat(n // 5 + 1)[:n]) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask


@pytest.mark.parametrize("model_type", ["deepseek_v3", "minicpm3"])
def test_latent_attention_rows_of_very_different_lengths(model_type):
    """Rows of 6, 13, 30 and 3 tokens: the first step packs them in query groups of their own widths, whose output
    has the values' head size (narrower than the queries' here); greedy output equals plain generate."""
    model = build(model_type)
    config = model.config
    assert getattr(config, "v_head_dim", None) != getattr(config, "qk_head_dim", None)  # latent attention's shapes
    ids, mask = ragged([6, 13, 30, 3])
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    spec = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, speculator="ngram",
                          num_speculative_tokens=4, speculative_schedule="constant")
    assert torch.equal(spec, plain)


def test_latent_attention_attends_on_the_pytorch_path():
    """The Triton kernel takes one head size for keys and values: a latent-attention model's cache asks for the
    PyTorch path (on CUDA too); others keep the automatic choice."""
    from hf_specdec.recurrent_state import make_cache

    assert make_cache(build("deepseek_v3")).kernel_backend == "torch"
    assert make_cache(build("llama")).kernel_backend == "auto"


def longrope_model(original: int = 16):
    from transformers import Phi3Config, Phi3ForCausalLM

    config = tiny_config(Phi3Config)
    half = config.hidden_size // config.num_attention_heads // 2
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
                              "long_factor": [40.0] * half, "original_max_position_embeddings": original}
    config.original_max_position_embeddings = original
    config.initializer_range = 0.2  # peaky attention: a token rotated with the other factors changes the argmax
    torch.manual_seed(0)
    model = Phi3ForCausalLM(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def test_longrope_is_served_up_to_its_original_context_and_refused_past_it():
    """Within `original_max_position_embeddings` every forward takes the short factors, as one-token decoding does:
    equal to plain generate. Past it a verify step spanning the switch (or rows beside a longer one) would rotate
    tokens with the long factors where plain decoding used the short ones: refused, naming why; the server's
    context is capped there."""
    from hf_specdec.compat import exact_context
    from hf_specdec.serving.engine import RequestError, ServingEngine

    model = longrope_model(16)
    assert model.config.max_position_embeddings > 16
    limit, why = exact_context(model)
    assert limit == 16 and "original_max_position_embeddings" in why
    for seed in range(3):
        ids, mask = ragged([6], seed=seed)
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        spec = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, speculator="ngram",
                              num_speculative_tokens=4, speculative_schedule="constant")
        assert torch.equal(spec, plain)
    ids, mask = ragged([10])
    with pytest.raises(ValueError, match="exceeds 16 tokens.*LongRoPE.*original_max_position_embeddings"):
        model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, speculator="ngram")
    engine = ServingEngine(model, None, "ngram", num_speculative_tokens=4, warmup=False)
    assert engine.max_model_len == 16
    with pytest.raises(RequestError, match="context is 16 tokens"):
        engine.submit(ids[0].tolist(), max_tokens=10)
    assert exact_context(build("phi3")) == (build("phi3").config.max_position_embeddings, None)  # no LongRoPE
