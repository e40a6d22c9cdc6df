"""Speculative sampling end to end: the first two generated tokens follow the target's exact joint distribution."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import hf_specdec  # noqa: F401

VOCAB = 8
SAMPLES = 20_000


def peaky_model(seed, sharpness):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=1,
                         eos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def exact_joint(model, prompt, warpers):
    """`[VOCAB * VOCAB]` probability of each (first, second) generated token pair under the target."""
    def next_probs(ids):
        logits = model(ids).logits[:, -1].float()
        return torch.softmax(warpers(ids, logits), -1)

    with torch.no_grad():
        first = next_probs(prompt)[0]
        extended = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
        second = next_probs(extended)  # [VOCAB, VOCAB]
    return (first[:, None] * second).flatten().double()


def tv(samples, probs):
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


SETTINGS = {
    "plain": ({}, LogitsProcessorList()),
    "temperature": ({"temperature": 0.7}, LogitsProcessorList([TemperatureLogitsWarper(0.7)])),
    "top_k": ({"top_k": 3}, LogitsProcessorList([TopKLogitsWarper(3)])),
    "top_p": ({"top_p": 0.8, "temperature": 1.3},
              LogitsProcessorList([TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.8)])),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("speculator_kind", ["draft", "ngram"])
def test_sampling_matches_target_joint_distribution(setting, speculator_kind):
    kwargs, warpers = SETTINGS[setting]
    target = peaky_model(0, sharpness=4.0)
    draft = peaky_model(5, sharpness=6.0)  # a confident draft that disagrees with the target
    prompt = torch.tensor([[1, 3, 4, 3, 4, 3]])  # repetitive, so n-gram proposes too
    expected = exact_joint(target, prompt, warpers)
    speculator = draft if speculator_kind == "draft" else "ngram"
    torch.manual_seed(0)
    out = target.generate(prompt.expand(SAMPLES, -1), max_new_tokens=2, do_sample=True, speculator=speculator,
                          num_speculative_tokens=3, speculative_schedule="constant", return_dict_in_generate=True,
                          **kwargs)
    assert out.speculative_metrics.num_draft_tokens > 0
    pairs = out.sequences[:, -2] * VOCAB + out.sequences[:, -1]
    # Expected TV noise for 64 outcomes and 20k samples is about 0.02 at worst (uniform); 0.045 leaves a margin.
    assert tv(pairs, expected) < 0.045
    # Power: emitting the draft's own samples would fail the bound above by a wide margin.
    draft_joint = exact_joint(draft, prompt, warpers)
    assert 0.5 * (draft_joint - expected).abs().sum() > 0.2


def test_seeded_sampling_is_reproducible():
    target, draft = peaky_model(0, 4.0), peaky_model(5, 6.0)
    prompt = torch.tensor([[1, 3, 4, 3, 4, 3]] * 4)
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(target.generate(prompt, max_new_tokens=12, do_sample=True, speculator=draft))
    assert torch.equal(outs[0], outs[1])


def test_cpu_sampling_warpers_run_as_the_reference_and_keep_transformers_tokens(monkeypatch):
    """On a CPU, a call whose processors are exactly temperature, top-k and top-p runs the PyTorch reference (no
    vocabulary sort) instead of transformers' warpers, and keeps the same tokens with the same scores; any other
    processor keeps transformers' own path."""
    import hf_specdec.decode.logits as logits_module
    from hf_specdec.decode.logits import LogitsProcessing
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    calls = []
    original = logits_module.apply_sampling_params
    monkeypatch.setattr(logits_module, "apply_sampling_params",
                        lambda *a, **k: calls.append(k.get("backend")) or original(*a, **k))
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(7, 3000, generator=g) * 4
    token_ids = torch.randint(0, 3000, (7, 5), generator=g)
    rows, lens = torch.arange(7), torch.full((7,), 5)
    for warpers in ([TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)],
                    [TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.5)], [TopKLogitsWarper(3)]):
        calls.clear()
        got = LogitsProcessing(LogitsProcessorList(warpers))(token_ids, rows, lens, scores)
        assert calls == ["torch"]
        assert torch.equal(got, LogitsProcessorList(warpers)(token_ids, scores))
    calls.clear()
    penalised = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2), TopPLogitsWarper(0.9)])
    LogitsProcessing(penalised)(token_ids, rows, lens, scores)
    assert calls == []
