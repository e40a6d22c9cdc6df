"""OpenAI's `logprobs` objects: each token's text, bytes, log probability and alternatives, laid out as the
completions and the chat API lay them out, and the seam between an echoed prompt and its answer."""

from __future__ import annotations

import codecs

from ..tokenizers import token_bytes


class TokenLogprobs:
    """OpenAI's `logprobs` object for a choice's tokens, built as they arrive (`format` for each delta in turn).

    A token's text is what it adds to the answer's text, so the tokens' texts join into it (streamed or not): special
    tokens add nothing, and a character whose bytes span several tokens shows in the token that completes it. For
    tokenizers whose tokens are bytes (`tokenizers.token_bytes`) the texts come from the tokens' bytes through one
    incremental UTF-8 decoder, and chat's `bytes` are each token's own, joining into the answer's UTF-8; for others,
    each token is decoded with the few before it (a tokenizer that drops a word's leading space when a token is
    decoded alone still shows it). An alternative's text is what it would have added in the token's place. The
    completions API's form lists `tokens`, `token_logprobs`, `top_logprobs` (per token, the alternatives and the token
    itself, text -> log probability) and `text_offset` (characters from the start of the choice's text); the chat
    API's lists `content`, one object per token with its `token`, `logprob`, `bytes` and `top_logprobs`."""

    CONTEXT = 4  # tokens decoded before each one, without a byte spelling

    def __init__(self, tokenizer, chat: bool, offset: int = 0, after: list[int] | None = None):
        """`offset`: characters of the choice's text before the first token's; `after`: the token ids of an echoed
        prompt the tokens follow, whose text theirs continues (a leading space is theirs, not dropped)."""
        self.tokenizer, self.chat = tokenizer, chat
        self.spelling = token_bytes(tokenizer) if tokenizer is not None else None
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        # Leading spaces still to drop (as the decoder drops them at the start of a text).
        self.strip = self.spelling.strip_start if self.spelling is not None and after is None else 0
        self.history: list[int] = list(after[len(after) - self.CONTEXT:]) if after else []
        self.offset = offset

    def _decoded(self, ids: list[int]) -> str:
        # Without the replacement marks of a character not complete yet: its token adds nothing until it is.
        return self.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd") if ids else ""

    def _spelled(self, token: int, commit: bool) -> tuple[str, bytes]:
        """The text and bytes `token` adds after the tokens so far (`commit`: it is the next token; else an
        alternative, and the decoder is left as it was)."""
        data = self.spelling.spell(token)
        state = self.utf8.getstate()
        text = self.utf8.decode(data)
        strip = self.strip
        if text and strip:  # the decoder drops leading spaces at the start of a text: so does the answer
            kept = text.lstrip(" ")
            dropped = min(strip, len(text) - len(kept))
            text, data = text[dropped:], data[dropped:] if data[:dropped] == b" " * dropped else data
            strip = 0
        if commit:
            self.strip = strip
        else:
            self.utf8.setstate(state)
        return text, data

    def _entry(self, context: list[int], before: str, token: int, commit: bool) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            return f"token_id:{token}", []
        if self.spelling is not None:
            text, data = self._spelled(token, commit)
            return text, list(data)
        text = self._decoded(context + [token])[len(before):]
        return text, list(text.encode("utf-8"))

    def prompt(self, request) -> dict:
        """The completions API's form for a request's prompt tokens (`echo`), to come before its answer's: the
        first token has no log probability (nothing comes before it), the others theirs given the tokens before
        them (`Request.prompt_token_logprobs`) when they were asked for, else none either."""
        entries = [None] + list(request.prompt_token_logprobs)
        return self.format(request.prompt_ids, entries + [None] * (len(request.prompt_ids) - len(entries)))

    def format(self, token_ids: list[int], entries: list) -> dict:
        """`entries`: one `(log probability, alternatives)` per token, or `None` for a token without (the first of
        an echoed prompt), whose log probability and alternatives are then `null`."""
        chosen, tops = [], []
        for token, entry in zip(token_ids, entries):
            alternatives = entry[1] if entry is not None else []
            context, before = [], ""
            if self.spelling is None and self.tokenizer is not None and self.history:
                context = self.history[len(self.history) - self.CONTEXT:]
                before = self._decoded(context)
            tops.append([(*self._entry(context, before, t, False), value) for t, value in alternatives])
            chosen.append(self._entry(context, before, token, True))
            self.history.append(token)
        if self.chat:
            return {"refusal": None, "content": [
                {"token": text, "logprob": value, "bytes": data,
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": b} for t, b, v in top]}
                for (text, data), (value, _), top in zip(chosen, entries, tops)]}
        offsets = []
        for text, _ in chosen:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": [text for text, _ in chosen],
                "token_logprobs": [entry[0] if entry is not None else None for entry in entries[:len(chosen)]],
                "top_logprobs": [{_key(t, b): v for t, b, v in top} | {text: entry[0]} if entry is not None else None
                                 for (text, _), entry, top in zip(chosen, entries, tops)],
                "text_offset": offsets}


def echo_gap(tokenizer, request, text: str) -> str:
    """The whitespace between an echoed prompt and its answer: what the answer's first tokens add after the prompt's
    last, that they do not show alone (a SentencePiece tokenizer drops a text's leading space: "... is" + "Paris"
    where the model wrote "... is Paris"); empty for byte-level tokenizers, which drop nothing."""
    if tokenizer is None or not text or not request.output_ids or not request.prompt_ids:
        return ""
    head, first = request.prompt_ids[-TokenLogprobs.CONTEXT:], request.output_ids[:TokenLogprobs.CONTEXT]
    before = tokenizer.decode(head, skip_special_tokens=True)
    joined = tokenizer.decode(head + first, skip_special_tokens=True)
    alone = tokenizer.decode(first, skip_special_tokens=True)
    if not joined.startswith(before) or not joined.endswith(alone):
        return ""
    gap = joined[len(before):len(joined) - len(alone)]
    return gap if gap.isspace() else ""


def join_logprobs(first: dict, then: dict) -> dict:
    """Two pieces of the completions API's `logprobs` one after the other (an echoed prompt's, then the answer's)."""
    return {key: first[key] + then[key] for key in first}


def _key(text: str, data: list[int]) -> str:
    """An alternative's name in the completions API's `top_logprobs`: its text, or, for one that adds no text yet
    (part of a character), its bytes as OpenAI writes them (`bytes:\\xe2\\x80`), so such alternatives stay apart."""
    return text if text or not data else "bytes:" + "".join(f"\\x{b:02x}" for b in data)
