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


def recording_steps(engine) -> list[tuple[set[str], dict[str, int]]]:
    """Records, per scheduler step, the ids of the requests running after it and the tokens each one got."""
    steps = []
    scheduler_step = engine.scheduler.step

    def recording():
        events = scheduler_step()
        steps.append(({r.request_id for r in engine.scheduler.running.values()},
                      {request.request_id: len(tokens) for request, tokens, _ in events}))
        return events

    engine.scheduler.step = recording
    return steps


def first_token_step(steps, request_id: str) -> int:
    return next(i for i, (_, got) in enumerate(steps) if got.get(request_id))


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
    """Without drafts every step gives a running request one token: between the step that admits a 64-token prompt
    and the one giving its first token, the running request gets one per piece of 8, where the whole prompt would
    have been fed in the admitting step."""
    for chunk in (CHUNK, 0):
        model = served_model()
        engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=0, max_batch_size=2, block_size=4,
                               prefill_chunk_tokens=chunk)
        steps = recording_steps(engine)
        engine.start()
        try:
            short = engine.submit(repeating(5, seed=1), 40)
            tokens = iter(short)
            next(tokens)
            long = engine.submit(repeating(64, seed=2), 4)
            for _ in long:
                pass
            for _ in tokens:
                pass
            assert long.request.output_ids == solo(model, repeating(64, seed=2), 4)
            assert short.request.output_ids == solo(model, repeating(5, seed=1), 40)
        finally:
            engine.shutdown()
        admitted = next(i for i, (running, _) in enumerate(steps) if long.request_id in running)
        first = first_token_step(steps, long.request_id)
        meanwhile = sum(got.get(short.request_id, 0) for _, got in steps[admitted:first])
        assert meanwhile == (64 // CHUNK - 1 if chunk else 0)


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
        engine = ServingEngine(model, tokenizer, head, num_speculative_tokens=3, max_batch_size=1, block_size=4,
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


def test_newcomers_share_the_budget_while_requests_run(tokenizer):
    """While a request runs, newcomers' prompts join only as far as a step's budget goes (the others wait, or get a
    piece of what is left); each still equals its solo run."""
    model = served_model()
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=3, max_batch_size=5, block_size=4,
                           schedule="constant", prefill_chunk_tokens=12)
    fed = recording_forwards(engine)
    engine.start()
    try:
        first = engine.submit(repeating(5, seed=1), 30)
        next(iter(first))
        fed.clear()
        plan = [(repeating(10, seed=2 + i), 8) for i in range(4)]  # each fits the budget, together they do not
        streams = [engine.submit(p, n) for p, n in plan]
        for (p, n), stream in zip(plan, streams):
            for _ in stream:
                pass
            assert stream.request.output_ids == solo(model, p, n)
        for _ in first:
            pass
        assert first.request.output_ids == solo(model, repeating(5, seed=1), 30)
    finally:
        engine.shutdown()
    # No forward fed more than the budget of prompt tokens beside the running rows' one token and drafts each.
    # Together the four would have fed 40.
    assert max(sum(f) for f in fed) <= 12 + 5 * 4


def test_a_row_cancelled_while_waiting_for_its_pieces_leaves_nothing_behind(tokenizer, tmp_path):
    """A long prompt that found its prefix stored, cancelled while it waits behind another's pieces: its stored
    states must not reach the next request in its slot (an EAGLE head would then be out of step)."""
    model = served_model()
    head = speculator_for("eagle", model, tmp_path)
    engine = ServingEngine(model, tokenizer, head, num_speculative_tokens=3, max_batch_size=3, block_size=4,
                           schedule="constant", prefill_chunk_tokens=CHUNK).start()
    try:
        shared = repeating(40, seed=1)
        engine.generate(shared + [9], max_tokens=3)  # stores the shared prefix with its states
        running = engine.submit(repeating(5, seed=2), 30)
        next(iter(running))
        admit = engine.scheduler._admit

        def cancelling(request, *args, **kwargs):  # cancelled as it joins: it leaves at the next step
            admit(request, *args, **kwargs)
            if request.prompt_ids[:40] == shared:
                engine.scheduler.cancel(request)

        engine.scheduler._admit = cancelling
        ahead = engine.submit(repeating(60, seed=3), 4)  # a long prompt read piece by piece
        cancelled = engine.submit(shared + repeating(12, seed=4), 4)  # waits behind it
        for _ in cancelled:
            pass
        assert cancelled.request.finish_reason == "cancelled" and engine.prefix_cache.num_hit_tokens >= 40
        later = [(repeating(7, seed=5 + i), 6) for i in range(3)]
        streams = [engine.submit(p, n) for p, n in later]
        for stream, (p, n) in zip([ahead] + streams, [(repeating(60, seed=3), 4)] + later):
            for _ in stream:
                pass
            assert stream.request.finish_reason in ("stop", "length")
            assert stream.request.output_ids == solo(model, p, n)
        for _ in running:
            pass
        assert not engine.step.prefix_states
        assert no_blocks_held(engine)
    finally:
        engine.shutdown()


def test_a_head_drafts_nothing_for_a_row_until_its_whole_prompt_is_in(tokenizer, tmp_path):
    """Pieces' states reach the head when the row joins a step, as a stored prefix's do: in that step it proposes
    nothing for the row (its drafts would follow the last piece, not the prompt), from the next on it drafts."""
    model = served_model()
    head = speculator_for("eagle", model, tmp_path)
    proposals = []
    propose = head.propose

    def recording(batch, k):
        draft = propose(batch, k)
        proposals.append(dict(zip(batch.active, draft.num_tokens.tolist())))
        return draft

    head.propose = recording
    engine = ServingEngine(model, tokenizer, head, num_speculative_tokens=3, max_batch_size=2, block_size=4,
                           schedule="constant", prefill_chunk_tokens=CHUNK).start()
    try:
        running = engine.submit(repeating(5, seed=1), 40)
        next(iter(running))
        long = engine.generate(repeating(50, seed=2), max_tokens=12)
        assert long.request.output_ids == solo(model, repeating(50, seed=2), 12)
        slot = long.request.slot
        steps = [p for p in proposals if slot in p]
        assert steps[0][slot] == 0 and any(p[slot] > 0 for p in steps[1:])
    finally:
        engine.shutdown()


def test_the_prefix_cache_stores_every_piece_when_the_budget_is_not_whole_blocks(tokenizer, tmp_path):
    model = served_model()
    head = speculator_for("eagle", model, tmp_path)
    engine = ServingEngine(model, tokenizer, head, num_speculative_tokens=3, max_batch_size=2, block_size=4,
                           schedule="constant", prefill_chunk_tokens=10).start()
    try:
        prompt = repeating(47, seed=3)
        for _ in range(2):
            assert engine.generate(prompt, max_tokens=5).request.output_ids == solo(model, prompt, 5)
        assert engine.prefix_cache.num_hit_tokens == 44  # every whole block but the one with the last token
    finally:
        engine.shutdown()


def test_a_short_request_does_not_wait_behind_a_long_prompt(tokenizer):
    """A short prompt arriving right after a long one joins at once (the budget goes to prompts that fit first),
    while the long one is still read in pieces."""
    model = served_model()
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=0, max_batch_size=3, block_size=4,
                           prefill_chunk_tokens=CHUNK)
    steps = recording_steps(engine)
    engine.start()
    try:
        running = engine.submit(repeating(5, seed=1), 40)
        tokens = iter(running)
        next(tokens)
        long = engine.submit(repeating(64, seed=2), 4)
        short = engine.submit(repeating(6, seed=3), 4)
        for stream, (p, n) in ((short, (repeating(6, seed=3), 4)), (long, (repeating(64, seed=2), 4)),
                               (running, (repeating(5, seed=1), 40))):
            for _ in stream:
                pass
            assert stream.request.output_ids == solo(model, p, n)
    finally:
        engine.shutdown()
    # Behind the long one the short one would have come after it; it comes while the pieces are read.
    assert first_token_step(steps, long.request_id) - first_token_step(steps, short.request_id) >= 3


def test_a_draft_model_reads_a_long_prompt_a_piece_a_step(tokenizer):
    """A draft model reads a newcomer's prompt no faster than the target does (`catch_up_tokens`, set to the
    prefill budget): no draft forward feeds a row more than that, rows catching up draft nothing, and every request
    equals its solo run."""
    model = served_model()
    engine = ServingEngine(model, tokenizer, served_model(seed=3), num_speculative_tokens=3, max_batch_size=3,
                           block_size=4, schedule="constant", prefill_chunk_tokens=CHUNK).start()
    assert engine.speculator.catch_up_tokens == CHUNK
    fed = []
    forward = engine.speculator._runner.forward

    def recording(seq_ids, input_ids, num_tokens, *args, **kwargs):
        fed.append(list(num_tokens))
        return forward(seq_ids, input_ids, num_tokens, *args, **kwargs)

    engine.speculator._runner.forward = recording
    try:
        plan = [(repeating(5, seed=1), 30), (repeating(45, seed=2), 12), (repeating(37, seed=4), 9)]
        streams = [engine.submit(*plan[0])]
        next(iter(streams[0]))
        streams += [engine.submit(p, n) for p, n in plan[1:]]
        for (p, n), stream in zip(plan, streams):
            for _ in stream:
                pass
            assert stream.request.output_ids == solo(model, p, n)
        assert max(max(f) for f in fed) <= CHUNK and engine.metrics.num_draft_tokens > 0
        assert no_blocks_held(engine)
    finally:
        engine.shutdown()


def test_a_draft_models_catch_up_limit_in_one_call_generate():
    """`DraftModelSpeculator(catch_up_tokens=)` in a one-call generate: the output is the target's own."""
    from conftest import make_model, ragged_batch
    from hf_specdec import DraftModelSpeculator

    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=3, width=30)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    draft = DraftModelSpeculator(make_model("llama", seed=1), catch_up_tokens=8)
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          speculator=draft, speculative_schedule="constant")
    assert torch.equal(out, expected)


def test_a_tiny_catch_up_limit_still_drafts_and_bad_values_are_refused():
    """A limit below what rows read in ordinary steps (k accepted drafts and the bonus token) would leave every row
    catching up for good: the limit never goes below k + 2."""
    from conftest import make_model, ragged_batch
    from hf_specdec import DraftModelSpeculator

    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=2, width=12)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    twin = make_model("llama")  # the target's own weights as the draft: every draft is accepted
    twin.load_state_dict(target.state_dict())
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          speculator=DraftModelSpeculator(twin, catch_up_tokens=1), num_speculative_tokens=3,
                          speculative_schedule="constant", return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.speculative_metrics.num_accepted_tokens >= 6
    for bad in (0, -3, True):
        with pytest.raises(ValueError, match="catch_up_tokens"):
            DraftModelSpeculator(twin, catch_up_tokens=bad)
