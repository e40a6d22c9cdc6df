"""Compiled variants of the Triton kernels: what makes one (`kernels/variants.py`), and the serving engine's warm-up
launching every variant that later requests need, so no client waits on a compile on a GPU.

The variants are the keys of Triton's kernel cache for a CUDA target, computed by Triton's own argument binder; the
kernels run under the interpreter here, as in the rest of the suite.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("triton")
if not hasattr(__import__("triton.runtime.jit").runtime.jit, "create_function_from_signature"):
    pytest.skip("this triton has no argument binder to record variants with", allow_module_level=True)

from hf_specdec.kernels._backend import ENV_VAR
from hf_specdec.kernels.paged_attention.triton_kernel import paged_attention_triton
from hf_specdec.kernels.rejection_sample.triton_kernel import rejection_sample_triton
from hf_specdec.kernels.sampling.triton_kernel import apply_sampling_params_triton
from hf_specdec.kernels.variants import record_variants
from hf_specdec.decode.requests import SamplingParams
from hf_specdec.serving.engine import ServingEngine
from hf_specdec.serving.warmup import warmup_prompt
from test_serving import no_blocks_held, repeating, served_model, word_tokenizer  # noqa: E402


def test_the_record_tells_variants_apart_and_ignores_the_grid():
    logits = torch.randn(3, 40)
    temperature = torch.full((3,), 0.7)
    with record_variants() as record:
        apply_sampling_params_triton(logits, temperature)
        apply_sampling_params_triton(logits[:2], temperature[:2])  # fewer rows: the grid, not the variant
        apply_sampling_params_triton(logits, temperature, top_k=torch.full((3,), 5))
    assert record.launches == 3
    assert len(record.seen) == 2 and record.kernels() == {"sampling_params"}


def test_recordings_nest_and_leave_the_kernels_as_they_were():
    from hf_specdec.kernels.variants import _our_kernels

    logits, temperature = torch.randn(2, 40), torch.full((2,), 0.7)
    kernel = _our_kernels()["sampling_params"]
    with record_variants() as outer:
        apply_sampling_params_triton(logits, temperature)
        with record_variants() as inner:
            apply_sampling_params_triton(logits, temperature, top_p=torch.full((2,), 0.9))
        apply_sampling_params_triton(logits, temperature, top_k=torch.full((2,), 3))
    assert (outer.launches, inner.launches, len(outer.seen), len(inner.seen)) == (3, 1, 3, 1)
    assert "run" not in vars(kernel)  # the class's own `run` again
    apply_sampling_params_triton(logits, temperature)
    assert outer.launches == 3


def test_the_warm_up_prompt_is_long_enough_whatever_the_tokenizer():
    """A tokenizer that reads the warm-up phrase as one token (an unknown word) gets the synthetic prompt."""
    from test_structured import constrained_model, piece_tokenizer

    engine = ServingEngine(constrained_model(), piece_tokenizer(), "ngram", num_speculative_tokens=4)
    assert len(warmup_prompt(engine)) >= engine.k + 8


def _attention(rows: int, queries: int, blocks: int, block_size: int = 4, heads: int = 2, head_dim: int = 16):
    """A paged attention launch whose block tables are `blocks` wide and whose rows feed `queries` tokens."""
    slots = rows * blocks * block_size
    tables = torch.arange(rows * blocks).view(rows, blocks)
    positions = (blocks * block_size - queries + torch.arange(queries)).expand(rows, -1).contiguous()
    paged_attention_triton(torch.randn(rows, heads, queries, head_dim), torch.randn(slots, heads, head_dim),
                           torch.randn(slots, heads, head_dim), tables, positions, block_size)


def test_batch_shapes_do_not_make_new_variants():
    """Query counts of 1, 16 and 3, block tables 1, 2 and 16 blocks wide, 1 to 5 drafts: Triton would specialize on
    each of these integers (equal to 1, a multiple of 16) unless the kernels say not to."""
    with record_variants() as record:
        for rows, queries, blocks in ((1, 1, 1), (2, 3, 2), (2, 16, 16), (1, 5, 3)):
            _attention(rows, queries, blocks)
        for k in (1, 2, 5):
            probs = torch.softmax(torch.randn(2, k + 1, 40), -1)
            rejection_sample_triton(torch.randint(0, 40, (2, k)), torch.full((2,), k), probs, None,
                                    torch.zeros(2, dtype=torch.bool), torch.rand(2, k, dtype=torch.float64),
                                    seeds=torch.tensor([1, 2]))
    assert sorted(name for name, _ in record.seen) == ["paged_attention", "rejection_sample"]


def _speculator(name: str, model, tmp_path):
    if name == "draft":
        return served_model(seed=3)
    if name == "eagle":
        from test_eagle import convert

        from hf_specdec.speculators.eagle import EagleSpeculator

        return EagleSpeculator.from_pretrained(convert(tmp_path, model, 1))
    return name


@pytest.mark.slow  # whole warm-ups on the Triton interpreter
@pytest.mark.parametrize("speculator", ["ngram", "draft", "eagle"])
def test_warm_up_launches_every_variant_later_requests_need(speculator, tmp_path, monkeypatch):
    """Requests after the warm-up (greedy and sampled with every mix of top-k and top-p, seeded and not, prompts of
    1 to 90 tokens, one token or many, arriving together and while others run, adaptive k) launch no kernel variant
    the warm-up did not."""
    monkeypatch.setenv(ENV_VAR, "triton")
    model = served_model()
    engine = ServingEngine(model, word_tokenizer(), _speculator(speculator, model, tmp_path),
                           num_speculative_tokens=3, max_batch_size=4, warmup=True, prefix_cache_tokens=0)
    with record_variants() as warm:
        engine.start()
    samplings = [None, SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.0, top_p=0.8),
                 SamplingParams(temperature=0.8, top_k=5, seed=3), SamplingParams(temperature=0.6, top_k=7, top_p=0.9)]
    plan = [(repeating(1 + 11 * i, seed=i), (1, 5, 9)[i % 3], samplings[i % len(samplings)]) for i in range(9)]
    try:
        with record_variants() as later:
            streams = [engine.submit(*plan[0]), engine.submit(*plan[1])]
            for request in plan[2:]:  # the rest arrive while those run, and queue behind a full batch
                streams.append(engine.submit(*request))
                time.sleep(0.01)
            for stream in streams:
                for _ in stream:
                    pass
        assert all(s.request.finish_reason in ("stop", "length") for s in streams)
        assert later.launches > 0 and warm.kernels() == {"paged_attention", "rejection_sample", "sampling_params"}
        assert later.seen <= warm.seen, sorted(later.seen - warm.seen)
        time.sleep(0.05)
        assert no_blocks_held(engine)
    finally:
        engine.shutdown()
