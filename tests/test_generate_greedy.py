"""Greedy speculative generate is token-for-token identical to plain greedy generate, whatever the draft."""

import pytest
import torch

import hf_specdec
from conftest import ARCHITECTURES, make_model, ragged_batch, repetitive_prompt

MAX_NEW = 24


def speculators(arch):
    """The speculators each test runs: n-gram, a random (unrelated) draft, and an identical draft."""
    return {
        "ngram": lambda target: "ngram",
        "random_draft": lambda target: make_model(arch, seed=1),
        "same_draft": lambda target: make_model(arch, seed=0),
    }


def run(target, speculator, input_ids, attention_mask=None, **kwargs):
    out = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=MAX_NEW, do_sample=False,
                          speculator=speculator, return_dict_in_generate=True, **kwargs)
    return out.sequences, out.speculative_metrics


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("kind", ["ngram", "random_draft", "same_draft"])
def test_batch_one_equals_generate(arch, kind):
    target = make_model(arch)
    input_ids = repetitive_prompt(width=16)
    expected = target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False)
    # A constant k, so every step drafts: adaptive k may rightly stop drafting with a draft as big as the target.
    sequences, metrics = run(target, speculators(arch)[kind](target), input_ids, speculative_schedule="constant")
    assert torch.equal(sequences, expected)
    assert metrics.num_draft_tokens > 0, "no drafts were proposed: the test would not exercise verification"
    if kind == "same_draft":
        assert metrics.acceptance_rate == 1.0
        assert metrics.num_steps <= MAX_NEW // 4  # far fewer target forwards than tokens


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("kind,schedule", [("ngram", "constant"), ("ngram", "adaptive"), ("random_draft", "constant"),
                                           ("same_draft", "constant")])
def test_ragged_batch_equals_generate(arch, kind, schedule):
    target = make_model(arch)
    input_ids, mask = ragged_batch(rows=4, width=14)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    sequences, metrics = run(target, speculators(arch)[kind](target), input_ids, mask, speculative_schedule=schedule)
    assert torch.equal(sequences, expected)
    assert metrics.num_draft_tokens > 0


def test_rows_equal_their_solo_runs_with_early_eos():
    """Each row of a batch gives what that prompt gives alone, even when other rows stop early."""
    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=3, width=12, seed=3)
    free_run = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    eos = int(free_run[1, 12 + 3])  # row 1 emits this token 4th, so it stops early
    batched, _ = run(target, "ngram", input_ids, mask, eos_token_id=eos)
    for row in range(3):
        real = input_ids[row, mask[row].bool()][None]
        solo, _ = run(target, "ngram", real, eos_token_id=eos)
        generated = batched[row, 12:]
        assert torch.equal(generated[: solo.shape[1] - real.shape[1]], solo[0, real.shape[1]:])


@pytest.mark.parametrize("kwargs", [
    {"repetition_penalty": 1.5},
    {"no_repeat_ngram_size": 2},
    {"min_new_tokens": 10, "eos_token_id": 5},
    {"eos_token_id": [5, 7, 9]},
    {"encoder_repetition_penalty": 1.5},
    {"encoder_no_repeat_ngram_size": 2},
], ids=["repetition_penalty", "no_repeat_ngram", "min_new_tokens", "eos_list", "encoder_repetition_penalty",
        "encoder_no_repeat_ngram"])
@pytest.mark.parametrize("kind", ["ngram", "random_draft"])
def test_logits_processors_and_eos_match_generate(kwargs, kind):
    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=3, width=12, seed=5)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, **kwargs)
    speculator = "ngram" if kind == "ngram" else make_model("llama", seed=1)
    # A constant k: drafts every step, so the processors see rows grouped by how many drafts each accepted.
    sequences, metrics = run(target, speculator, input_ids, mask, num_speculative_tokens=3,
                             speculative_schedule="constant", **kwargs)
    assert torch.equal(sequences, expected)


def test_eos_found_inside_accepted_drafts_stops_there():
    target = make_model("llama")
    input_ids = repetitive_prompt(width=16, seed=2)
    free_run = target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False)
    eos = int(free_run[0, 16 + 6])
    expected = target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos)
    sequences, _ = run(target, make_model("llama", seed=0), input_ids, eos_token_id=eos,  # identical draft
                       speculative_schedule="constant")
    assert torch.equal(sequences, expected)
    assert sequences.shape[1] <= 16 + 7


class StopOnToken:
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_match_generate():
    from transformers import StoppingCriteriaList

    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=3, width=12, seed=7)
    free_run = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
    token = int(free_run[0, 12 + 5])
    criteria = StoppingCriteriaList([StopOnToken(token)])
    # With an EOS id configured transformers pads rows a criterion ended (without one it keeps extending them; we
    # pad them either way, see docs/design.md). Token 1 is never generated here, so it only switches padding on.
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False,
                               stopping_criteria=criteria, eos_token_id=1)
    sequences, _ = run(target, "ngram", input_ids, mask, stopping_criteria=criteria, eos_token_id=1)
    assert (sequences[0, 12 + 6:] == 0).all()  # row 0 really stopped
    assert torch.equal(sequences, expected)


class StopAfterPerRow:
    """Row i stops once it has `limits[i]` new tokens: a criterion that indexes rows, as a per-request budget does."""

    def __init__(self, width, limits):
        self.width, self.limits = width, limits

    def __call__(self, input_ids, scores, **kwargs):
        new = input_ids.shape[1] - self.width
        return torch.tensor([new >= self.limits[i] for i in range(input_ids.shape[0])])


class FavourPerRow:
    """Row i's favourite token gets a bonus on some lengths: a processor that indexes rows."""

    def __init__(self, favourites):
        self.favourites = favourites

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for i in range(input_ids.shape[0]):
            scores[i, self.favourites[i]] += 4.0 * (input_ids.shape[1] % 3 == 0)
        return scores


class StopOnTokenInRowZero:
    """The common tutorial form: one Python bool for the whole batch."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return bool(input_ids[0, -1] == self.token)


@pytest.mark.parametrize("kind", ["ngram", "same_draft"])
def test_row_indexed_processors_and_criteria_see_their_rows(kind):
    """Rows advance unevenly under speculation and finished rows leave the batch; a processor or criterion of the
    user's own still gets the whole batch with each row at its index, so per-row logic acts on the right row."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=3, width=12, seed=7)
    kwargs = dict(logits_processor=LogitsProcessorList([FavourPerRow([5, 6, 7])]),
                  stopping_criteria=StoppingCriteriaList([StopAfterPerRow(12, [3, 9, 17])]), eos_token_id=1)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, **kwargs)
    sequences, metrics = run(target, speculators("llama")[kind](target), input_ids, mask,
                             speculative_schedule="constant", **kwargs)
    assert torch.equal(sequences, expected)
    assert metrics.num_accepted_tokens > 0
    # the budgets took effect: rows stopped after 3, 9 and 17 new tokens (then padding)
    assert [int((row[12:] != 0).sum()) for row in expected] == [3, 9, 17]


def test_stopping_criterion_answering_one_bool():
    from transformers import StoppingCriteriaList

    target = make_model("llama")
    input_ids = repetitive_prompt(width=16, seed=2)
    free_run = target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False)
    criteria = StoppingCriteriaList([StopOnTokenInRowZero(int(free_run[0, 16 + 6]))])
    expected = target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False, stopping_criteria=criteria)
    sequences, _ = run(target, make_model("llama", seed=0), input_ids, stopping_criteria=criteria,
                       speculative_schedule="constant")
    assert torch.equal(sequences, expected) and sequences.shape[1] <= 16 + 7


def test_stop_strings_from_a_generation_config():
    """stop_strings set in a GenerationConfig (the call's, or the model's own) work as the keyword does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    from conftest import VOCAB

    # one byte-level character per id (stop-string matching needs a byte-level tokenizer)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet())[:VOCAB - len(vocab)]:
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>")
    target = make_model("llama")
    input_ids = repetitive_prompt(width=16, seed=2)
    free_run = target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False)
    stop = tokenizer.decode(free_run[0, 16 + 5:16 + 7])
    config = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, stop_strings=[stop], eos_token_id=1,
                              pad_token_id=0)
    expected = target.generate(input_ids, generation_config=config, tokenizer=tokenizer)
    out = target.generate(input_ids, generation_config=config, tokenizer=tokenizer, speculator="ngram")
    assert torch.equal(out, expected) and out.shape[1] < 16 + MAX_NEW
    assert config.stop_strings == [stop]  # the caller's config is left as it was
    # The model's own generation config, alone or under a config of the caller's that sets other things.
    target.generation_config.stop_strings = [stop]
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = 1, 0
    other = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False)
    for call in (dict(max_new_tokens=MAX_NEW, do_sample=False), dict(generation_config=other)):
        out = target.generate(input_ids, tokenizer=tokenizer, speculator="ngram", **call)
        assert torch.equal(out, expected), call
    assert target.generation_config.stop_strings == [stop] and other.stop_strings is None
    # An explicit empty list in the caller's config turns the model's off, as in plain generate.
    target.generation_config.stop_strings = None
    unstopped = target.generate(input_ids, max_new_tokens=MAX_NEW, do_sample=False)
    target.generation_config.stop_strings = [stop]
    off = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, stop_strings=[])
    out = target.generate(input_ids, tokenizer=tokenizer, speculator="ngram", generation_config=off)
    assert torch.equal(out, unstopped) and out.shape[1] > expected.shape[1]


@pytest.mark.parametrize("options,named", [(dict(penalty_alpha=0.6, top_k=4), "penalty_alpha"),
                                           (dict(dola_layers="high"), "dola_layers"),
                                           (dict(force_words_ids=[[9]]), "force_words_ids"),
                                           (dict(use_mtp=True), "use_mtp")])
def test_other_decoding_modes_are_refused(options, named):
    target = make_model("llama")
    with pytest.raises(ValueError, match=f"greedy search or sampling.*{named}"):
        target.generate(repetitive_prompt(width=16), max_new_tokens=4, speculator="ngram", **options)


@pytest.mark.parametrize("implementation", ["paged", "static", "offloaded"])
def test_a_cache_implementation_on_the_call_is_refused(implementation):
    """`cache_implementation="paged"` would have transformers run its continuous batching with the speculator
    dropped; the others would go unused beside the paged cache."""
    target = make_model("llama")
    with pytest.raises(ValueError, match=f"cache_implementation={implementation!r}"):
        target.generate(repetitive_prompt(width=16), max_new_tokens=4, speculator="ngram",
                        cache_implementation=implementation)


def test_criteria_without_an_eos_at_batch_size_above_one_are_refused():
    """Without an EOS, plain generate extends a row its criterion stopped until every row stops; refused rather than
    answered differently. One row, or an EOS id, runs (and matches: the other criteria tests)."""
    from transformers import StoppingCriteriaList

    target = make_model("llama")
    assert target.generation_config.eos_token_id is None
    input_ids, mask = ragged_batch(rows=3, width=12, seed=7)
    criteria = StoppingCriteriaList([StopOnToken(5)])
    with pytest.raises(ValueError, match="need an eos_token_id"):
        run(target, "ngram", input_ids, mask, stopping_criteria=criteria)
    solo = input_ids[2:]
    expected = target.generate(solo, max_new_tokens=MAX_NEW, do_sample=False, stopping_criteria=criteria)
    assert torch.equal(run(target, "ngram", solo, stopping_criteria=criteria)[0], expected)


def test_int32_input_ids():
    target = make_model("llama")
    input_ids = repetitive_prompt(width=16)
    expected = target.generate(input_ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(target.generate(input_ids.int(), max_new_tokens=8, do_sample=False, speculator="ngram"),
                       expected)


def test_streamer_receives_accepted_tokens():
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    target = make_model("llama")
    input_ids = repetitive_prompt(width=16)
    streamer = Collect()
    sequences, metrics = run(target, make_model("llama", seed=0), input_ids, streamer=streamer,
                             speculative_schedule="constant")
    assert streamer.ended and streamer.chunks[0] == input_ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == sequences[0, 16:].tolist()
    assert any(len(c) > 1 for c in streamer.chunks[1:])  # several tokens per step arrive together


def test_num_speculative_tokens_takes_effect():
    target = make_model("llama")
    input_ids = repetitive_prompt(width=16)
    for k in (1, 3, 7):
        _, metrics = run(target, make_model("llama", seed=0), input_ids, num_speculative_tokens=k,
                         speculative_schedule="constant")
        assert metrics.num_draft_tokens <= k * metrics.num_drafts
        assert max(metrics.num_draft_tokens // max(metrics.num_drafts, 1), 1) == k


def test_right_padding_continues_each_prompt():
    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=3, width=12, seed=9, side="right")
    sequences, _ = run(target, "ngram", input_ids, mask)
    for row in range(3):
        real = input_ids[row, mask[row].bool()][None]
        expected = target.generate(real, max_new_tokens=MAX_NEW, do_sample=False)
        assert torch.equal(sequences[row, 12:], expected[0, real.shape[1]:])


def test_every_kv_block_returns_to_the_pool(monkeypatch):
    from hf_specdec.runners import model_runner

    runners = []
    original = model_runner.ModelRunner.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        runners.append(self)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", spy)
    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=4, width=14)
    run(target, make_model("llama", seed=1), input_ids, mask)
    # target and draft, and the six runners of each model's trial (runners/support.py: ragged batch, then padded vs packed,
    # then one context group vs two)
    assert len(runners) == 2 + 2 * 6
    for runner in runners:
        manager = runner.cache.manager
        assert manager.sequences() == []
        # every block is free again, but for the rows' regions (a one-call generate's layout), which stay with them
        assert manager.num_free_blocks == manager.num_blocks - manager.num_reserved - manager.num_region_blocks


def test_generation_config_argument_is_honoured():
    from transformers import GenerationConfig

    target = make_model("llama")
    input_ids = repetitive_prompt(width=16)
    config = GenerationConfig(max_new_tokens=9, do_sample=False, repetition_penalty=1.3, pad_token_id=0)
    expected = target.generate(input_ids, generation_config=config)
    sequences = target.generate(input_ids, generation_config=config, speculator="ngram")
    assert sequences.shape[1] == 16 + 9 and torch.equal(sequences, expected)


def test_num_return_sequences_with_sampling_gives_independent_rows():
    target = make_model("llama")
    input_ids = repetitive_prompt(rows=2, width=16)
    torch.manual_seed(0)
    out = target.generate(input_ids, max_new_tokens=12, do_sample=True, num_return_sequences=3, speculator="ngram")
    assert out.shape == (6, 28)
    assert torch.equal(out[:3, :16], input_ids[:1].expand(3, -1))
    assert len({tuple(r) for r in out[:3, 16:].tolist()}) > 1  # samples differ


def test_repetition_penalty_per_row_prompt_lengths_after_rows_finish():
    """transformers gives the repetition penalty each row's prompt padding as a per-row tensor; once a row stops
    early the engine's groups are a subset of the batch, and each must get its own rows' values."""
    model = ARCHITECTURES["llama"]().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    input_ids, mask = ragged_batch(rows=3, width=10, seed=4)
    plain = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                           repetition_penalty=1.8)
    for row in range(3):  # each row in turn stops early
        eos = int(plain[row, -8])
        kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, repetition_penalty=1.8, eos_token_id=eos)
        expected = model.generate(input_ids=input_ids, **kwargs)
        assert torch.equal(model.generate(input_ids=input_ids, speculator="ngram", **kwargs), expected)
