"""Random-init models in published shapes (`hf-specdec bench --shape`): sizes as published, speculation exact."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.tools.shapes import DRAFTS, SHAPES, build_shape
from hf_specdec.tools.synthetic import SyntheticSpeculator, acceptance_for_length

# Parameter counts of the published checkpoints.
PUBLISHED = {"llama-3.2-1b": 1.236e9, "llama-3.1-8b": 8.030e9, "qwen2.5-0.5b": 0.494e9, "qwen2.5-7b": 7.616e9}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shapes_have_the_published_sizes(name):
    model = build_shape(name, device="meta")
    assert model.num_parameters() == pytest.approx(PUBLISHED[name], rel=1e-3)
    assert model.dtype == torch.bfloat16


def test_drafts_share_their_target_vocabulary_family():
    for target, draft in DRAFTS.items():
        t, d = SHAPES[target][1], SHAPES[draft][1]
        assert abs(t["vocab_size"] - d["vocab_size"]) <= 1024 and t["eos_token_id"] == d["eos_token_id"]


def test_a_shrunk_shape_decodes_exactly_with_synthetic_drafts():
    small = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512)
    model = build_shape("llama-3.1-8b", dtype=torch.float32, **small)
    input_ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = model.generate(input_ids=input_ids, max_new_tokens=16, do_sample=False)
    spec = SyntheticSpeculator(reference, acceptance_for_length(3.0, 4), 512)
    out = model.generate(input_ids=input_ids, max_new_tokens=16, do_sample=False, speculator=spec,
                         num_speculative_tokens=4, speculative_schedule="constant")
    assert torch.equal(out, reference)
    with pytest.raises(ValueError, match="unknown shape"):
        build_shape("llama-9", device="meta")


def test_the_shape_bench_reports_every_configuration_and_exact_output():
    from hf_specdec.tools.shape_bench import run_shape_bench, shape_table

    small = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512)
    results = run_shape_bench("llama-3.1-8b", "cpu", torch.float32, batch_sizes=(2,), lengths=(3.0,), k=4,
                              prompt_tokens=8, max_new_tokens=12, repeats=1, static=True, **small)
    configs = [r.config for r in results]
    assert configs == ["plain generate", "plain generate, static cache", "hf_specdec off",
                       "hf_specdec L=3 k=4, free drafts", "hf_specdec L=3 k=4, llama-3.2-1b draft"]
    assert all(r.identical for r in results if r.identical is not None)
    for r in results[3:]:
        assert r.mean_acceptance_length > 1.5 and r.ideal_speedup > 0 and r.fraction_of_ideal > 0
    assert "of ideal" in shape_table(results)
