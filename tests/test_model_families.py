"""What the architecture sweep's small batch does not reach (tests/model_sweep.py): latent attention (DeepSeek's value
heads narrower than its queries) in a step where rows feed very different numbers of tokens, and LongRoPE (Phi-3's
128k models), whose factors transformers picks by each forward's largest position."""

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
    from hf_specdec.cache.recurrent import make_cache

    assert make_cache(build("deepseek_v3")).kernel_backend == "torch"
    assert make_cache(build("llama")).kernel_backend == "auto"


def longrope_model(original: int = 16, family: str = "phi3"):
    """A tiny float64 LongRoPE model: Phi-3 (whose generate recomputes a sequence crossing `original` with the long
    factors) or Llama (whose generate does not)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    config_class, model_class = (Phi3Config, Phi3ForCausalLM) if family == "phi3" else (LlamaConfig, LlamaForCausalLM)
    config = tiny_config(config_class)
    half = config.hidden_size // config.num_attention_heads // 2
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
                              "long_factor": [40.0] * half, "original_max_position_embeddings": original}
    config.original_max_position_embeddings = original
    config.initializer_range = 0.2  # peaky attention: a token rotated with the other factors changes the argmax
    torch.manual_seed(0)
    model = model_class(config).to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def plain(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """One-row plain greedy generate: LongRoPE's reference (a batch's rows share each forward's factors)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def speculative(model, lengths, max_new_tokens, speculator="ngram", seed=1, **kwargs):
    """Ragged rows of these prompt lengths: each row's new tokens from speculative `generate` in one batch, and from
    its own plain decoding."""
    ids, mask = ragged(lengths, seed=seed)
    rows = [ids[i, ids.shape[1] - n:].tolist() for i, n in enumerate(lengths)]
    spec = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                          speculator=speculator, **kwargs)
    return [row[ids.shape[1]:] for row in spec.tolist()], [plain(model, row, max_new_tokens) for row in rows]


@pytest.mark.parametrize("schedule", ["constant", "adaptive"])
def test_longrope_rows_crossing_the_switch_equal_plain_decoding(schedule):
    """Llama with LongRoPE (its generate picks the factors per forward and never recomputes): rows crossing
    `original_max_position_embeddings` (16) while generating, a prompt past it, one ending on it, alone and in one
    ragged batch, equal their one-row plain decoding, though verify steps span the switch and short rows share
    forwards with long ones (`rope.TokenRope` picks the factors per token)."""
    from hf_specdec.runners.support import exact_context
    from hf_specdec.cache.rope import recomputes_at_switch

    model = longrope_model(16, family="llama")
    assert not recomputes_at_switch(model)
    assert exact_context(model) == (model.config.max_position_embeddings, None)
    for lengths in ([6], [20], [6, 20, 13, 16]):
        spec, expected = speculative(model, lengths, 14, num_speculative_tokens=4, speculative_schedule=schedule)
        assert spec == expected, lengths


@pytest.mark.parametrize("speculator", ["ngram", "draft", "eagle-tree"])
def test_phi3_longrope_rows_crossing_the_switch_equal_plain_decoding(speculator, tmp_path):
    """Phi-3's generate feeds a sequence crossing 16 again with the long factors. Rows crossing it while generating
    (with n-gram drafts, a draft model that is the target itself, so every draft is accepted and verifies would span
    the switch, and EAGLE draft trees), a prompt past it, one ending on it, in ragged batches, equal their one-row
    plain decoding: drafts stop at the switch and the row is recomputed there (`rope.RopeRows`)."""
    import copy

    from hf_specdec.runners.support import exact_context
    from hf_specdec.cache.rope import recomputes_at_switch

    model = longrope_model(16)
    assert recomputes_at_switch(model)
    assert exact_context(model) == (model.config.max_position_embeddings, None)
    kwargs = dict(num_speculative_tokens=4, speculative_schedule="constant")
    spec = speculator
    if speculator == "draft":
        spec = copy.deepcopy(model)
    elif speculator == "eagle-tree":
        from hf_specdec import EagleSpeculator
        from test_eagle import convert

        spec = EagleSpeculator.from_pretrained(convert(tmp_path, model, 3, aux_layers=[0, 1, 1]))
        kwargs.update(speculative_tree_nodes=6, speculative_tree_branching=2)
    recomputes = []
    from hf_specdec.runners.model_runner import ModelRunner

    original = ModelRunner.recompute

    def counted(self, seq_ids, input_ids):
        recomputes.append((list(seq_ids), input_ids.shape[1]))
        return original(self, seq_ids, input_ids)

    ModelRunner.recompute = counted
    try:
        for lengths in ([6], [20], [6, 20, 13, 16, 3]):
            spec_out, expected = speculative(model, lengths, 16, spec, **kwargs)
            assert spec_out == expected, lengths
    finally:
        ModelRunner.recompute = original
    assert recomputes and all(width == 16 for _, width in recomputes)


def test_phi3_longrope_served_past_its_original_context():
    """The serving engine with Phi-3's LongRoPE (original 16): requests crossing it while others run (each recomputed
    there), a long prompt read in pieces of 8 (its first pieces, below 16, rotated with the long factors as its
    whole-prompt forward is), and a prefix stored by a short prompt (short factors) that a long prompt beginning
    with it must not reuse, while a short one does. Each request equals its one-row plain decoding."""
    from hf_specdec.serving.engine import ServingEngine

    model = longrope_model(16)
    short = ragged([14], seed=2)[0][0].tolist()
    plan = [(ragged([10], seed=3)[0][0].tolist(), 14), (short, 8),
            (short[:12] + ragged([10], seed=4)[0][0].tolist(), 8), (short[:12] + [5, 6], 9),
            (ragged([30], seed=5)[0][0].tolist(), 8)]
    expected = [plain(model, prompt, n) for prompt, n in plan]
    engine = ServingEngine(model, None, "ngram", num_speculative_tokens=4, max_batch_size=3, block_size=4,
                           schedule="constant", prefill_chunk_tokens=8, warmup=False)
    assert engine.max_model_len == model.config.max_position_embeddings
    engine.start()
    try:
        for group in (plan[:2], plan[2:]):  # the short prompt's blocks are stored before the others arrive
            streams = [engine.submit(prompt, n) for prompt, n in group]
            for stream in streams:
                for _ in stream:
                    pass
            for stream, (prompt, n) in zip(streams, group):
                assert stream.request.output_ids == expected[plan.index((prompt, n))], prompt
        assert engine.prefix_cache.num_hit_tokens >= 12  # the short prompt sharing 12 tokens read them
        assert engine.scheduler.num_prefill_chunks >= 2
        assert engine.metrics.num_draft_tokens > 0
    finally:
        engine.shutdown()


def test_longrope_without_transformers_rotary_is_capped_at_its_original_context():
    """A LongRoPE model whose rotary module hf_specdec cannot switch per token is served up to
    `original_max_position_embeddings` and refused past it, naming why."""
    from hf_specdec.runners.support import exact_context
    from hf_specdec.serving.engine import ServingEngine
    from hf_specdec.serving.stream import RequestError

    model = longrope_model(16)
    rotary = model.model.rotary_emb
    rotary.__class__ = type("OwnRotary", (torch.nn.Module,), {"forward": type(rotary).forward.__wrapped__})
    limit, why = exact_context(model)
    assert limit == 16 and "original_max_position_embeddings" in why
    for seed in range(2):
        ids, mask = ragged([6], seed=seed)
        reference = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        spec = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, speculator="ngram",
                              num_speculative_tokens=4, speculative_schedule="constant")
        assert torch.equal(spec, reference)
    ids, mask = ragged([10])
    with pytest.raises(ValueError, match="exceeds 16 tokens.*LongRoPE.*original_max_position_embeddings"):
        model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, speculator="ngram")
    engine = ServingEngine(model, None, "ngram", num_speculative_tokens=4, warmup=False)
    assert engine.max_model_len == 16
    with pytest.raises(RequestError, match="context is 16 tokens"):
        engine.submit(ids[0].tolist(), max_tokens=10)
    assert exact_context(build("phi3")) == (build("phi3").config.max_position_embeddings, None)  # no LongRoPE


def test_longrope_switching_never_writes_the_rotary_module():
    """The per-token tables come from the module's own forward through a view holding the other frequencies: the
    module's buffer is never written inside hf_specdec's forwards (transformers' choice writes it, which would
    disturb a plain generate on the same model in another thread), and a model hf_specdec ran on pickles and loads
    back."""
    import pickle

    from hf_specdec.cache.rope import TokenRope

    model = longrope_model(16)
    ids, mask = ragged([6, 20], seed=1)
    expected = [plain(model, ids[i, ids.shape[1] - n:].tolist(), 14) for i, n in enumerate([6, 20])]
    assert TokenRope.of(model) is not None  # (its one-off check runs transformers' choice, restoring the buffer)
    rotary_class = type(model.model.rotary_emb)
    chosen = rotary_class.forward
    calls = []

    def counted(module, *args, **kwargs):
        calls.append(args[1].shape)
        return chosen(module, *args, **kwargs)

    counted.__wrapped__ = chosen
    rotary_class.forward = counted
    try:
        spec = model.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, speculator="ngram",
                              num_speculative_tokens=4, speculative_schedule="constant")
    finally:
        rotary_class.forward = chosen
    assert [row[ids.shape[1]:] for row in spec.tolist()] == expected
    assert calls == []
    copy = pickle.loads(pickle.dumps(model))
    assert torch.equal(copy.generate(ids[1:], attention_mask=mask[1:], max_new_tokens=4, do_sample=False),
                       model.generate(ids[1:], attention_mask=mask[1:], max_new_tokens=4, do_sample=False))


def test_phimoe_longrope_is_capped_at_its_original_context():
    """PhiMoE's rotary forward picks its scale by the forward's largest position itself, which a view with other
    frequencies cannot switch: it is served up to `original_max_position_embeddings`, naming why."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    from hf_specdec.runners.support import exact_context
    from hf_specdec.cache.rope import TokenRope

    config = tiny_config(PhimoeConfig)
    half = config.hidden_size // config.num_attention_heads // 2
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
                              "long_factor": [40.0] * half, "original_max_position_embeddings": 16,
                              "short_mscale": 1.0, "long_mscale": 1.3}
    config.original_max_position_embeddings = 16
    config.max_position_embeddings = 256
    model = PhimoeForCausalLM(config).eval()
    assert not TokenRope.supported(model) and TokenRope.of(model) is None
    limit, why = exact_context(model)
    assert limit == 16 and "PhiMoE" in why


# --- On a GPU (`-m gpu`, run by benchmarks/gpu_check.py; skipped without one) ---------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.gpu
@needs_cuda
def test_latent_attention_on_cuda_equals_generate(dtype):
    """DeepSeek-V3's latent attention on CUDA (the PyTorch attention path beside the engine's other CUDA ops), rows
    of very different lengths: greedy output equals plain generate on the same device."""
    model = build("deepseek_v3", dtype=dtype).cuda()
    ids, mask = ragged([6, 13, 30, 3])
    ids, mask = ids.cuda(), mask.cuda()
    plain_out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, speculator="ngram",
                         num_speculative_tokens=4, speculative_schedule="constant", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain_out)
    assert out.speculative_metrics.num_draft_tokens > 0


@pytest.mark.parametrize("family", ["phi3", "llama"])
@pytest.mark.gpu
@needs_cuda
def test_longrope_on_cuda_rows_crossing_the_switch_equal_plain_decoding(family):
    """Per-token LongRoPE on CUDA (the rotary tables from the module's own forward on the GPU; Phi-3's recompute at
    the switch): rows crossing `original_max_position_embeddings` in one ragged batch, with n-gram drafts and a draft
    model that is the target itself (every draft accepted), equal their one-row plain decoding on the GPU."""
    import copy

    model = longrope_model(16, family=family).cuda()
    ids, mask = ragged([6, 20, 13, 16, 3], seed=1)
    lengths = mask.sum(1).tolist()
    rows = [ids[i, ids.shape[1] - n:].tolist() for i, n in enumerate(lengths)]
    expected = []
    for row in rows:
        one = model.generate(torch.tensor([row], device="cuda"), attention_mask=torch.ones(1, len(row), dtype=torch.long,
                             device="cuda"), max_new_tokens=16, do_sample=False)
        expected.append(one[0, len(row):].tolist())
    for speculator in ("ngram", copy.deepcopy(model)):
        spec = model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=16, do_sample=False,
                              speculator=speculator, num_speculative_tokens=4, speculative_schedule="constant")
        assert [row[ids.shape[1]:] for row in spec.tolist()] == expected, speculator if isinstance(speculator, str) \
            else "draft model"


@pytest.mark.gpu
@needs_cuda
def test_phi3_longrope_served_on_cuda():
    """The serving engine on CUDA with Phi-3's LongRoPE: requests crossing the switch while others run, and a long
    prompt read in chunks, each equal to its one-row plain decoding on the GPU."""
    from hf_specdec.serving.engine import ServingEngine

    model = longrope_model(16).cuda()
    plan = [(ragged([10], seed=3)[0][0].tolist(), 14), (ragged([14], seed=2)[0][0].tolist(), 8),
            (ragged([30], seed=5)[0][0].tolist(), 8)]
    expected = []
    for prompt, n in plan:
        one = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device="cuda"))
        expected.append(one[0, len(prompt):].tolist())
    engine = ServingEngine(model, None, "ngram", num_speculative_tokens=4, max_batch_size=3, block_size=4,
                           schedule="constant", prefill_chunk_tokens=8, warmup=False)
    engine.start()
    try:
        streams = [engine.submit(prompt, n) for prompt, n in plan]
        for stream in streams:
            for _ in stream:
                pass
        assert [stream.request.output_ids for stream in streams] == expected
    finally:
        engine.shutdown()
