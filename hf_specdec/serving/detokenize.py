"""A request's answer text as its tokens arrive, without decoding the whole answer at every step.

`tokenizer.decode(ids)` over a whole answer costs time linear in its length, and a server decoded every running
request's answer at every step: quadratic per request, and on a GPU, where a step of a small model takes tens of
milliseconds, a share of every step that grows with the answers. `AnswerText` decodes only the last few tokens: the
text up to an anchor token is kept, and each step decodes a short window from a few tokens before the anchor to the
end. The window's own text up to the anchor is known from the step before, so what follows it is the new text.

That is exact wherever a decoder's output for the tokens after the anchor depends only on the tokens just before them
(the window holds `CONTEXT` to `REBASE` of them): byte-level BPE, SentencePiece with byte fallback, decoders that
strip a leading space (both window decodes start at the same token, so they strip alike); `decodes_locally` says
which tokenizers qualify. The window only starts where its text alone is how the answer ends (not inside a character,
nor inside a run of byte tokens, which byte fallback decodes as one). Where the decoder rewrites text before the
anchor (byte fallback turns a run's characters into replacement marks while its last character is incomplete), the
window's text no longer begins with what it was, and that step decodes the whole answer instead. The engine also
compares each finished answer with one whole decode: a decoder that broke the assumption some other way is caught
there, its final text is the whole decode, and from then on the engine decodes whole answers (text already streamed
cannot be taken back, so the gate, `decodes_locally`, is strict).
"""

from __future__ import annotations

from ..tokenizers import _decoder_parts, backend_decoder

# Decoder parts whose text for a token depends only on the tokens just before it (a window of them reproduces it).
LOCAL_DECODERS = {"Sequence", "ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"}


def decodes_locally(tokenizer) -> bool:
    """Whether `AnswerText` may decode `tokenizer`'s answers a few tokens at a time: a fast tokenizer decoding the
    stock way (no `decode` of its own, as CodeGen's), whose backend decoder is built of `LOCAL_DECODERS` (or has none:
    tokens joined by spaces), without transformers' `clean_up_tokenization_spaces` where it applies (it rewrites " ."
    before a window's start, which the window cannot see; transformers 5 skips it for BPE models). Others' answers are
    decoded whole."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    kind = type(tokenizer)
    if getattr(kind, "_decode", None) is not PreTrainedTokenizerFast._decode or getattr(
            kind, "decode", None) is not PreTrainedTokenizerBase.decode:
        return False
    decoder = backend_decoder(tokenizer)
    if decoder is None:  # a slow tokenizer, or a custom Python decoder: decode whole
        return False
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        skipped_for_bpe = hasattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
        if not (skipped_for_bpe and type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
                and not tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output):
            return False
    return all(part.get("type") in LOCAL_DECODERS for part in _decoder_parts(decoder)) if decoder else True


class AnswerText:
    """The text of `ids` (as `tokenizer.decode(ids, skip_special_tokens=True)`), updated as `ids` grows.

    Call `update(ids)` after each step with the whole list of the answer's tokens so far (the same list, grown, or a
    shorter one after tokens were taken back: then the next update decodes it whole)."""

    CONTEXT = 4  # tokens before the anchor the window starts at, after a rebase
    REBASE = 24  # the window is moved up once it holds this many tokens

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.start = 0  # the window's first token
        self.anchor = 0  # tokens whose text `stable` is
        self.stable = ""  # the text of ids[:anchor]
        self.window = ""  # the text of ids[start:anchor], decoded on its own
        self.text = ""
        self.whole_decodes = 0  # steps that decoded the whole answer (the window's text changed before the anchor)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int]) -> str:
        n = len(ids)
        if n < self.anchor:  # tokens were taken back
            self.start = self.anchor = 0
            self.stable = self.window = ""
        tail = self._decode(ids[self.start:])
        if self.start == 0:
            text = tail
        elif self.window and tail.startswith(self.window):
            text = self.stable + tail[len(self.window):]
        else:
            text = self._decode(ids)
            self.whole_decodes += 1
            self.start = 0
            tail = text
        if not text.endswith("\ufffd"):  # a character still missing bytes may decode differently once they come
            self.anchor, self.stable, self.window = n, text, tail
            if n - self.start >= self.REBASE:
                start = n - self.CONTEXT
                window = self._decode(ids[start:])
                # Only where the window's text alone is how the answer ends: not a window of special tokens alone
                # (no text to find the next one's start by), nor one starting inside a character or a run of byte
                # tokens that its decoder reads as one.
                if window and text.endswith(window):
                    self.start, self.window = start, window
        self.text = text
        return text

    def finish(self, ids: list[int]) -> bool:
        """Whether the text so far equals the whole answer decoded at once (it is made so if not)."""
        whole = self._decode(ids)
        exact = whole == self.text
        self.text = whole
        return exact
