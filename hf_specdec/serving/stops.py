"""Stop strings in a streamed answer: where one ends the text (past the first `min_tokens` tokens' text), which of a
step's tokens came after it, and how much text to hold back while one may be starting."""

from __future__ import annotations

from ..decode.requests import Request
from .stream import RequestStream


def stop_floor(stream: RequestStream, request: Request, tokenizer) -> int | None:
    """Characters of the answer a stop string must end past: vLLM's `min_tokens` holds stop strings back too, so only
    one ending past the first `min_tokens` tokens' text counts; `None` while fewer tokens than that are out."""
    if not request.sampling.min_tokens:
        return 0
    if request.num_generated < request.sampling.min_tokens:
        return None
    if stream._stop_floor is None:
        stream._stop_floor = len(tokenizer.decode(request.output_ids[:request.sampling.min_tokens],
                                                  skip_special_tokens=True).rstrip("\ufffd"))
    return stream._stop_floor


def find_stop(text: str, stops: tuple[str, ...], sent: int, floor: int = 0) -> int | None:
    """Where the first stop string begins in `text`, searching from just before the `sent` characters already
    delivered; only a stop string ending past character `floor` counts."""
    if not stops:
        return None
    start = max(0, sent - max(len(s) for s in stops))
    hits = [i for i in (text.find(s, max(start, floor - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None


def drop_tokens_past(tokenizer, request: Request, new: int, text: str, hit: int, stops: tuple[str, ...]) -> int:
    """Drops from `request`'s output the tokens of the last `new` that come after the one completing the stop string
    found at character `hit` of `text` (they are not the answer's); returns how many."""
    end = hit + min(len(s) for s in stops if text.startswith(s, hit))
    excess = tokens_past(tokenizer, request.output_ids, new, hit, text[hit:end])
    if excess:
        del request.output_ids[len(request.output_ids) - excess:]
        if request.logprobs is not None:
            del request.output_logprobs[len(request.output_logprobs) - excess:]
        request.num_generated -= excess
    return excess


def tokens_past(tokenizer, output_ids: list[int], new: int, hit: int, stop: str) -> int:
    """How many of the last `new` tokens come after the one that completes the stop string `stop` (found at character
    `hit`): usage counts a request's tokens up to and including that one, whatever the step emitted after it. The
    prefix must spell the stop string itself (a character cut between tokens decodes to a replacement mark)."""
    for n in range(len(output_ids) - new + 1, len(output_ids)):
        if tokenizer.decode(output_ids[:n], skip_special_tokens=True)[hit:hit + len(stop)] == stop:
            return len(output_ids) - n
    return 0


def safe_length(text: str, stops: tuple[str, ...]) -> int:
    """How much of `text` can be delivered now: not an incomplete character, nor the start of a stop string."""
    end = len(text)
    while end > 0 and text[end - 1] == "\ufffd":  # bytes of a character not complete yet
        end -= 1
    for stop in stops:  # a suffix that could grow into a stop string waits for the next step
        for n in range(min(len(stop) - 1, end), 0, -1):
            if text[end - n: end] == stop[:n]:
                end -= n
                break
    return end
