"""Bad input is refused up front with an error that names the problem."""

import importlib.util
import pathlib

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

import hf_specdec
from conftest import make_model, ragged_batch, repetitive_prompt

PROMPT = repetitive_prompt(width=10)


@pytest.mark.parametrize("speculator,error,match", [
    (42, TypeError, "speculator"),
    ("nope", ValueError, "speculator"),
    ([1, 2], TypeError, "speculator"),
])
def test_bad_speculator_is_refused(speculator, error, match):
    with pytest.raises(error, match=match):
        make_model().generate(PROMPT, max_new_tokens=4, speculator=speculator)


@pytest.mark.parametrize("k", [0, -1, 1000, "5", 2.5, True])
def test_bad_num_speculative_tokens_is_refused(k):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_model().generate(PROMPT, max_new_tokens=4, speculator="ngram", num_speculative_tokens=k)


def test_num_speculative_tokens_without_speculator_is_refused():
    with pytest.raises(ValueError, match="speculator"):
        make_model().generate(PROMPT, max_new_tokens=4, num_speculative_tokens=3)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"num_beams": 2}, ValueError, "beam"),
    ({"output_scores": True, "return_dict_in_generate": True}, NotImplementedError, "output_scores"),
    ({"use_cache": False}, ValueError, "cache"),
    ({"prompt_lookup_num_tokens": 3}, ValueError, "prompt_lookup_num_tokens"),
    ({"max_new_tokens": 10_000}, ValueError, "context"),
])
def test_unsupported_generate_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_model().generate(PROMPT, **{"max_new_tokens": 4, **kwargs}, speculator="ngram")


def test_assistant_model_together_with_speculator_is_refused():
    with pytest.raises(ValueError, match="assistant_model"):
        make_model().generate(PROMPT, max_new_tokens=4, speculator="ngram", assistant_model=make_model(seed=1))


def test_encoder_decoder_target_is_refused():
    config = T5Config(vocab_size=96, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).eval()
    with pytest.raises(hf_specdec.UnsupportedModelError, match="encoder-decoder"):
        model.generate(PROMPT, max_new_tokens=4, speculator="ngram")


def test_draft_with_a_different_vocabulary_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    draft = LlamaForCausalLM(LlamaConfig(vocab_size=5000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).double()
    with pytest.raises(ValueError, match="vocabulary"):
        make_model().generate(PROMPT, max_new_tokens=4, speculator=draft)


def _small_vocabulary_draft(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    draft = LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    return draft.double().eval()


def test_draft_with_a_smaller_vocabulary_is_refused_before_any_forward(monkeypatch):
    """A draft with fewer ids than the target, given a prompt it cannot read: a clear error, not an IndexError in its
    embedding, before the first step (only the up-front trial forwards of runners/support.py have run)."""
    from hf_specdec.decode.step import Step

    steps = []
    original = Step.__call__
    monkeypatch.setattr(Step, "__call__", lambda self, *a, **k: steps.append(1) or original(self, *a, **k))
    target, draft = make_model(), _small_vocabulary_draft(48)
    prompt = torch.tensor([[5, 60, 7, 90, 5, 60]])
    with pytest.raises(ValueError, match=r"vocabulary has 48 tokens, fewer than the target's 96.*rows \[0\].*up to 90"):
        target.generate(prompt, max_new_tokens=4, speculator=draft)
    assert not steps
    assert target.config._attn_implementation != "hf_specdec_paged"  # the target's attention is restored


def test_target_ids_past_a_smaller_draft_vocabulary_keep_the_output_exact():
    """Embedding padding as in the Qwen2.5 family: the draft reads every prompt id, but the target emits ids past the
    draft's vocabulary; the draft gets its last id in their place, and the output is still the target's."""
    target, draft = make_model(), _small_vocabulary_draft(88)
    with torch.no_grad():
        target.lm_head.weight[90] *= 40  # make the target emit an id the draft has no embedding for
    prompt = torch.tensor([[5, 60, 7, 30, 5, 60, 7, 30]])
    expected = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert int(expected[0, 8:].max()) >= 88
    out = target.generate(prompt, max_new_tokens=12, do_sample=False, speculator=draft,
                          speculative_schedule="constant", num_speculative_tokens=3)
    assert torch.equal(out, expected)
    torch.manual_seed(0)
    target.generate(prompt, max_new_tokens=12, do_sample=True, speculator=draft)  # sampling runs too


def test_empty_prompt_row_is_refused():
    input_ids, mask = ragged_batch(rows=2, width=6)
    mask[1] = 0
    with pytest.raises(ValueError, match="empty prompt"):
        make_model().generate(input_ids, attention_mask=mask, max_new_tokens=4, speculator="ngram")


def test_streamer_with_a_batch_is_refused():
    from transformers.generation.streamers import BaseStreamer

    class Null(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    input_ids, mask = ragged_batch(rows=2, width=6)
    with pytest.raises(ValueError, match="streamer"):
        make_model().generate(input_ids, attention_mask=mask, max_new_tokens=4, speculator="ngram", streamer=Null())


def test_plain_generate_is_untouched_and_registration_is_idempotent():
    model = make_model()
    before = model.generate(PROMPT, max_new_tokens=6, do_sample=False)
    hf_specdec.register_generation_strategy()
    hf_specdec.register_generation_strategy()
    assert torch.equal(model.generate(PROMPT, max_new_tokens=6, do_sample=False), before)
    assert model.config._attn_implementation != "hf_specdec_paged"  # restored after speculative calls too
    model.generate(PROMPT, max_new_tokens=6, speculator="ngram")
    assert model.config._attn_implementation != "hf_specdec_paged"


def test_kv_pool_cap_refuses_before_corrupting():
    engine = hf_specdec.SpeculativeEngine(make_model(), hf_specdec.NgramSpeculator(), 3, block_size=4,
                                          max_num_blocks=3)
    with pytest.raises(hf_specdec.OutOfBlocksError):
        engine.generate(PROMPT, None, max_new_tokens=20, do_sample=False)


@pytest.mark.slow  # a fresh interpreter
def test_top_level_kernels_is_not_this_repository(tmp_path):
    """PyPI's `kernels` package exists and transformers probes for it: ours must only be `hf_specdec.kernels`."""
    import subprocess
    import sys

    repo = pathlib.Path(hf_specdec.__file__).resolve().parents[1]
    code = ("import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else '');"
            "print(u.find_spec('hf_specdec.kernels').origin)")
    top, ours = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                               check=True).stdout.splitlines()
    assert not top or not pathlib.Path(top).resolve().is_relative_to(repo)
    assert pathlib.Path(ours).resolve() == repo / "hf_specdec" / "kernels" / "__init__.py"


def test_bad_speculative_schedule_is_refused():
    with pytest.raises(ValueError, match="speculative_schedule"):
        make_model().generate(PROMPT, max_new_tokens=4, speculator="ngram", speculative_schedule="fast")
    with pytest.raises(ValueError, match="speculator"):
        make_model().generate(PROMPT, max_new_tokens=4, speculative_schedule="constant")


def test_draft_in_another_dtype_than_the_target_works():
    """Drafts cross over as token ids and float32 probabilities, so a draft may keep its own dtype: output stays the
    target's, greedy and seeded sampling alike."""
    target = make_model("llama")
    draft = make_model("llama", seed=1, dtype=torch.float32)
    input_ids, mask = ragged_batch(rows=2, width=10)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, speculator=draft,
                          speculative_schedule="constant", return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculative_metrics.num_draft_tokens > 0

    def sample():
        torch.manual_seed(0)
        return target.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=True, speculator=draft,
                               speculative_schedule="constant", return_dict_in_generate=True)

    first, second = sample(), sample()
    assert torch.equal(first.sequences, second.sequences)
    assert first.speculative_metrics.num_draft_tokens > 0


@pytest.mark.slow  # builds the wheel
def test_every_module_is_in_the_wheel(tmp_path):
    """A regular (non-editable) install holds every module of the package, the kernels and the shipped head."""
    import subprocess
    import sys
    import zipfile

    repo = pathlib.Path(hf_specdec.__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(repo), "-w",
                    str(tmp_path)], check=True, capture_output=True, timeout=600)
    names = set(zipfile.ZipFile(next(tmp_path.glob("hf_specdec-*.whl"))).namelist())
    sources = {str(p.relative_to(repo)) for p in (repo / "hf_specdec").rglob("*.py") if "__pycache__" not in p.parts}
    assert sources - names == set()
    assert any(n.startswith("hf_specdec/trained_heads/") and n.endswith(".safetensors") for n in names)
