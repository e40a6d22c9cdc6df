"""The speculative-text-generation pipeline, the tokenizer check, and the hf-specdec CLI."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, pipeline
from transformers.pipelines.text_generation import ReturnType

import hf_specdec
from conftest import COMMON, make_model, make_tokenizer, word_prompt

GREEDY = dict(max_new_tokens=12, do_sample=False)
PROMPTS = [word_prompt(1, 9), word_prompt(2, 5), word_prompt(3, 13)]


@pytest.fixture
def target():
    return make_model("llama")


@pytest.mark.parametrize("assistant", ["ngram", "draft"])
def test_pipeline_equals_stock_text_generation(target, assistant):
    tokenizer = make_tokenizer()
    stock = pipeline("text-generation", model=target, tokenizer=tokenizer)
    ours = pipeline("speculative-text-generation", model=target, tokenizer=tokenizer,
                    assistant="ngram" if assistant == "ngram" else make_model("llama", seed=0))
    for prompt in PROMPTS:
        assert ours(prompt, **GREEDY) == stock(prompt, **GREEDY)
    assert ours(PROMPTS, batch_size=3, **GREEDY) == stock(PROMPTS, batch_size=1, **GREEDY)
    assert ours(PROMPTS[0], return_full_text=False, **GREEDY) == stock(PROMPTS[0], return_full_text=False, **GREEDY)


def test_pipeline_chat_input_and_options(target):
    tokenizer = make_tokenizer()
    stock = pipeline("text-generation", model=target, tokenizer=tokenizer)
    ours = pipeline("speculative-text-generation", model=target, tokenizer=tokenizer, assistant="ngram",
                    num_speculative_tokens=3)
    chat = [{"role": "user", "content": PROMPTS[0]}]
    assert ours(chat, **GREEDY) == stock(chat, **GREEDY)
    assert ours(chat, num_speculative_tokens=7, **GREEDY) == stock(chat, **GREEDY)


def test_pipeline_loads_assistant_from_a_path(target, tmp_path):
    draft, tokenizer = make_model("llama", seed=0), make_tokenizer()
    draft.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ours = pipeline("speculative-text-generation", model=target, tokenizer=tokenizer, assistant=str(tmp_path))
    stock = pipeline("text-generation", model=target, tokenizer=tokenizer)
    assert ours(PROMPTS[1], **GREEDY) == stock(PROMPTS[1], **GREEDY)
    assert ours.speculator.model.dtype == target.dtype


def test_pipeline_refuses_mismatched_tokenizers(target):
    with pytest.raises(hf_specdec.TokenizerMismatchError, match="id 4"):
        pipeline("speculative-text-generation", model=target, tokenizer=make_tokenizer(),
                 assistant=make_model("llama", seed=1), assistant_tokenizer=make_tokenizer(shuffle_seed=0))


def test_pipeline_requires_an_assistant(target):
    with pytest.raises(ValueError, match="assistant"):
        pipeline("speculative-text-generation", model=target, tokenizer=make_tokenizer())


def test_generate_refuses_mismatched_tokenizers(target):
    input_ids = make_tokenizer()(PROMPTS[0], return_tensors="pt").input_ids
    with pytest.raises(hf_specdec.TokenizerMismatchError) as error:
        target.generate(input_ids, speculator=make_model("llama", seed=1), tokenizer=make_tokenizer(),
                        assistant_tokenizer=make_tokenizer(shuffle_seed=0), **GREEDY)
    assert isinstance(error.value, ValueError)
    message = str(error.value)
    assert "for the target but" in message and "ngram" in message  # what differs, and what to do


def test_tokenizer_check_reports_size_and_special_token_differences():
    small = make_tokenizer()
    small.add_tokens(["extra"])
    with pytest.raises(hf_specdec.TokenizerMismatchError, match="sizes differ"):
        hf_specdec.check_tokenizers_match(make_tokenizer(), small)
    hf_specdec.check_tokenizers_match(make_tokenizer(), make_tokenizer())  # equal tokenizers pass


def test_padded_draft_vocabulary_is_compatible(target):
    """Same tokenizer, embedding padded to 128 rows (as in the Qwen2.5 family): accepted, output unchanged."""
    torch.manual_seed(1)
    draft = LlamaForCausalLM(LlamaConfig(**{**COMMON, "vocab_size": 128})).double().eval()
    tokenizer = make_tokenizer()
    input_ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    expected = target.generate(input_ids, **GREEDY)
    out = target.generate(input_ids, speculator=draft, tokenizer=tokenizer, assistant_tokenizer=tokenizer,
                          speculative_schedule="constant", return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, expected) and out.speculative_metrics.num_draft_tokens > 0
    torch.manual_seed(0)
    sampled = target.generate(input_ids, speculator=draft, do_sample=True, max_new_tokens=12,
                              speculative_schedule="constant")
    assert int(sampled.max()) < COMMON["vocab_size"]  # ids past the target's vocabulary are never emitted


def test_cli_generate_end_to_end(tmp_path, capsys):
    from hf_specdec.cli import main

    model, tokenizer = make_model("llama", dtype=torch.float32), make_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--speculator", "ngram", "-k", "3", "--max-new-tokens", "10",
                 PROMPTS[0]]) == 0
    captured = capsys.readouterr()
    assert "acceptance rate" in captured.err and "tokens/s" in captured.err
    expected = model.generate(**tokenizer(PROMPTS[0] + " ", return_tensors="pt", add_special_tokens=False),
                              max_new_tokens=10, do_sample=False)
    assert tokenizer.decode(expected[0, -10:], skip_special_tokens=True) in captured.out


def test_cli_run_compares_speculators_per_prompt_and_names_the_best(tmp_path, capsys):
    """`run` with a model that ships no trained head: 'auto' is n-gram alone; 'eagle' is refused with the fix."""
    from hf_specdec.cli import main

    model, tokenizer = make_model("llama", dtype=torch.float32), make_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    args = ["run", "--model", str(tmp_path), "-k", "3", "--max-new-tokens", "10", "--repeats", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("=== ") == 2 and "grounded prompt" in out and "open-chat prompt" in out
    assert out.count("speculator ngram, k=3") == 2 and "speculator eagle" not in out
    assert out.count("output identical to plain greedy generate: True") == 4  # speculation off and n-gram
    assert out.count("hf_specdec, speculation off:") == 2 and "= engine" in out
    assert main([*args, "--prompt", PROMPTS[0]]) == 0
    assert capsys.readouterr().out.count("=== your prompt") == 1
    with pytest.raises(SystemExit, match="no trained EAGLE head ships for .*train-eagle"):
        main([*args, "--speculator", "eagle"])


def test_cli_help_for_every_command(capsys):
    from hf_specdec.cli import main

    for command in ([], ["run"], ["generate"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--help"])
        assert exit_info.value.code == 0
    assert "usage" in capsys.readouterr().out


def ended_early_batch(target, tokenizer):
    """Five prompts of different lengths and an EOS (set on the model) that some of them reach early."""
    prompts = [word_prompt(seed, length) for seed, length in ((1, 6), (2, 11), (3, 3), (4, 8), (5, 14))]
    ids = tokenizer(prompts[0], return_tensors="pt").input_ids
    target.generation_config.eos_token_id = int(target.generate(ids, **GREEDY)[0, ids.shape[1] + 2])
    return prompts


def test_batched_output_keeps_the_stock_padding(target, monkeypatch):
    """Stock batches pad each prompt on the left to its batch's longest and each row that ended early on the right
    with pad_token_id: `return_tensors=True` shows both, and a pad token that is no special token shows in the text.
    Those calls run the stock batches; text whose padding is skipped still runs with continuous batching."""
    tokenizer = make_tokenizer()
    prompts = ended_early_batch(target, tokenizer)
    stock = pipeline("text-generation", model=target, tokenizer=tokenizer)
    ours = pipeline("speculative-text-generation", model=target, tokenizer=tokenizer, assistant="ngram")
    continuous = []
    original = type(ours)._continuous
    monkeypatch.setattr(type(ours), "_continuous", lambda self, *args: continuous.append(1) or original(self, *args))
    visible = stock(prompts, batch_size=2, pad_token_id=5, **GREEDY)
    assert visible != stock(prompts, batch_size=2, **GREEDY)  # a row ended early, padded with the word w5
    assert ours(prompts, batch_size=2, pad_token_id=5, **GREEDY) == visible
    for options in (dict(return_tensors=True), dict(return_type=ReturnType.TENSORS),
                    dict(return_tensors=True, pad_token_id=5)):
        assert ours(prompts, batch_size=2, **options, **GREEDY) == stock(prompts, batch_size=2, **options, **GREEDY)
    assert not continuous
    assert ours(prompts, batch_size=2, pad_token_id=2, **GREEDY) == stock(prompts, batch_size=2, pad_token_id=2,
                                                                           **GREEDY)
    assert len(continuous) == 1  # a special pad token is skipped in the text: nothing to reproduce


def test_a_generator_of_messages_is_one_chat(target):
    """As the stock pipeline reads it: message dicts, from a generator, a tuple or a KeyDataset, are one chat."""
    from transformers.pipelines.pt_utils import KeyDataset

    tokenizer = make_tokenizer()
    stock = pipeline("text-generation", model=target, tokenizer=tokenizer)
    ours = pipeline("speculative-text-generation", model=target, tokenizer=tokenizer, assistant="ngram")
    chat = [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": "w7 w8"}]
    for inputs in (lambda: (m for m in chat), lambda: tuple(chat),
                   lambda: KeyDataset([{"message": m} for m in chat], "message")):
        assert ours(inputs(), batch_size=2, **GREEDY) == stock(inputs(), batch_size=2, **GREEDY)
    many = ours((p for p in PROMPTS), batch_size=2, **GREEDY)  # a generator of prompts is still many prompts
    assert list(many) == list(stock((p for p in PROMPTS), batch_size=2, **GREEDY))
    assert ours((p for p in ()), batch_size=2, **GREEDY) == stock((p for p in ()), batch_size=2, **GREEDY) == []


@pytest.mark.parametrize("k", [0, -1, 1000, "3", 2.5, True])
def test_num_speculative_tokens_is_checked_with_batch_size(target, k):
    tokenizer = make_tokenizer()
    ours = pipeline("speculative-text-generation", model=target, tokenizer=tokenizer, assistant="ngram")
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int from 1 to 64"):
        ours(PROMPTS, batch_size=2, num_speculative_tokens=k, **GREEDY)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int from 1 to 64"):
        pipeline("speculative-text-generation", model=target, tokenizer=tokenizer, assistant="ngram",
                 num_speculative_tokens=k)
