"""The benchmark-only synthetic speculator: drafts accepted at a set rate, output still the target's."""

from __future__ import annotations

import pytest
import torch

from hf_specdec.tools.synthetic import SyntheticSpeculator, acceptance_for_length

from conftest import VOCAB, make_model, ragged_batch


@pytest.mark.parametrize("length,k", [(1.0, 4), (2.0, 4), (3.0, 4), (4.5, 8)])
def test_acceptance_for_length(length, k):
    a = acceptance_for_length(length, k)
    assert sum(a ** j for j in range(k + 1)) == pytest.approx(length, abs=1e-9)
    with pytest.raises(ValueError, match="mean acceptance length"):
        acceptance_for_length(k + 1.0, k)


@pytest.mark.parametrize("acceptance,expected_rate", [(1.0, 1.0), (0.0, 0.0)])
def test_drafts_are_the_reference_at_the_set_rate(acceptance, expected_rate):
    model = make_model("llama")
    input_ids, mask = ragged_batch(rows=3)
    reference = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    spec = SyntheticSpeculator(reference, acceptance, VOCAB)
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False, speculator=spec,
                         num_speculative_tokens=4, speculative_schedule="constant", return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert out.speculative_metrics.num_draft_tokens > 0
    assert out.speculative_metrics.acceptance_rate == expected_rate


def test_a_set_mean_acceptance_length_is_met():
    """Over many steps the mean acceptance length approaches 1 + a + ... + a^k (a loose bound: 8 rows x 96 tokens)."""
    model = make_model("llama")
    input_ids, mask = ragged_batch(rows=8, seed=2)
    reference = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=96, do_sample=False)
    spec = SyntheticSpeculator(reference, acceptance_for_length(3.0, 4), VOCAB, seed=1)
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=96, do_sample=False, speculator=spec,
                         num_speculative_tokens=4, speculative_schedule="constant", return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert 2.5 < out.speculative_metrics.mean_acceptance_length < 3.5


def test_a_reference_of_other_inputs_is_refused():
    model = make_model("llama")
    input_ids, mask = ragged_batch(rows=2)
    with pytest.raises(ValueError, match="same inputs"):
        model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                       speculator=SyntheticSpeculator(torch.zeros(3, 20, dtype=torch.long), 0.5, VOCAB))
