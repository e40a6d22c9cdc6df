"""Offline batch work on the continuous-batching engine: many prompts in, `max_batch_size` of them in flight at a time,
each slot refilled the moment its request finishes (as transformers' `generate_batch`, with speculation)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator

from ..decode.requests import SamplingParams
from .engine import ServingEngine
from .stream import RequestStream


def generate_stream(engine: ServingEngine, prompts: Iterable[list[int]], max_new_tokens: int,
                    sampling: Callable[[int], SamplingParams | None] | SamplingParams | None = None,
                    grammar=None) -> Iterator[RequestStream]:
    """Runs `prompts` (token id lists, consumed lazily) through a started `engine`, keeping its batch full and as many
    again queued, and yields each finished `RequestStream` in input order. `sampling`: one setting for all, or a
    function of the prompt's index."""
    pending: deque = deque()
    source = enumerate(prompts)
    exhausted = False
    while True:
        while not exhausted and len(pending) < 2 * engine.max_batch_size:
            item = next(source, None)
            if item is None:
                exhausted = True
                break
            index, prompt = item
            params = sampling(index) if callable(sampling) else sampling
            pending.append(engine.submit(list(prompt), max_new_tokens, params, grammar=grammar))
        if not pending:
            return
        stream = pending.popleft()
        for _ in stream:
            pass
        yield stream


def generate_batch(model, inputs: Iterable[list[int]], speculator="ngram", max_new_tokens: int = 256,
                   max_batch_size: int = 8, num_speculative_tokens: int | None = None, do_sample: bool = False,
                   temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                   tokenizer=None, grammar=None) -> list[list[int]]:
    """Generates for every prompt of `inputs` (token id lists) with speculative decoding and continuous batching;
    returns the generated token ids of each, in order. Greedy by default, equal to `generate(do_sample=False)` on
    each prompt; with `do_sample`, `temperature`/`top_p`/`top_k` apply to every request and `seed` makes the run
    reproducible (prompt i verifies with its own stream, seeded `seed + i`; with a speculator that samples its drafts
    or under adaptive k, the same inputs in the same order and batch size repeat, see docs/serving.md).

    `grammar` (an `hf_specdec.Grammar`, with `tokenizer`) constrains every output.
    """
    def sampling(index: int) -> SamplingParams | None:
        if not do_sample:
            return None
        return SamplingParams(temperature, top_p, top_k, None if seed is None else seed + index)

    engine = ServingEngine(model, tokenizer, speculator, num_speculative_tokens=num_speculative_tokens,
                           max_batch_size=max_batch_size, max_queue=2 * max_batch_size,
                           warmup=False).start()  # one batch job: no client waits on its first request
    try:
        return [list(s.request.output_ids) for s in generate_stream(engine, inputs, max_new_tokens, sampling, grammar)]
    finally:
        engine.shutdown()
