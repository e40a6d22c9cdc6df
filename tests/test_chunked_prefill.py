"""Chunked prefill: a prompt longer than `prefill_chunk_tokens` is fed a piece a step while the others keep running.

Each request still equals its solo run (plain greedy `generate`); no forward feeds a row more than a piece (plus a
step's drafts); running requests get tokens while a long prompt is read; a speculator that reads the target's states
gets those of every prompt position, the same as from a prompt fed whole; the prefix cache stores the pieces.
"""

from __future__ import annotations

import pytest
import torch

from hf_specdec.serving import ServingEngine

from test_serving import no_blocks_held, repeating, served_model, solo

CHUNK = 8


@pytest.fixture(scope="module")
def tokenizer():
    from test_serving import word_tokenizer

    return word_tokenizer()


def recording_forwards(engine) -> list[list[int]]:
    """Records every target forward's tokens per row."""
    fed = []
    forward = engine.target.forward

    def recording(seq_ids, input_ids, num_tokens, *args, **kwargs):
        fed.append(list(num_tokens))
        return forward(seq_ids, input_ids, num_tokens, *args, **kwargs)

    engine.target.forward = recording
    return fed


def speculator_for(name, model, tmp_path):
    if name == "draft":
        return served_model(seed=3)
    if name == "eagle":
        from hf_specdec import EagleSpeculator
        from test_eagle import convert

        return EagleSpeculator.from_pretrained(convert(tmp_path, model, 3, aux_layers=[0, 1, 1]))
    return "ngram"


@pytest.mark.parametrize("prefix_cache", [None, 0])
@pytest.mark.parametrize("speculator", ["ngram", "draft", "eagle", "none"])
def test_long_prompts_are_fed_in_pieces_and_every_request_equals_its_solo_run(tokenizer, tmp_path, speculator,
                                                                              prefix_cache):
    model = served_model()
    k = 0 if speculator == "none" else 3
    engine = ServingEngine(model, tokenizer, speculator_for(speculator, model, tmp_path), num_speculative_tokens=k,
                           max_batch_size=3, schedule="constant", block_size=4, prefix_cache_tokens=prefix_cache,
                           prefill_chunk_tokens=CHUNK)
    fed = recording_forwards(engine)
    engine.start()
    try:
        plan = [(repeating(5, seed=1), 30), (repeating(45, seed=2), 12), (repeating(6, seed=3), 20),
                (repeating(37, seed=4), 9), (repeating(45, seed=2) + repeating(4, seed=5), 10)]
        streams = [engine.submit(*plan[0])]
        next(iter(streams[0]))  # running: the long prompts arrive while it is
        streams += [engine.submit(p, n) for p, n in plan[1:]]
        for (p, n), stream in zip(plan, streams):
            for _ in stream:
                pass
            assert stream.request.output_ids == solo(model, p, n), (p, n)
        assert engine.scheduler.num_prefill_chunks >= 3
        assert max(max(f) for f in fed) <= CHUNK + k  # a piece, or the rest of a prompt with its drafts
        if speculator != "none":
            assert engine.metrics.num_draft_tokens > 0
        if engine.prefix_cache is not None:  # the last request begins with the second's 45 tokens: 11 whole blocks
            assert engine.prefix_cache.num_hit_tokens >= 40
        assert no_blocks_held(engine)
    finally:
        engine.shutdown()


def test_running_requests_stream_while_a_long_prompt_is_read(tokenizer):
    """Without drafts every step gives a running request one token: while a 64-token prompt is read in pieces of 8
    it gets one per piece, where a whole prompt would have had it wait for the prefill."""
    for chunk in (CHUNK, 0):
        model = served_model()
        engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=0, max_batch_size=2,
                               prefill_chunk_tokens=chunk).start()
        try:
            short = engine.submit(repeating(5, seed=1), 40)
            tokens = iter(short)
            next(tokens)
            long = engine.submit(repeating(64, seed=2), 4)
            first = next(iter(long))  # the long request's first token; how many has the short one got meanwhile?
            got_meanwhile = len(short.request.output_ids) - 1
            assert first.token_ids
            for _ in tokens:
                pass
            for _ in long:
                pass
            assert long.request.output_ids == solo(model, repeating(64, seed=2), 4)
            assert short.request.output_ids == solo(model, repeating(5, seed=1), 40)
        finally:
            engine.shutdown()
        if chunk:
            assert got_meanwhile >= 64 // CHUNK - 1
        else:
            assert got_meanwhile <= 2


def test_a_speculator_gets_the_states_of_every_prompt_position(tokenizer, tmp_path):
    """The target's states an EAGLE head receives for a long prompt fed in pieces equal those of the prompt fed
    whole, position by position."""
    from hf_specdec import EagleSpeculator
    from test_eagle import convert

    seen = []
    for chunk in (CHUNK, 0):
        model = served_model()
        head = EagleSpeculator.from_pretrained(convert(tmp_path / str(chunk), model, 3, aux_layers=[0, 1, 1]))
        states = {}
        observe = head.observe_hidden_states

        def recording(hidden, observe=observe, states=states):
            for i, row in enumerate(hidden.rows):
                for j, state in enumerate(hidden.row(i)):
                    states.setdefault((row, hidden.start_positions[i] + j), state.clone())
            return observe(hidden)

        head.observe_hidden_states = recording
        engine = ServingEngine(model, tokenizer, head, num_speculative_tokens=3, max_batch_size=1,
                               schedule="constant", prefill_chunk_tokens=chunk)
        prompt = repeating(50, seed=7)
        stream = engine.submit(prompt, 6)
        engine.start()
        try:
            for _ in stream:
                pass
            assert stream.request.output_ids == solo(model, prompt, 6)
        finally:
            engine.shutdown()
        assert all((0, p) in states for p in range(len(prompt)))
        seen.append(torch.stack([states[(0, p)] for p in range(len(prompt))]))
        if chunk:
            assert engine.scheduler.num_prefill_chunks == -(-len(prompt) // CHUNK) - 1
    torch.testing.assert_close(seen[0], seen[1], rtol=1e-4, atol=1e-5)


def test_prefill_chunk_is_checked(tokenizer):
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        ServingEngine(served_model(), tokenizer, "ngram", prefill_chunk_tokens=-1)
