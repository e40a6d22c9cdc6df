"""A served answer's text decoded a few tokens a step (`serving.detokenize.AnswerText`) equals the whole answer
decoded at once, at every step, for the decoders served models use; where it cannot, the engine notices and decodes
whole answers."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hf_specdec.decode.requests import SamplingParams
from hf_specdec.serving.detokenize import AnswerText, decodes_locally
from test_serving import EOS, byte_tokenizer, served_model


def cleanup_tokenizer():
    """Words joined by spaces, then transformers' `clean_up_tokenization_spaces` (" ." -> ".", " 's" -> "'s"): a
    decoder that rewrites text before the newest token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "</s>", "<unk>", "the", "cat", "is", ".", ",", "'s", "n't", "?", "!", "do", "'", "x"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=True)


TOKENIZERS = {"byte-level": lambda: byte_tokenizer(False), "byte-fallback": lambda: byte_tokenizer(True)}
_BUILT = {}


def tokenizer_named(name):
    if name not in _BUILT:
        _BUILT[name] = TOKENIZERS[name]()
    return _BUILT[name]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@given(data=st.data())
def test_text_a_few_tokens_a_step_equals_the_whole_decode(name, data):
    """Random answers (multi-byte characters split between tokens, special tokens, runs past the rebase), fed in
    random steps of 1 to 6 tokens: every step's text equals `decode` of all the tokens so far."""
    tokenizer = tokenizer_named(name)
    vocab = len(tokenizer)
    length = data.draw(st.integers(1, 3 * AnswerText.REBASE + 5), label="length")
    ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=length, max_size=length), label="ids")
    answer, grown = AnswerText(tokenizer), []
    while len(grown) < len(ids):
        grown += ids[len(grown):len(grown) + data.draw(st.integers(1, 6), label="step")]
        assert answer.update(grown) == tokenizer.decode(grown, skip_special_tokens=True)
    assert answer.finish(grown)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_real_text_decodes_a_few_tokens_a_step(name):
    """Text as a model writes it (words, punctuation, accents, emoji, CJK): exact at every step, with the window
    moved up many times. Byte-level BPE never needs a whole decode; byte fallback's decoder rewrites a whole run of
    byte tokens while its last character is incomplete ("\u4e2d" becomes "\ufffd" x 4 as the next character's first
    byte comes): those steps decode whole, and stay exact."""
    tokenizer = tokenizer_named(name)
    text = " ".join(["caf\u00e9 d\u00e9j\u00e0 vu \U0001f642\U0001f642 \u4e2d\u6587 abc"] * 8)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = ids[:20] + [tokenizer.eos_token_id] + ids[20:]  # a special token inside: it adds no text
    answer = AnswerText(tokenizer)
    for end in range(1, len(ids) + 1):
        assert answer.update(ids[:end]) == tokenizer.decode(ids[:end], skip_special_tokens=True)
    assert answer.start > 0 and answer.finish(ids)
    assert (answer.whole_decodes == 0) == (name == "byte-level")


def test_a_decoder_rewriting_earlier_text_decodes_whole_answers():
    """`clean_up_tokenization_spaces` joins " ' " across a window's start ("the ' the" is "the'the"), which a window
    cannot see: such tokenizers' answers are decoded whole, by the engine too."""
    from hf_specdec.serving.engine import ServingEngine

    tokenizer = cleanup_tokenizer()
    ids = tokenizer("the cat 's x the ' the", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "the cat's x the'the"
    assert not decodes_locally(tokenizer)
    assert decodes_locally(byte_tokenizer(False)) and decodes_locally(byte_tokenizer(True))
    engine = ServingEngine(served_model(), tokenizer, "ngram", num_speculative_tokens=2, warmup=False)
    assert not engine.incremental_text


def test_tokens_taken_back_decode_whole_again():
    tokenizer = tokenizer_named("byte-level")
    ids = tokenizer("abc def ghi " * 10, add_special_tokens=False)["input_ids"]
    answer = AnswerText(tokenizer)
    answer.update(ids)
    assert answer.update(ids[:7]) == tokenizer.decode(ids[:7])
    assert answer.update(ids) == tokenizer.decode(ids)


class _LoudWhenLong:
    """A decoder whose text depends on the whole answer (capitals from the 30th token on): no window reproduces it,
    yet each window's text begins as the one before did."""

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, ids, skip_special_tokens=False):
        text = self.inner.decode(ids, skip_special_tokens=skip_special_tokens)
        return text.upper() if len(ids) >= 30 else text


def test_tokenizers_decoding_their_own_way_are_decoded_whole():
    """The gate: a tokenizer with a `decode` of its own (a wrapper, a subclass as CodeGen's), or a custom Python
    decoder in its backend, is decoded whole (and the engine builds); transformers 5 skips the cleanup for BPE models,
    so those stay incremental with the flag set."""
    from tokenizers import decoders
    from transformers import PreTrainedTokenizerFast

    from hf_specdec.serving.engine import ServingEngine

    assert not decodes_locally(_LoudWhenLong(byte_tokenizer(False)))

    class OwnDecode(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    assert not decodes_locally(OwnDecode(tokenizer_object=byte_tokenizer(False).backend_tokenizer))

    class Same:
        def decode_chain(self, tokens):
            return tokens

    custom = byte_tokenizer(False)
    custom.backend_tokenizer.decoder = decoders.Decoder.custom(Same())
    assert not decodes_locally(custom)
    assert not ServingEngine(served_model(), custom, "ngram", num_speculative_tokens=2, warmup=False).incremental_text
    flagged = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(False).backend_tokenizer,
                                      clean_up_tokenization_spaces=True)
    ids = flagged("a . b 's", add_special_tokens=False)["input_ids"]
    if hasattr(flagged, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"):
        assert flagged.decode(ids) == "a . b 's" and decodes_locally(flagged)
    else:  # older transformers clean BPE answers up too
        assert not decodes_locally(flagged)


def test_an_engine_whose_tokenizer_is_not_local_decodes_whole_answers():
    """A decoder that passed the gate yet is not local (forced here: the gate refuses this one): the first answer that
    ends shows its text differs from the whole decode; the engine warns, gives the whole decode as the final text, and
    decodes whole answers from then on."""
    from hf_specdec.serving.engine import ServingEngine

    tokenizer = _LoudWhenLong(byte_tokenizer(False))
    model = served_model()
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=2, max_batch_size=2, warmup=False)
    engine.incremental_text = True
    engine.start()
    try:
        prompt = torch.randint(3, 60, (12,), generator=torch.Generator().manual_seed(0)).tolist()
        stream = engine.submit(prompt, max_tokens=40, sampling=SamplingParams(ignore_eos=True))
        deltas = list(stream)
        ids = [t for d in deltas for t in d.token_ids]
        assert stream.text == tokenizer.decode(ids, skip_special_tokens=True)
        assert not engine.incremental_text
        second = engine.submit(prompt, max_tokens=40, sampling=SamplingParams(ignore_eos=True))
        list(second)
        assert second.text == stream.text
    finally:
        engine.shutdown()


def test_served_answers_decoded_a_few_tokens_a_step_equal_whole_decodes():
    """Through the engine, a byte-level answer's streamed text joins into the whole decode, and stays incremental."""
    from hf_specdec.serving.engine import ServingEngine

    tokenizer = byte_tokenizer(False)
    model = served_model(eos=EOS)
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=2, max_batch_size=2, warmup=False).start()
    try:
        for seed in range(3):
            prompt = torch.randint(3, 60, (10,), generator=torch.Generator().manual_seed(seed)).tolist()
            stream = engine.submit(prompt, max_tokens=48, sampling=SamplingParams(ignore_eos=True))
            deltas = list(stream)
            ids = [t for d in deltas for t in d.token_ids]
            assert "".join(d.text for d in deltas) == stream.text == tokenizer.decode(ids, skip_special_tokens=True)
            assert stream._answer is not None and stream._answer.start > 0
        assert engine.incremental_text
    finally:
        engine.shutdown()
