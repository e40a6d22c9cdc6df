"""The whole engine on its Triton kernels (HF_SPECDEC_KERNEL_BACKEND=triton; the interpreter on a CPU).

Paged attention reads the pool in place, the verifier (for batches that sample: an all-greedy batch takes the
PyTorch argmax on every backend) and the sampling warpers run as kernels; greedy output must still equal plain
`generate`, token for token. The interpreter runs each kernel program in Python, so these use
small batches and few tokens.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_model, ragged_batch

pytest.importorskip("triton")

import hf_specdec.kernels.paged_attention.triton_kernel as attention_kernel  # noqa: E402
import hf_specdec.kernels.rejection_sample.triton_kernel as rejection_kernel  # noqa: E402
import hf_specdec.kernels.sampling.triton_kernel as sampling_kernel  # noqa: E402
from hf_specdec.kernels._backend import ENV_VAR

pytestmark = pytest.mark.slow  # whole calls on the Triton interpreter

MAX_NEW = 12


@pytest.fixture
def kernel_calls(monkeypatch):
    """Forces the triton backend and counts kernel launches, so a test proves the kernels really ran."""
    monkeypatch.setenv(ENV_VAR, "triton")
    calls = {"attention": 0, "tree_attention": 0, "packed_attention": 0, "rejection": 0, "sampling": 0}

    def counted(module, name, key):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[key] += 1
            calls["tree_attention"] += kwargs.get("tree") is not None
            calls["packed_attention"] += kwargs.get("cu_query") is not None
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(attention_kernel, "paged_attention_triton", "attention")
    counted(rejection_kernel, "rejection_sample_triton", "rejection")
    counted(sampling_kernel, "apply_sampling_params_triton", "sampling")
    return calls


@pytest.mark.parametrize("arch,kind", [("llama", "ngram"), ("mistral", "draft"), ("gemma3", "ngram")])
def test_greedy_equals_generate_on_triton_kernels(arch, kind, kernel_calls):
    target = make_model(arch)
    input_ids, mask = ragged_batch(rows=3, width=12)
    with pytest.MonkeyPatch.context() as plain:  # the reference run: plain transformers, no kernels involved
        plain.delenv(ENV_VAR)
        expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    speculator = "ngram" if kind == "ngram" else make_model(arch, seed=1)
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                          speculator=speculator, speculative_schedule="constant", num_speculative_tokens=3,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculative_metrics.num_draft_tokens > 0
    assert kernel_calls["attention"] > 0 and kernel_calls["rejection"] == 0  # all greedy: the argmax path
    # The ragged prompts (and n-gram steps where rows offer different drafts) went through the kernel packed.
    assert kernel_calls["packed_attention"] > 0


def test_sampling_with_top_k_one_equals_greedy_on_triton_kernels(kernel_calls):
    """top_k=1 makes sampling a point mass: the sampled path (sampling kernel, stochastic rejection, Philox draws)
    must give exactly the greedy output."""
    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=3, width=12, seed=1)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True, top_k=1,
                          temperature=0.7, speculator=make_model("llama", seed=1), speculative_schedule="constant",
                          num_speculative_tokens=3, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculative_metrics.num_draft_tokens > 0
    assert kernel_calls["sampling"] > 0 and kernel_calls["rejection"] > 0


def test_seeded_sampling_is_reproducible_on_triton_kernels(kernel_calls):
    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=2, width=10, seed=2)

    def sample():
        torch.manual_seed(0)
        return target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=True, top_p=0.9,
                               top_k=20, speculator="ngram", speculative_schedule="constant")

    first, second = sample(), sample()
    assert torch.equal(first, second)
    torch.manual_seed(1)
    assert not torch.equal(first, target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                                  do_sample=True, top_p=0.9, top_k=20, speculator="ngram",
                                                  speculative_schedule="constant"))


@pytest.mark.parametrize("version", [1, 3])
def test_draft_trees_equal_generate_on_triton_kernels(fitted_eagle_heads, version, kernel_calls, tmp_path):
    """Tree steps (the head's tree levels and the target's tree verify) read the pool in place through the
    kernel's tree mask; the output is still the target's own greedy output."""
    from hf_specdec import EagleSpeculator, convert_eagle

    target, reference_dir = fitted_eagle_heads[version]
    head_dir = convert_eagle(reference_dir, tmp_path / "head", target=target,
                             **({"aux_layers": [1, 2, 3]} if version == 3 else {}))
    input_ids, mask = ragged_batch(rows=2, width=10, seed=version)
    with pytest.MonkeyPatch.context() as plain:
        plain.delenv(ENV_VAR)
        expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                          speculator=EagleSpeculator.from_pretrained(head_dir), num_speculative_tokens=3,
                          speculative_tree_nodes=6, speculative_tree_branching=2, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculative_metrics.num_accepted_tokens > 0
    assert kernel_calls["tree_attention"] > 0
