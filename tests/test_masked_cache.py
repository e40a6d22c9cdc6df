"""Models outside transformers' attention interface (Falcon, Bloom, GPT-Neo) on the masked dense cache
(`cache/masked.py`, `runners/dense.py`): greedy output equals plain `generate` token for token on ragged left-padded
batches, with n-gram drafts, identical drafts and disagreeing drafts (so rows roll back), with compaction forced, under
continuous batching; rollback then regenerate equals never drafting; what the cache cannot do is refused up front."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM, GPTNeoConfig, GPTNeoForCausalLM, LlamaConfig,
    LlamaForCausalLM, OpenAIGPTConfig, OpenAIGPTLMHeadModel,
)

import hf_specdec  # noqa: F401  (registers speculator=)
from hf_specdec import UnsupportedModelError
from hf_specdec.runners import dense as dense_runner
from hf_specdec.runners.dense import DenseRunner, make_runner
from hf_specdec.cache.masked import MaskedKVCache
from conftest import VOCAB, ragged_batch, repetitive_prompt

MAX_NEW = 20
# Untied, larger weights: tiny tied models mostly repeat their input, and two of them would agree on everything.
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, pad_token_id=0, bos_token_id=1,
             eos_token_id=None, tie_word_embeddings=False, initializer_range=0.2)
ARCHITECTURES = {
    "falcon": lambda: FalconForCausalLM(FalconConfig(**SMALL, num_hidden_layers=2)),
    # ALiBi positions counted from the attention mask.
    "falcon_alibi": lambda: FalconForCausalLM(FalconConfig(**SMALL, num_hidden_layers=2, alibi=True)),
    "bloom": lambda: BloomForCausalLM(BloomConfig(**SMALL, n_layer=2)),
    # A local window shorter than the sequences, so the window really cuts the context: rows stay contiguous.
    "gpt_neo": lambda: GPTNeoForCausalLM(GPTNeoConfig(**SMALL, num_layers=2, window_size=6, max_position_embeddings=128,
                                                      attention_types=[[["global", "local"], 1]])),
}
# Bloom's own attention turns a left-padded row into NaN in float64 (its padding queries see no key, and its softmax
# runs in float32 where float64's minimum is -inf): plain generate then emits token 0. float32 keeps it finite.
DTYPES = {"bloom": torch.float32}


def make(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch]().to(DTYPES.get(arch, torch.float64)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def run(target, speculator, input_ids, mask=None, **kwargs):
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                          speculator=speculator, num_speculative_tokens=4, speculative_schedule="constant",
                          return_dict_in_generate=True, **kwargs)
    return out.sequences, out.speculative_metrics


@pytest.mark.parametrize("kind", ["ngram", "same_draft", "random_draft"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_ragged_batch_equals_generate(arch, kind):
    target = make(arch)
    input_ids, mask = ragged_batch(rows=3, width=14)
    input_ids[0] = repetitive_prompt(width=14)[0]  # n-gram lookup finds matches in this row
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    speculator = {"ngram": "ngram", "same_draft": make(arch), "random_draft": make(arch, seed=1)}[kind]
    sequences, metrics = run(target, speculator, input_ids, mask)
    assert torch.equal(sequences, expected)
    assert metrics.num_draft_tokens > 0
    if kind == "same_draft":
        assert metrics.acceptance_rate == 1.0
    else:  # rows were rolled back past rejected drafts
        assert metrics.acceptance_rate < 1.0


@pytest.mark.parametrize("target_arch,draft_arch", [("falcon_alibi", "gpt_neo"), ("gpt_neo", "falcon_alibi")])
def test_a_draft_of_another_dense_architecture(target_arch, draft_arch):
    target = make(target_arch)
    input_ids, mask = ragged_batch(rows=3, width=12, seed=2)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    sequences, metrics = run(target, make(draft_arch, seed=4), input_ids, mask)
    assert torch.equal(sequences, expected)
    assert metrics.num_draft_tokens > 0 and metrics.acceptance_rate < 1.0


def test_paged_target_with_a_dense_draft_and_dense_target_with_a_paged_draft():
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**SMALL, intermediate_size=64, num_hidden_layers=2,
                                         num_key_value_heads=2)).double().eval()
    llama.generation_config.eos_token_id, llama.generation_config.pad_token_id = None, 0
    falcon = make("falcon_alibi")
    input_ids, mask = ragged_batch(rows=3, width=12, seed=3)
    for target, draft in ((llama, falcon), (falcon, llama)):
        expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
        sequences, metrics = run(target, draft, input_ids, mask)
        assert torch.equal(sequences, expected)
        assert metrics.num_draft_tokens > 0


@pytest.mark.parametrize("arch", ["falcon_alibi", "bloom"])
def test_compaction_keeps_the_output(arch, monkeypatch):
    """Holes past a tiny fraction of the width force compactions mid-generation; the output does not change."""
    compactions = []
    original = MaskedKVCache.compact

    def counted(cache):
        compactions.append(cache.width)
        original(cache)

    monkeypatch.setattr(MaskedKVCache, "compact", counted)
    monkeypatch.setattr(dense_runner, "DEFAULT_MAX_HOLE_FRACTION", 0.1)
    target = make(arch)
    assert dense_runner.needs_contiguous_rows(target) is True  # untried: contiguous by default
    input_ids, mask = ragged_batch(rows=3, width=14, seed=1)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    sequences, metrics = run(target, make(arch, seed=1), input_ids, mask)
    assert target._hf_specdec_contiguous_rows is False  # the trial found holes harmless
    assert torch.equal(sequences, expected)
    assert metrics.acceptance_rate < 1.0
    assert len(compactions) >= 2


def test_holes_and_padding_change_nothing_against_a_row_alone():
    """Rollback then regenerate equals never drafting: a row fed next to another, with rejected drafts rolled back
    (holes, some compacted away), gives the same logits at every step as the row fed alone without drafts."""
    model = make("falcon")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, VOCAB, (2, 30), generator=g)
    for fraction in (0.9, 0.2):
        batched = DenseRunner(model, contiguous=False, max_hole_fraction=fraction)
        alone = DenseRunner(model, contiguous=False)
        batched.add_sequence(7)
        batched.add_sequence(3)
        alone.add_sequence(0)
        with torch.no_grad():
            first = torch.zeros(2, 6, dtype=torch.long)
            first[0], first[1, 4:] = tokens[0, :6], tokens[1, :2]  # right-aligned
            batched.forward([7, 3], first, [6, 2], num_logits=1)
            alone.forward([0], tokens[1:, :2], [2], num_logits=1)
            for step in range(2, 20):
                committed = torch.stack([tokens[0, 4 + step], tokens[1, step]])[:, None]
                fed = torch.cat([committed, torch.randint(3, VOCAB, (2, 3), generator=g)], dim=1)
                out = batched.forward([7, 3], fed, [4, 4], num_logits=4).logits
                reference = alone.forward([0], tokens[1:, step:step + 1], [1], num_logits=1).logits
                torch.testing.assert_close(out[1, 0], reference[0, 0], rtol=1e-9, atol=1e-9)
                batched.rollback(7, batched.length(7) - 3)  # every draft rejected
                batched.rollback(3, batched.length(3) - 3)
        assert batched.length(3) == alone.length(0) == 20
        if fraction == 0.2:
            assert batched.cache.num_compactions > 0
        else:
            assert batched.cache.num_compactions == 0 and batched.cache.width > 60  # the holes stayed


def test_continuous_batching_equals_generate():
    """Rows join and leave between steps (more prompts than slots): each equals plain generate alone."""
    from hf_specdec import generate_batch

    for arch in ("falcon_alibi", "gpt_neo"):
        model = make(arch)
        prompts = [repetitive_prompt(width=5 + i % 4, seed=i)[0].tolist() for i in range(6)]
        out = generate_batch(model, prompts, "ngram", max_new_tokens=12, max_batch_size=2, num_speculative_tokens=3)
        for prompt, generated in zip(prompts, out):
            alone = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
            assert generated == alone[0, len(prompt):].tolist(), (arch, prompt)


def test_rows_joining_an_idle_cache_that_is_due_for_compaction():
    """After every row left, the cache keeps its width and is due for compaction; two rows joining then (a served
    model's next requests after a quiet spell, or after the warm-up) take storage rows the last forward never had:
    the compaction before their first forward gathers them too, and each equals plain generate alone."""
    from hf_specdec.serving.engine import ServingEngine

    for arch in ("falcon_alibi", "bloom"):
        model = make(arch)
        prompts = [repetitive_prompt(width=w, seed=i)[0].tolist() for i, w in enumerate((14, 6, 9))]
        engine = ServingEngine(model, None, "ngram", num_speculative_tokens=3, max_batch_size=3,
                               schedule="constant", warmup=False).start()
        try:
            first = engine.submit(prompts[0], 8)
            list(first)
            rest = [engine.submit(p, 8) for p in prompts[1:]]
            for stream in rest:
                list(stream)
        finally:
            engine.shutdown()
        for prompt, stream in zip(prompts, [first, *rest]):
            alone = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
            assert stream.request.output_ids == alone[0, len(prompt):].tolist(), arch


def test_freed_rows_are_reused_and_compacted_away():
    cache = MaskedKVCache("cpu", max_hole_fraction=0.5)
    for seq in range(3):
        cache.add_sequence(seq)
    mask, starts = cache.begin_step([0, 1, 2], [3, 1, 2])
    cache.update(torch.ones(3, 1, 3, 2), torch.ones(3, 1, 3, 2), 0)
    cache.end_step()
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]] and starts == [0, 0, 0]
    cache.free(1)
    cache.add_sequence(5)  # takes the freed storage row, with nothing of its previous occupant
    mask, starts = cache.begin_step([5], [1])
    assert mask.tolist() == [[0, 0, 0, 1]] and starts == [0]
    cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 0)
    cache.end_step()
    cache.rollback(0, 1)
    cache.compact()
    assert cache.width == 2 and cache.lengths == [1, 1, 2]  # seq 0, seq 5 (storage row 1), seq 2
    assert cache.valid[:, :2].tolist() == [[False, True], [False, True], [True, True]]


def test_what_the_masked_cache_cannot_do_is_refused_up_front():
    falcon = make("falcon_alibi")
    prompt = repetitive_prompt(width=10)
    with pytest.raises(ValueError, match="draft tree"):
        falcon.generate(prompt, max_new_tokens=4, do_sample=False, speculator="ngram",
                        speculative_tree_nodes=4, speculative_schedule="constant")
    with pytest.raises(UnsupportedModelError, match="max_num_blocks"):
        make_runner(falcon, max_num_blocks=8)
    gpt = OpenAIGPTLMHeadModel(OpenAIGPTConfig(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4)).eval()
    with pytest.raises(UnsupportedModelError, match="takes no cache"):
        gpt.generate(prompt, max_new_tokens=4, do_sample=False, speculator="ngram")
