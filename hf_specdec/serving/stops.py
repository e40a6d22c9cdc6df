"""Stop strings in a streamed answer: where one ends the text, which tokens came after it, and how much text to hold back while one may be starting."""

from __future__ import annotations


def _tokens_past(tokenizer, output_ids: list[int], new: int, hit: int, stop: str) -> int:
    """How many of the last `new` tokens come after the one that completes the stop string `stop` (found at character
    `hit`): usage counts a request's tokens up to and including that one, whatever the step emitted after it. The
    prefix must spell the stop string itself (a character cut between tokens decodes to a replacement mark)."""
    for n in range(len(output_ids) - new + 1, len(output_ids)):
        if tokenizer.decode(output_ids[:n], skip_special_tokens=True)[hit:hit + len(stop)] == stop:
            return len(output_ids) - n
    return 0


def _find_stop(text: str, stops: tuple[str, ...], sent: int, floor: int = 0) -> int | None:
    """Where the first stop string begins in `text`, searching from just before the `sent` characters already
    delivered; only a stop string ending past character `floor` counts."""
    if not stops:
        return None
    start = max(0, sent - max(len(s) for s in stops))
    hits = [i for i in (text.find(s, max(start, floor - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _safe_length(text: str, stops: tuple[str, ...]) -> int:
    end = len(text)
    while end > 0 and text[end - 1] == "\ufffd":  # bytes of a character not complete yet
        end -= 1
    for stop in stops:  # a suffix that could grow into a stop string waits for the next step
        for n in range(min(len(stop) - 1, end), 0, -1):
            if text[end - n: end] == stop[:n]:
                end -= n
                break
    return end
