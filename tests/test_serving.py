"""Continuous batching and the OpenAI-compatible server.

Requests that join a running batch equal their solo runs (plain greedy `generate`), whatever runs beside them; a
sampled row keeps the exact target distribution next to greedy rows; the server, driven by the official `openai`
client on a loopback port, returns what `generate` returns, refuses bad requests with JSON errors naming the field,
and frees every KV block of a client that goes away.
"""

from __future__ import annotations

import collections
import socket
import threading
import time

import pytest
import torch

from hf_specdec.costs.step_cost import StepCost
from hf_specdec.decode.requests import SamplingParams
from hf_specdec.serving import QueueFullError, RequestError, ServingEngine

from conftest import VOCAB, make_model

EOS = 2
WORDS = ["<pad>", "<s>", "</s>", "<unk>", "user", "assistant", "system"] + [f"w{i}" for i in range(VOCAB - 7)]
TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}assistant"


def word_tokenizer():
    """Whitespace-separated words, one token each; decoding joins them with spaces (prefix-stable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def served_model(seed=0, eos=EOS):
    model = make_model("llama", seed=seed)
    model.generation_config.eos_token_id = eos
    return model


def repeating(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(7, VOCAB, (5,), generator=g).tolist()
    return (phrase * (length // 5 + 1))[:length]


_TWINS = {}


def solo(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy `generate` on one prompt: the reference every served request must equal. It runs on a twin of
    `model` (same weights): a running engine has switched the served model to its paged attention."""
    key = id(model)
    if key not in _TWINS:
        twin = make_model("llama")
        twin.load_state_dict(model.state_dict())
        twin.generation_config.eos_token_id = model.generation_config.eos_token_id
        _TWINS[key] = (model, twin)  # the model is kept alive, so its id is not reused
    model = _TWINS[key][1]
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def served_equal_solo(engine, model, plan: list[tuple[list[int], int]]) -> None:
    """Submits every `(prompt, max_tokens)` of `plan` at once and checks each answer against its solo run."""
    streams = [engine.submit(prompt, n) for prompt, n in plan]
    for (prompt, n), stream in zip(plan, streams):
        for _ in stream:
            pass
        assert stream.request.output_ids == solo(model, prompt, n)


def no_blocks_held(engine) -> bool:
    manager = engine.target.cache.manager  # the slots' regions stay with the slots
    return manager.sequences() == [] and manager.num_free_blocks == (manager.num_blocks - manager.num_reserved
                                                                     - manager.num_region_blocks)


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


# --- continuous batching ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("regions", [32, 0])
@pytest.mark.parametrize("speculator", ["ngram", "draft", "none"])
def test_requests_joining_a_running_batch_equal_their_solo_runs(tokenizer, speculator, regions, monkeypatch):
    """Requests arrive while others run; each equals its solo run. With KV regions per slot (small ones here, so
    the longer requests also outgrow theirs), steps whose rows sit in consecutive slots read them in place."""
    from hf_specdec.cache import paged as paged_cache

    views = []
    plan_step = paged_cache.PagedKVCache.plan_step
    monkeypatch.setattr(paged_cache.PagedKVCache, "plan_step",
                        lambda self, *a, **k: views.append(plan_step(self, *a, **k)) or views[-1])
    model = served_model()
    spec = {"ngram": "ngram", "draft": served_model(seed=3), "none": "ngram"}[speculator]
    engine = ServingEngine(model, tokenizer, spec, num_speculative_tokens=0 if speculator == "none" else 4,
                           max_batch_size=3, schedule="constant", kv_region_tokens=regions).start()
    try:
        plan = [(repeating(6 + 3 * i, seed=i), 12 + 7 * (i % 3)) for i in range(7)]
        streams = [engine.submit(*plan[0]), engine.submit(*plan[1])]
        first = next(iter(streams[0]))  # the batch is running; the rest arrive while it does
        assert first.token_ids
        for prompt, n in plan[2:]:
            streams.append(engine.submit(prompt, n))
            time.sleep(0.01)
        for stream in streams:
            for _ in stream:
                pass
        for (prompt, n), stream in zip(plan, streams):
            assert stream.request.output_ids == solo(model, prompt, n), (prompt, n)
            assert stream.request.finish_reason in ("stop", "length")
        assert engine.metrics.num_draft_tokens > 0 or speculator == "none"
        in_place = [p.context_view is not None for p in views if p.block_tables.shape[0] > 1]
        assert any(in_place) == bool(regions) and not all(in_place)
        time.sleep(0.05)
        assert no_blocks_held(engine)
        if regions:
            assert engine.target.cache.manager.num_region_blocks == 3 * 2
    finally:
        engine.shutdown()


def five_requests_equal_their_solo_runs(engine, model) -> None:
    """Starts `engine` (if it is not running), serves five requests of different lengths at once (more than three
    slots: some wait), shuts it down and checks each answer against its solo run."""
    engine.start()
    try:
        plan = [(repeating(6 + 3 * i, seed=i), 10 + 9 * i) for i in range(5)]
        streams = [engine.submit(prompt, n) for prompt, n in plan]
        for stream in streams:
            for _ in stream:
                pass
    finally:
        engine.shutdown()
    for (prompt, n), stream in zip(plan, streams):
        assert stream.request.output_ids == solo(model, prompt, n)


def test_adaptive_serving_times_its_steps_and_weighs_rows_by_work_left(tokenizer):
    """Under adaptive k the serving engine corrects the step cost by its steps' timings and, with nobody waiting,
    weighs each row by the tokens it has left; every answer still equals its solo run."""
    model = served_model()
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=4, max_batch_size=3).start()
    seen = []
    weigh = engine.step.policy.weigh
    engine.step.policy.weigh = lambda rows, remaining: seen.append(remaining) or weigh(rows, remaining)
    five_requests_equal_their_solo_runs(engine, model)
    assert engine.step.policy.measured.steps > 0
    assert None in seen  # while requests waited: every row alike
    assert any(r is not None and len(set(r)) > 1 for r in seen)  # then by the tokens each had left


@pytest.mark.parametrize("speculator", ["ngram", "draft"])
def test_serving_checks_what_drafts_cost_per_batch_size(tokenizer, speculator):
    """The serving policy's per-batch-size check sees every decode step, timed whole: steps with drafts with what
    the policy's model priced for exactly the drafts fed (and, for a draft model, the draft positions it ran before
    adaptive k trimmed them per row) and the drafts accepted in that very step, plain steps as the reference."""
    model = served_model()
    # A draft model with the target's weights, priced as a small one: its drafts are accepted and look cheap, so
    # adaptive k keeps drafting.
    spec = {"ngram": "ngram", "draft": served_model()}[speculator]
    engine = ServingEngine(model, tokenizer, spec, num_speculative_tokens=4, max_batch_size=3, warmup=False)
    policy, step = engine.step.policy, engine.step
    # Priced over a flat curve from the first step (the fitted costs wait for 16 steps): the static CPU curve, timed
    # with the stock linear forms, prices a short match's drafts at a loss and the test would see none.
    policy.step_cost, policy.measured = StepCost(per_row=0.0, points=((1.0, 10.0), (64.0, 10.6))), None
    if speculator == "draft":
        policy.draft_cost_per_token = 0.05  # priced as a small draft
        choose_rows = policy.choose_rows

        calls = []

        def trimmed(rows, available, classes=None, context=0.0, record=True):
            # After drafting: one draft fewer per row, or (every third call) none verified at all.
            counts = choose_rows(rows, available, classes, context, record)
            if record:
                return counts
            calls.append(1)
            return [0] * len(counts) if len(calls) % 3 == 0 else [max(0, c - 1) for c in counts]

        policy.choose_rows = trimmed
    returns, last = policy.returns, {}
    record_step, observe, seen = engine.metrics.record_step, returns.observe, []

    def recorded(drafted, accepted):
        last.update(drafted=list(drafted), accepted=sum(accepted), rows=list(engine.batch.active))
        return record_step(drafted, accepted)

    def observed(rows, context, seconds, priced=0.0, drafted=0, accepted=0):
        made, unread = step._draft_forwards, step._draft_unread
        # the model's price of the drafts fed (and of the backlog read before them), as it stands when the step
        # reports (its fit moves step by step)
        expected = policy.priced_extra(rows, 1 + drafted / rows, made, context, unread) if drafted else 0.0
        seen.append((rows, expected, priced, drafted, accepted, made, policy.chosen[-1], dict(last)))
        return observe(rows, context, seconds, priced, drafted, accepted)

    engine.metrics.record_step, returns.observe = recorded, observed
    five_requests_equal_their_solo_runs(engine, model)
    assert any(s[3] for s in seen) and (speculator == "draft" or any(not s[3] for s in seen))
    for rows, expected, priced, drafted, accepted, made, chosen, step_seen in seen:
        assert rows == len(step_seen["rows"]) and drafted == sum(step_seen["drafted"])
        assert accepted == step_seen["accepted"] and priced == pytest.approx(expected)
        if speculator == "ngram":
            assert made == 0  # a lookup's drafts cost no forwards
        elif drafted:  # the draft model ran the k adaptive k chose (or the length budget allowed), trimmed or not
            assert max(step_seen["drafted"]) <= made <= chosen
    if speculator == "draft":  # trimmed per row after drafting: the price still counts every position it ran
        assert any(made > max(s["drafted"]) for *_, made, _, s in seen if s.get("drafted") and sum(s["drafted"]))
        # a step whose draft forwards ran but verified nothing is not taken for a plain step
        assert all(made == 0 for _, _, _, drafted, _, made, _, _ in seen if not drafted)
        assert len(calls) >= 3
    else:  # steps with drafts counted against the plain steps' reference (the draft model drafts every step here)
        assert sum(b.drafting_steps for b in returns.bands.values()) > 0


@pytest.mark.parametrize("idle_backlog", [None, 1, "window"])
@pytest.mark.parametrize("version", [1, 3])
def test_eagle_head_under_continuous_batching(tokenizer, tmp_path, version, idle_backlog):
    """EAGLE heads draft from the target's hidden states: rows that join get theirs from their own first step.
    `idle_backlog=1`: every step that drafts nothing (a newcomer's prefill) has the head take the states pending,
    while the rows joining have none yet."""
    from hf_specdec import EagleSpeculator
    from test_eagle import convert  # a random-init EAGLE-1 or EAGLE-3 checkpoint for the target, converted

    model = served_model()
    head = EagleSpeculator.from_pretrained(convert(tmp_path, model, version, **({"aux_layers": [0, 1, 1]} if version == 3 else {})))
    if idle_backlog == "window":  # every step that drafts nothing restarts a row's head cache at its newest state
        head.IDLE_WINDOW = 1
    elif idle_backlog is not None:
        head.IDLE_WINDOW, head.IDLE_BACKLOG = None, idle_backlog
    engine = ServingEngine(model, tokenizer, head, num_speculative_tokens=3, max_batch_size=2,
                           schedule="constant").start()
    try:
        served_equal_solo(engine, model, [(repeating(5 + 2 * i, seed=10 + i), 10 + 5 * i) for i in range(5)])
        assert engine.metrics.num_draft_tokens > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("idle_backlog", [None, 1, "window"])
def test_eagle_head_drafts_for_the_rows_adaptive_k_picks(tokenizer, tmp_path, idle_backlog):
    """The serving policy has a head draft for some rows only (`AdaptiveK.choose_drafters`; here every other row,
    by the request, forced): the head's forwards run over those rows, the others verify no drafts and keep their
    states unread (windowed, or read every step with `idle_backlog=1`), and every answer equals its solo run."""
    from hf_specdec import EagleSpeculator
    from test_eagle import convert

    model = served_model()
    head = EagleSpeculator.from_pretrained(convert(tmp_path, model, 3, aux_layers=[0, 1, 1]))
    if idle_backlog == "window":
        head.IDLE_WINDOW = 1
    elif idle_backlog is not None:
        head.IDLE_WINDOW, head.IDLE_BACKLOG = None, idle_backlog
    engine = ServingEngine(model, tokenizer, head, num_speculative_tokens=3, max_batch_size=3, warmup=False)
    policy, drafted_rows, asked = engine.step.policy, [], []
    policy.draft_subsets = True
    choose_drafters, propose = policy.choose_drafters, head.propose

    def every_other(rows, available=None, context=0.0, unread=None):
        choose_drafters(rows, available, context, unread)  # the real choice runs (and records), then is overridden
        counts = [min(2, a) if len(engine.scheduler.running[r].prompt_ids) % 4 == 1 else 0  # even i
                  for r, a in zip(rows, available)]
        policy.chosen[-1] = max(counts)
        return counts

    def recorded(batch, k, rows=None):
        draft = propose(batch, k, rows)
        asked.append(rows)
        drafted_rows.extend(len(engine.scheduler.running[r].prompt_ids) % 4
                            for r, n in zip(batch.active, draft.num_tokens.tolist()) if n)
        return draft

    restart, drafting = head._restart, set()

    def restarted(row, start):  # a row about to draft reads all its states: never cut to the idle window
        assert row not in drafting
        restart(row, start)

    def consume(batch, rows, keep=frozenset()):
        drafting.clear()
        drafting.update(keep)
        try:
            consume_backlog(batch, rows, keep)
        finally:
            drafting.clear()

    consume_backlog = head._consume_backlog
    policy.choose_drafters, head.propose, head._restart, head._consume_backlog = every_other, recorded, restarted, consume
    engine.start()
    try:
        served_equal_solo(engine, model, [(repeating(5 + 2 * i, seed=20 + i), 12 + 4 * i) for i in range(5)])
    finally:
        engine.shutdown()
    assert engine.metrics.num_draft_tokens > 0 and any(r is not None for r in asked)
    assert drafted_rows and set(drafted_rows) == {1}  # only the rows asked for drafted


def test_eagle_head_drafts_for_rows_the_serving_policy_picks_as_rows_join(tokenizer, tmp_path):
    """The real choice (`AdaptiveK.choose_drafters`), made eager (every draft looks nearly free and sure), with
    requests joining a running batch: a row that joins in a step is offered no drafts (the head holds no states for
    it yet), the head drafts for the rows picked, and every answer equals its solo run."""
    from hf_specdec import EagleSpeculator
    from test_eagle import convert

    model = served_model()
    head = EagleSpeculator.from_pretrained(convert(tmp_path, model, 3, aux_layers=[0, 1, 1]))
    engine = ServingEngine(model, tokenizer, head, num_speculative_tokens=3, max_batch_size=2, warmup=False)
    policy = engine.step.policy
    policy.step_cost, policy.measured, policy.returns = StepCost(0.0, ((1.0, 10.0), (64.0, 10.6))), None, None
    policy.draft_cost_per_token, policy.priors[:] = 0.0, 0.95
    policy.draft_subsets = True
    choose_drafters, offers = policy.choose_drafters, []

    def recorded(rows, available=None, context=0.0, unread=None):
        counts = choose_drafters(rows, available, context, unread)
        offers.append((list(rows), list(available), counts))
        assert all(c <= a for c, a in zip(counts, available))
        return counts

    policy.choose_drafters = recorded
    engine.start()
    try:
        served_equal_solo(engine, model, [(repeating(5 + 2 * i, seed=30 + i), 10 + 5 * i) for i in range(5)])
    finally:
        engine.shutdown()
    assert engine.metrics.num_draft_tokens > 0
    assert any(0 in available and any(counts) for _, available, counts in offers)  # a newcomer beside drafts


@pytest.mark.parametrize("speculator", ["ngram", "draft", "eagle", "none"])
def test_warm_up_runs_real_steps_and_leaves_nothing_behind(tokenizer, tmp_path, speculator):
    """`warmup=True`: synthetic greedy and sampled requests run through the real step before `start` returns,
    drafting (k constant); afterwards the metrics, adaptive k's statistics, the measured step cost, the prefix cache
    and the KV pool are as a fresh engine's, and served requests still equal their solo runs."""
    model = served_model()
    if speculator == "eagle":
        from hf_specdec import EagleSpeculator
        from test_eagle import convert

        spec = EagleSpeculator.from_pretrained(convert(tmp_path, model, 1))
    else:
        spec = {"ngram": "ngram", "draft": served_model(seed=3), "none": "ngram"}[speculator]
    k = 0 if speculator == "none" else 3
    engine = ServingEngine(model, tokenizer, spec, num_speculative_tokens=k, max_batch_size=3, warmup=True)
    policy = engine.step.policy
    assert not engine.metrics.num_steps and engine.warmup_report is None
    engine.start()
    try:
        report = engine.warmup_report
        assert report["steps"] >= 2 and (report["draft_tokens"] > 0 or speculator == "none"), report
        assert engine.metrics.num_steps == 0 and engine.metrics.num_draft_tokens == 0
        assert engine.scheduler.metrics is engine.metrics and engine.step.policy is policy
        assert policy.measured.steps == 0 and not policy.tried.any() and not policy.chosen
        assert policy.calibrate and policy.expected_accepted == 0.0 and policy.actual_accepted == 0.0
        assert engine.prefix_cache.num_stored_blocks == 0
        assert no_blocks_held(engine) and engine.counters["requests"] == 0
        served_equal_solo(engine, model, [(repeating(6 + 3 * i, seed=20 + i), 9 + 4 * i) for i in range(4)])
        assert engine.metrics.num_steps > 0 and policy.measured.steps > 0
    finally:
        engine.shutdown()


def test_warm_up_fits_a_short_context(tokenizer):
    """The warm-up's prompts are cut to leave room for their tokens within `max_model_len`."""
    model = served_model()
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=3, max_batch_size=2, max_model_len=24,
                           warmup=True).start()
    try:
        assert engine.warmup_report["steps"] > 0
        served_equal_solo(engine, model, [(repeating(8, seed=1), 10)])
    finally:
        engine.shutdown()


def test_full_warm_up_is_on_by_default_only_on_cuda_and_a_short_one_elsewhere(tokenizer):
    """On the CPU the default is one short request before serving: the KV pools (the target's and the
    speculator's) exist when `start` returns, and nothing else is kept. `warmup=False` runs none."""
    model = served_model()
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=2, max_batch_size=2)
    assert engine.warmup is False and engine.short_warmup  # the model is on the CPU: nothing compiles there
    assert not engine.target.cache.key_pools
    engine.start()
    try:
        report = engine.warmup_report
        assert report["kind"] == "short" and report["steps"] >= 2 and report["draft_tokens"] > 0, report
        assert engine.target.cache.key_pools  # allocated before the first client's request
        assert engine.metrics.num_steps == 0 and engine.counters["requests"] == 0 and no_blocks_held(engine)
        assert engine.step.policy.measured.steps == 0 and not engine.step.policy.chosen
        served_equal_solo(engine, model, [(repeating(6 + 3 * i, seed=40 + i), 8 + 3 * i) for i in range(3)])
    finally:
        engine.shutdown()
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=2, max_batch_size=2, warmup=False)
    assert not engine.warmup and not engine.short_warmup
    engine.start()
    try:
        assert engine.warmup_report is None and not engine.target.cache.key_pools
    finally:
        engine.shutdown()


@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_row_beside_greedy_rows_keeps_the_target_distribution(tokenizer, seeded):
    """Two tokens sampled at temperature 0.7 from a prompt, with greedy requests in the same steps: the empirical
    distribution of the pair matches the target's exact one (total variation; the same check fails for the argmax
    distribution a broken greedy/sampled split would give). `seeded`: each request with its own seed, verified by
    position (`verify.sample_by_position`), with a draft model's sampled drafts."""
    model = served_model(eos=None)
    prompt = repeating(6, seed=1)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / 0.7, -1)
        top = first.topk(6).indices.tolist()
        exact = {}
        for a in top:
            second = torch.softmax(model(torch.tensor([prompt + [a]])).logits[0, -1] / 0.7, -1)
            for b, p in enumerate(second.tolist()):
                exact[(a, b)] = float(first[a]) * p
    engine = ServingEngine(model, tokenizer, served_model(seed=3, eos=None) if seeded else "ngram",
                           num_speculative_tokens=3, max_batch_size=4, schedule="constant").start()
    try:
        counts = collections.Counter()
        trials = 1500
        for t in range(trials // 3):
            batch = [engine.submit(prompt, 2, SamplingParams(temperature=0.7, seed=3 * t + i if seeded else None))
                     for i in range(3)]
            greedy = engine.submit(repeating(8, seed=t % 5), 3)
            for stream in batch:
                for _ in stream:
                    pass
                counts[tuple(stream.request.output_ids)] += 1
            for _ in greedy:
                pass
            assert greedy.request.output_ids == solo(model, repeating(8, seed=t % 5), 3)
    finally:
        engine.shutdown()
    mass = sum(exact.values())
    tv = 0.5 * sum(abs(counts[key] / trials - p) for key, p in exact.items()) + 0.5 * (
        sum(c for key, c in counts.items() if key not in exact) / trials - (1 - mass))
    assert tv < 0.08, tv
    argmax_pair = max(exact, key=exact.get)
    assert counts[argmax_pair] / trials < 0.9  # it really sampled


def test_seeded_request_reproduces_whatever_runs_beside_it(tokenizer):
    model = served_model(eos=None)
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=3, max_batch_size=4,
                           schedule="constant").start()
    try:
        prompt = repeating(7, seed=4)
        alone = engine.generate(prompt, max_tokens=12, sampling=SamplingParams(1.0, seed=1234)).request.output_ids
        others = [engine.submit(repeating(9, seed=s), 20, SamplingParams(1.0)) for s in range(3)]
        crowded = engine.generate(prompt, max_tokens=12, sampling=SamplingParams(1.0, seed=1234)).request.output_ids
        for stream in others:
            for _ in stream:
                pass
        other_seed = engine.generate(prompt, max_tokens=12, sampling=SamplingParams(1.0, seed=99)).request.output_ids
    finally:
        engine.shutdown()
    assert alone == crowded
    assert other_seed != alone


@pytest.mark.parametrize("speculator", ["ngram", "draft", "eagle"])
def test_seeded_output_does_not_depend_on_the_drafts(tokenizer, tmp_path, speculator):
    """A seeded sampled request gives the same tokens with speculation off, with this speculator drafting a constant
    k, and with adaptive k beside other requests: each token is its stream's sample at its position."""
    from hf_specdec import EagleSpeculator

    model = served_model(eos=None)
    prompt, sampling = repeating(7, seed=4), SamplingParams(0.9, top_p=0.95, seed=77)

    def run(spec, k, schedule, company=0):
        engine = ServingEngine(model, tokenizer, spec, num_speculative_tokens=k, max_batch_size=4,
                               schedule=schedule).start()
        try:
            others = [engine.submit(repeating(9, seed=s), 20, SamplingParams(1.0)) for s in range(company)]
            out = engine.generate(prompt, max_tokens=16, sampling=sampling).request.output_ids
            for stream in others:
                for _ in stream:
                    pass
            return out, engine.metrics.num_draft_tokens
        finally:
            engine.shutdown()

    def make():
        if speculator == "eagle":
            from test_eagle import convert

            return EagleSpeculator.from_pretrained(convert(tmp_path, model, 1))
        return {"ngram": "ngram", "draft": served_model(seed=3, eos=None)}[speculator]

    off, _ = run("ngram", 0, "constant")
    drafted, num_drafts = run(make(), 3, "constant")
    crowded, _ = run(make(), 4, "adaptive", company=3)
    assert num_drafts > 0
    assert drafted == off and crowded == off


def test_bad_requests_are_refused_and_the_rest_run_on(tokenizer):
    model = served_model()
    engine = ServingEngine(model, tokenizer, "ngram", max_batch_size=2, max_queue=1, max_model_len=64).start()
    try:
        with pytest.raises(RequestError, match="prompt is empty"):
            engine.submit([], 4)
        with pytest.raises(RequestError, match="vocabulary"):
            engine.submit([VOCAB + 5], 4)
        with pytest.raises(RequestError, match="context is 64 tokens") as info:
            engine.submit(repeating(40, 0), 30)
        assert info.value.param == "max_tokens"
        with pytest.raises(RequestError, match="max_tokens"):
            engine.submit(repeating(4, 0), -1)
        nothing = engine.generate(repeating(4, 0), max_tokens=0)  # nothing to do: it ends as it leaves the queue
        assert nothing.request.output_ids == [] and nothing.request.finish_reason == "length"
        good = engine.generate(repeating(6, 1), max_tokens=8)
        assert good.request.output_ids == solo(model, repeating(6, 1), 8)
    finally:
        engine.shutdown()


def test_kv_regions_are_refused_when_they_cannot_apply(tokenizer):
    with pytest.raises(ValueError, match="kv_region_tokens must be >= 0"):
        ServingEngine(served_model(), tokenizer, "ngram", kv_region_tokens=-1)
    with pytest.raises(ValueError, match="cannot be combined"):
        ServingEngine(served_model(), tokenizer, "ngram", kv_region_tokens=64, max_num_blocks=100)
    capped = ServingEngine(served_model(), tokenizer, "ngram", max_num_blocks=100)  # no regions by default, then
    assert capped.target.cache.manager.num_region_blocks == 0
    assert ServingEngine(served_model(), tokenizer, "ngram", max_batch_size=2).target.cache.manager.num_region_blocks


def test_a_capped_pool_caps_the_context(tokenizer):
    """Requests wait until their worst case fits a capped pool: the context is capped to what one request can hold,
    so a request without max_tokens (the whole context) runs instead of waiting for good, and one asking past it is
    refused naming max_tokens."""
    model = served_model(eos=None)
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=4, max_batch_size=2, block_size=4,
                           max_num_blocks=12, warmup=False)
    assert engine.max_model_len == (12 - 1) * 4 - 5 == engine.scheduler.max_request_tokens()
    assert engine.max_model_len < model.config.max_position_embeddings
    with pytest.raises(RequestError, match="max_tokens"):
        engine.submit(repeating(10, 1), engine.max_model_len)
    engine.start()
    try:
        whole = engine.submit(repeating(10, 1))  # no max_tokens: up to the capped context
        small = engine.submit(repeating(6, 2), 3)
        for stream in (whole, small):
            for _ in stream:
                pass
        assert len(whole.request.output_ids) == engine.max_model_len - 10
        assert small.request.output_ids == solo(model, repeating(6, 2), 3)
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="max_num_blocks=2 leaves no room"):
        ServingEngine(served_model(), tokenizer, "ngram", block_size=4, max_num_blocks=2, warmup=False)


def test_full_queue_is_refused(tokenizer):
    model = served_model(eos=None)
    engine = ServingEngine(model, tokenizer, "ngram", max_batch_size=1, max_queue=2)  # not started: nothing drains
    accepted = [engine.submit(repeating(5, i), 4) for i in range(3)]  # one slot + two waiting
    with pytest.raises(QueueFullError, match="queue is full"):
        engine.submit(repeating(5, 9), 4)
    engine.start()
    for stream in accepted:
        for _ in stream:
            pass
    engine.shutdown()


def test_cancel_frees_blocks_at_the_next_step(tokenizer):
    model = served_model(eos=None)
    engine = ServingEngine(model, tokenizer, "ngram", max_batch_size=2).start()
    try:
        stream = engine.submit(repeating(10, 2), 200)
        iterator = iter(stream)
        next(iterator)
        assert engine.num_blocks_in_use > 0
        stream.cancel()
        reasons = [d.finish_reason for d in iterator]
        assert reasons[-1] == "cancelled"
        deadline = time.monotonic() + 5
        while not no_blocks_held(engine) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert no_blocks_held(engine)
        assert engine.generate(repeating(6, 3), max_tokens=5).request.output_ids == solo(model, repeating(6, 3), 5)
    finally:
        engine.shutdown()


def test_stop_strings_end_the_text_before_them(tokenizer):
    model = served_model(eos=None)
    prompt = repeating(8, 5)
    reference = tokenizer.decode(solo(model, prompt, 20), skip_special_tokens=True)
    words = reference.split()
    stop = " ".join(words[3:5])
    # A draft identical to the target, 4 drafts every step: all accepted, so the step that completes the stop
    # string also emits tokens after it.
    engine = ServingEngine(model, tokenizer, served_model(eos=None), num_speculative_tokens=4, schedule="constant",
                           max_batch_size=2).start()
    try:
        stream = engine.submit(prompt, 20, stop=[stop])
        deltas = list(stream)
        accepted = engine.metrics.num_accepted_tokens
    finally:
        engine.shutdown()
    text = "".join(d.text for d in deltas)
    assert text == reference[: reference.index(stop)]
    assert deltas[-1].finish_reason == "stop"
    # usage counts the tokens up to the one completing the stop string, whatever else the step emitted
    full = solo(model, prompt, 20)
    needed = next(n for n in range(1, 21) if stop in tokenizer.decode(full[:n], skip_special_tokens=True))
    assert stream.request.num_generated == needed and stream.request.output_ids == full[:needed]
    assert sum(len(d.token_ids) for d in deltas) == needed and accepted > 0


def reference_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """`[len(output), vocab]` the target's log-softmax at each output token's position: one plain forward (on the
    twin of `model`, as `solo`)."""
    solo(model, prompt, 1)
    twin = _TWINS[id(model)][1]
    with torch.no_grad():
        logits = twin(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: len(prompt) - 1 + len(output)]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("speculator", ["ngram", "draft", "off"])
def test_logprobs_are_the_targets_whatever_the_drafts(tokenizer, speculator):
    """Each token's log probability and its likeliest alternatives are the target's at that position, whether the
    token was an accepted draft or the target's own pick, for greedy and sampled rows, beside rows that ask for none;
    a stop string's cut drops the logprobs of the tokens after it too."""
    model = served_model(eos=None)
    spec = served_model(eos=None) if speculator == "draft" else "ngram"  # a draft equal to the target: all accepted
    engine = ServingEngine(model, tokenizer, spec, num_speculative_tokens=0 if speculator == "off" else 4,
                           schedule="constant", max_batch_size=4).start()
    stop_prompt = repeating(8, 5)
    stop = " ".join(tokenizer.decode(solo(model, stop_prompt, 20), skip_special_tokens=True).split()[5:7])
    plan = [(stop_prompt, 20, 3, None, [stop]), (repeating(11, 6), 15, 0, None, None),
            (repeating(9, 7), 12, None, None, None),
            (repeating(7, 8), 18, 5, SamplingParams(temperature=1.0, seed=3), None)]
    try:
        streams = [engine.submit(p, n, sampling, stop, logprobs=lp) for p, n, lp, sampling, stop in plan]
        deltas = [list(s) for s in streams]
        accepted = engine.metrics.num_accepted_tokens
    finally:
        engine.shutdown()
    assert (accepted > 0) == (speculator != "off")
    assert deltas[0][-1].finish_reason == "stop" and len(streams[0].request.output_ids) < 20
    for stream, got, (_, _, lp, _, _) in zip(streams, deltas, plan):
        request = stream.request
        if lp is None:
            assert request.output_logprobs == [] and all(d.logprobs is None for d in got)
            continue
        assert [e for d in got for e in d.logprobs] == request.output_logprobs
        assert sum(len(d.token_ids) for d in got) == len(request.output_ids) == len(request.output_logprobs)
        reference = reference_logprobs(model, request.prompt_ids, request.output_ids)
        chosen = torch.tensor([value for value, _ in request.output_logprobs])
        torch.testing.assert_close(chosen, reference.gather(-1, torch.tensor(request.output_ids)[:, None])[:, 0],
                                   atol=1e-4, rtol=0)
        for row, (_, top) in zip(reference, request.output_logprobs):
            values, ids = row.topk(lp)
            assert [t for t, _ in top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=1e-4, rtol=0)
        if request.sampling.greedy and lp:
            assert [top[0][0] for _, top in request.output_logprobs] == request.output_ids


def penalized_logits(logits: torch.Tensor, history: list[int], output: list[int], params: SamplingParams):
    """The reference: OpenAI's and vLLM's formulas, one position at a time, in plain Python."""
    logits = logits.float().clone()
    for token, bias in (params.logit_bias or {}).items():
        logits[token] += bias
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(history)))
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty)
    for token, count in collections.Counter(output).items():
        logits[token] -= params.frequency_penalty * count + params.presence_penalty
    return logits


def penalized_greedy(model, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    solo(model, prompt, 1)
    twin, out = _TWINS[id(model)][1], []
    with torch.no_grad():
        for _ in range(n):
            logits = twin(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(penalized_logits(logits, prompt + out, out, params).argmax()))
            if out[-1] == model.generation_config.eos_token_id:
                break
    return out


PENALTIES = [SamplingParams(presence_penalty=1.5), SamplingParams(frequency_penalty=0.7),
             SamplingParams(repetition_penalty=1.4), SamplingParams(logit_bias={9: 2.5, 11: -100}),
             SamplingParams(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=0.8,
                            logit_bias={20: 1.0})]


@pytest.mark.parametrize("speculator", ["ngram", "draft"])
def test_min_tokens_and_ignore_eos(tokenizer, speculator):
    """vLLM's `min_tokens` keeps EOS out of the first tokens, at every position a step verifies (drafts included);
    `ignore_eos` runs on past EOS to max_tokens, ending for "length". A logit bias makes EOS the target's pick."""
    model = served_model()
    spec = served_model() if speculator == "draft" else "ngram"
    engine = ServingEngine(model, tokenizer, spec, num_speculative_tokens=3, schedule="constant",
                           max_batch_size=4).start()
    prompt = repeating(8, 40)
    eos_first = {EOS: 100.0}
    try:
        plain = engine.generate(prompt, max_tokens=6, sampling=SamplingParams(logit_bias=eos_first))
        held = engine.generate(prompt, max_tokens=12, sampling=SamplingParams(logit_bias=eos_first, min_tokens=5))
        ignored = engine.generate(prompt, max_tokens=6, sampling=SamplingParams(logit_bias=eos_first,
                                                                                 ignore_eos=True))
        with pytest.raises(RequestError, match="min_tokens") as refused:
            engine.submit(prompt, 4, SamplingParams(min_tokens=5))
        assert refused.value.param == "min_tokens"
    finally:
        engine.shutdown()
    assert plain.request.output_ids == [EOS] and plain.request.finish_reason == "stop"
    assert ignored.request.output_ids == [EOS] * 6 and ignored.request.finish_reason == "length"
    solo(model, prompt, 1)
    twin, expected = _TWINS[id(model)][1], []
    with torch.no_grad():
        for _ in range(5):  # EOS held back: the likeliest other token
            logits = twin(torch.tensor([prompt + expected])).logits[0, -1]
            logits[EOS] = float("-inf")
            expected.append(int(logits.argmax()))
    assert held.request.output_ids == expected + [EOS] and held.request.finish_reason == "stop"


def test_min_tokens_holds_stop_strings_back_and_is_refused_with_a_grammar(tokenizer):
    """As vLLM's: a stop string counts only where it ends past the first min_tokens tokens' text; with a grammar,
    min_tokens is refused (where the grammar allows nothing but EOS, no token would be left)."""
    from hf_specdec import Grammar

    model = served_model(eos=None)
    prompt = repeating(8, 5)
    full = solo(model, prompt, 20)
    text = tokenizer.decode(full, skip_special_tokens=True)
    stop = text.split()[2]
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=3, schedule="constant",
                           max_batch_size=2).start()
    try:
        early = engine.generate(prompt, max_tokens=20, stop=[stop])
        late = engine.generate(prompt, max_tokens=20, stop=[stop], sampling=SamplingParams(min_tokens=5))
        for field, sampling in (("min_tokens", SamplingParams(min_tokens=2)), ("ignore_eos", SamplingParams(
                ignore_eos=True))):
            with pytest.raises(RequestError, match=f"{field} cannot be combined with response_format") as refused:
                engine.submit(prompt, 8, sampling, grammar=Grammar.from_response_format({"type": "json_object"}))
            assert refused.value.param == field
    finally:
        engine.shutdown()
    assert early.text == text[:text.index(stop)]
    floor = len(tokenizer.decode(full[:5], skip_special_tokens=True))
    hit = text.find(stop, floor - len(stop) + 1)
    assert late.text == (text if hit < 0 else text[:hit]) and len(late.text) > len(early.text)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos="no")
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=True)


def test_row_penalties_count_only_the_rows_own_tokens():
    """A row's repetition penalty counts its tokens from its first column (not the left padding before it), its
    frequency penalty only those of its output, each position up to its own history length; a row without
    penalties beside it is untouched, and so are columns past the step's width."""
    from hf_specdec.decode.row_sampling import RowSampling

    sampling = RowSampling(2, "cpu", vocab_size=10)
    sampling.set(0, SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, logit_bias={3: 0.5}),
                 output_start=4, history_start=2)
    sampling.set(1, None)
    sampling.prepare([0, 1], width=7)
    token_ids = torch.tensor([[0, 0, 5, 6, 7, 7, 8, 9], [1] * 8])  # row 0: padding, prompt 5 6, output 7 7, draft 8
    out = sampling(token_ids, torch.tensor([0, 0, 1]), torch.tensor([6, 7, 6]), torch.ones(3, 10))
    first = [1, 1, 1, 1.5, 1, 0.5, 0.5, 0.5 - 2, 1, 1]  # 5, 6, 7 seen (7 twice in the output); 3 biased
    second = first[:8] + [0.5 - 1, 1]  # the draft 8 is in this position's history and output
    torch.testing.assert_close(out, torch.tensor([first, second, [1.0] * 10]))
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=1e-40)


@pytest.mark.parametrize("speculator", ["ngram", "draft", "off"])
def test_penalties_and_biases_are_exact_under_speculation(tokenizer, speculator):
    """Greedy requests with presence, frequency and repetition penalties and logit biases, beside a plain one, in
    one running batch: each equals decoding one token at a time with the penalties applied by the reference
    formulas (n-gram drafts from a repeating prompt propose tokens the penalties then reject; a draft model drafts
    under the same penalties); the repetition penalty also equals transformers' own."""
    model = served_model(eos=None)
    spec = served_model(eos=None) if speculator == "draft" else "ngram"
    engine = ServingEngine(model, tokenizer, spec, num_speculative_tokens=0 if speculator == "off" else 4,
                           schedule="constant", max_batch_size=3).start()
    plan = [(repeating(8 + i, 20 + i), 16, params) for i, params in enumerate(PENALTIES)] + [
        (repeating(9, 30), 16, None)]
    try:
        streams = [engine.submit(p, n, sampling) for p, n, sampling in plan]
        for stream in streams:
            for _ in stream:
                pass
        accepted, drafted = engine.metrics.num_accepted_tokens, engine.metrics.num_draft_tokens
    finally:
        engine.shutdown()
    for stream, (prompt, n, params) in zip(streams, plan):
        expected = solo(model, prompt, n) if params is None else penalized_greedy(model, prompt, n, params)
        assert stream.request.output_ids == expected, params
    if speculator == "ngram":
        assert 0 < accepted < drafted  # drafts were verified, and some were turned down
    if speculator == "draft":  # the draft model drafts under the same penalties: all its drafts pass
        assert 0 < accepted == drafted
    twin = _TWINS[id(model)][1]
    prompt = plan[2][0]
    out = twin.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.4,
                        pad_token_id=0)
    assert out[0, len(prompt):].tolist() == streams[2].request.output_ids


def test_sampled_penalties_keep_the_penalized_distribution(tokenizer):
    """Two tokens sampled with penalties and a bias, a draft model's sampled drafts verified against them: the pair's
    empirical distribution matches the exact penalized one (the second token's penalties count the first, also when
    it was a draft verified in the same step). Total variation over the pairs of probability above 0.004, the rest
    as one: an exact sampler stays under 0.047 in 99 of 100 runs of 1200 draws here; the unpenalized distribution
    is 0.145 away."""
    model = served_model(eos=None)
    prompt = repeating(6, seed=1)
    temperature = 0.3
    params = SamplingParams(temperature=temperature, presence_penalty=1.2, frequency_penalty=0.5,
                            repetition_penalty=1.3, logit_bias={prompt[0]: 1.5})

    def pairs(params) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1]
            first = torch.softmax(penalized_logits(logits, prompt, [], params) / temperature, -1)
            exact = torch.zeros(VOCAB, VOCAB)
            for a in range(VOCAB):
                logits = model(torch.tensor([prompt + [a]])).logits[0, -1]
                exact[a] = first[a] * torch.softmax(penalized_logits(logits, prompt + [a], [a], params) / temperature,
                                                    -1)
        return exact.flatten()

    exact = pairs(params)
    keep = exact > 0.004

    def distance(p: torch.Tensor) -> float:
        return 0.5 * float((p[keep] - exact[keep]).abs().sum() + (p[~keep].sum() - exact[~keep].sum()).abs())

    engine = ServingEngine(model, tokenizer, served_model(seed=3, eos=None), num_speculative_tokens=3,
                           max_batch_size=4, schedule="constant").start()
    trials = 1200
    counts = torch.zeros(VOCAB * VOCAB)
    try:
        for _ in range(trials // 4):
            batch = [engine.submit(prompt, 2, params) for _ in range(4)]
            for stream in batch:
                for _ in stream:
                    pass
                a, b = stream.request.output_ids
                counts[a * VOCAB + b] += 1
        accepted = engine.metrics.num_accepted_tokens
    finally:
        engine.shutdown()
    assert accepted > 0
    assert distance(counts / trials) < 0.08, distance(counts / trials)
    assert distance(pairs(SamplingParams(temperature=temperature))) > 0.12  # the check tells the plain one apart


def test_logprobs_are_refused_with_draft_trees(tokenizer, tmp_path):
    from hf_specdec.decode.requests import Request

    engine = ServingEngine(served_model(), tokenizer, "ngram", num_speculative_tokens=2, max_batch_size=2)
    engine.step.tree_nodes = 4  # as a tree-drafting engine would have it
    with pytest.raises(RequestError, match="draft trees") as refused:
        engine.submit([5, 6, 7], 4, logprobs=1)
    assert refused.value.param == "logprobs"
    with pytest.raises(ValueError, match="draft trees"):  # and the scheduler's own check, for callers below it
        request = Request([5, 6, 7], 4, logprobs=1)
        request.slot = 0
        engine.scheduler._admit(request)


# --- the HTTP server, through the official client ---------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def prompt_reference(model, prompt: list[int]) -> torch.Tensor:
    """`[len(prompt) - 1, vocab]` the target's log-softmax at each prompt position but the last (position i gives
    token i + 1's log probability), from one plain forward on the twin of `model`."""
    solo(model, prompt, 1)
    with torch.no_grad():
        logits = _TWINS[id(model)][1](torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_prompt_logprobs(model, request, top: int) -> None:
    reference = prompt_reference(model, request.prompt_ids)
    entries = request.prompt_token_logprobs
    assert len(entries) == len(request.prompt_ids) - 1
    chosen = reference.gather(-1, torch.tensor(request.prompt_ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([value for value, _ in entries]), chosen, atol=1e-4, rtol=0)
    for row, (_, alternatives) in zip(reference, entries):
        values, ids = row.topk(top) if top else (row[:0], row[:0].long())
        assert [t for t, _ in alternatives] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in alternatives]), values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("speculator", ["ngram", "draft"])
def test_prompt_logprobs_are_the_targets(tokenizer, speculator, monkeypatch):
    """`prompt_logprobs`: each prompt token's log probability given those before it, and its likeliest alternatives,
    equal one plain forward's, for prompts fed in pieces (longer than a prefill chunk), several rows' pieces of
    different lengths in one forward, beside running requests, and for a prompt whose prefix the prefix cache holds;
    the answers after them equal their solo runs, and `max_tokens=0` scores the prompt alone, ending at once, every
    block back."""
    from hf_specdec.decode.scheduler import Scheduler

    shared, score = [], Scheduler._score
    monkeypatch.setattr(Scheduler, "_score", lambda self, rows, amounts, cached: shared.append(len(set(amounts)))
                        or score(self, rows, amounts, cached))
    model = served_model(eos=None)
    spec = served_model(seed=3, eos=None) if speculator == "draft" else "ngram"
    engine = ServingEngine(model, tokenizer, spec, num_speculative_tokens=3, schedule="constant", max_batch_size=4,
                           prefill_chunk_tokens=64, prefix_cache_tokens=256).start()
    long_prompt, short_prompt = repeating(45, 11), repeating(9, 12)
    try:
        running = engine.submit(repeating(12, 13), 40)
        next(iter(running))  # a batch is running when the scored prompts arrive
        warm = engine.generate(long_prompt, max_tokens=2)  # the prefix cache now holds the long prompt's blocks
        scored = [engine.submit(long_prompt, 10, prompt_logprobs=3, logprobs=1),
                  engine.submit(short_prompt, 0, prompt_logprobs=0),
                  engine.submit(long_prompt[:30], 0, prompt_logprobs=2),
                  engine.submit([short_prompt[0]], 0, prompt_logprobs=1)]
        deltas = [list(s) for s in scored]
        for _ in running:
            pass
        time.sleep(0.05)
        assert no_blocks_held(engine)
    finally:
        engine.shutdown()
    assert warm.request.prompt_token_logprobs == []
    assert max(shared) > 1  # a forward scored rows of different lengths
    assert running.request.output_ids == solo(model, running.request.prompt_ids, 40)
    assert scored[0].request.output_ids == solo(model, long_prompt, 10)
    assert len(scored[0].request.output_logprobs) == 10
    for stream, top in zip(scored[:3], (3, 0, 2)):
        assert_prompt_logprobs(model, stream.request, top)
    for stream, got in zip(scored[1:], deltas[1:]):  # max_tokens=0: one delta, no tokens
        assert [(d.token_ids, d.finish_reason) for d in got] == [([], "length")]
        assert stream.request.output_ids == []
    assert scored[3].request.prompt_token_logprobs == []  # a one-token prompt: nothing before its token


@pytest.mark.parametrize("kind", ["eagle", "mamba2", "falcon_h1", "falcon"])
def test_prompt_logprobs_on_every_kind_of_target(kind, tmp_path):
    """Prompt log probabilities where the target reads prompts its own way: an EAGLE head that drafts from the
    states of the scored pieces, recurrent layers (chunked prefill off: the prompt scored in one forward that keeps
    the state after its last position only), the masked dense cache. Each equals a plain forward, and the answer
    after it, and the request running beside, their plain greedy runs."""
    import test_masked_cache
    import test_recurrent

    if kind == "eagle":
        from hf_specdec import EagleSpeculator
        from test_eagle import convert

        target, twin = served_model(eos=None), served_model(eos=None)
        speculator = EagleSpeculator.from_pretrained(convert(tmp_path, target, 1))
    else:
        make = test_recurrent.make if kind in test_recurrent.ARCHITECTURES else test_masked_cache.make
        target, twin, speculator = make(kind), make(kind), "ngram"
    engine = ServingEngine(target, None, speculator, num_speculative_tokens=3, max_batch_size=3, schedule="constant",
                           prefill_chunk_tokens=16 if kind == "eagle" else None).start()
    plan = [(repeating(40, 21), 8, 2), (repeating(7, 22), 0, 1)]
    try:
        running = engine.submit(repeating(10, 23), 20)
        next(iter(running))
        scored = [engine.submit(p, n, prompt_logprobs=top) for p, n, top in plan]
        for stream in scored + [running]:
            for _ in stream:
                pass
        drafted = engine.metrics.num_draft_tokens
    finally:
        engine.shutdown()

    def greedy(prompt, n):
        with torch.no_grad():
            out = twin.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, len(prompt):].tolist()

    assert running.request.output_ids == greedy(running.request.prompt_ids, 20)
    assert drafted > 0
    for stream, (prompt, n, top) in zip(scored, plan):
        with torch.no_grad():
            reference = torch.log_softmax(twin(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        entries = stream.request.prompt_token_logprobs
        assert len(entries) == len(prompt) - 1
        torch.testing.assert_close(torch.tensor([v for v, _ in entries]),
                                   reference.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-4, rtol=0)
        assert [[t for t, _ in alternatives] for _, alternatives in entries] == reference.topk(top).indices.tolist()
        assert stream.request.output_ids == (greedy(prompt, n) if n else [])



class Server:
    """`create_app` under uvicorn on a free loopback port, in a thread; stopped by the test."""

    def __init__(self, engine, api_key=None):
        import uvicorn

        from hf_specdec.serving.server import create_app

        self.port = free_port()
        config = uvicorn.Config(create_app(engine, "tiny", api_key, shutdown_grace_s=1.0), host="127.0.0.1",
                                port=self.port, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, api_key="none", **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(tokenizer):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    model = served_model()
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=4, max_batch_size=4, max_queue=8,
                           max_model_len=128)
    srv = Server(engine)
    srv.model, srv.engine = model, engine
    yield srv
    srv.stop()
    assert not engine.alive  # the lifespan shut the engine down


def test_completions_equal_generate(server, tokenizer):
    client = server.client()
    prompt = repeating(9, 6)
    expected = solo(server.model, prompt, 24)
    text = tokenizer.decode(expected, skip_special_tokens=True)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert out.choices[0].text == text
    assert out.usage.completion_tokens == len(expected) and out.usage.prompt_tokens == len(prompt)
    assert out.choices[0].finish_reason == ("stop" if EOS in expected else "length")
    words = tokenizer.decode(prompt)
    streamed = client.completions.create(model="tiny", prompt=words, max_tokens=24, temperature=0, stream=True)
    pieces = list(streamed)
    assert "".join(c.choices[0].text for c in pieces) == tokenizer.decode(
        solo(server.model, tokenizer(words)["input_ids"], 24), skip_special_tokens=True)
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    # More stop strings than OpenAI's 4, as lm-eval's code tasks send: the last of six ends the answer.
    cut = " ".join(text.split()[3:5])
    stops = ["w1 w1 w1", "nowhere", "\n\n", "</s>x", "w2 w2 w2 w2", cut]
    stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=stops)
    assert stopped.choices[0].text == text[:text.index(cut)] and stopped.choices[0].finish_reason == "stop"


def test_chat_equals_generate(server, tokenizer):
    client = server.client()
    messages = [{"role": "user", "content": tokenizer.decode(repeating(8, 7))}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    text = tokenizer.decode(solo(server.model, list(prompt), 20), skip_special_tokens=True)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.content == text and out.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    many = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0.9, n=3,
                                          seed=5)
    assert [c.index for c in many.choices] == [0, 1, 2]


def test_logprobs_through_the_client(server, tokenizer):
    """Completions (`logprobs: N`) and chat (`logprobs`, `top_logprobs`), whole and streamed: the target's log
    probabilities of the greedy answer's tokens, the tokens spelling the text."""
    client = server.client()
    prompt = repeating(9, 6)
    expected = solo(server.model, prompt, 12)
    reference = reference_logprobs(server.model, prompt, expected)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    logprobs = out.choices[0].logprobs
    assert "".join(logprobs.tokens) == out.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs),
                               reference.gather(-1, torch.tensor(expected)[:, None])[:, 0], atol=1e-4, rtol=0)
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(expected))]
    for token, value, top, row in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, reference):
        assert top[token] == value and len(top) == 2  # greedy: the token is the likeliest alternative
        assert sorted(top.values(), reverse=True) == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                            stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == logprobs.token_logprobs
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset

    messages = [{"role": "user", "content": tokenizer.decode(repeating(8, 7))}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].logprobs.refusal is None
    # the end-of-sequence token adds nothing to the answer's text, and no text either
    assert content and "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token and bytes(t.bytes) == t.token.encode()
               for t in content)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    assert all(t.top_logprobs == [] for t in streamed)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None


def test_echo_and_prompt_logprobs_through_the_client(server, tokenizer):
    """Completions' `echo`: the text starts with the prompt's; with `logprobs`, the prompt's tokens come first, the
    first without a log probability and the others with the target's, whole and streamed (lm-eval's loglikelihood
    requests: token-id prompts, `echo`, `max_tokens` 0 or 1, `logprobs: 1`)."""
    client = server.client()
    prompt = repeating(9, 6)
    prompt_text = tokenizer.decode(prompt, skip_special_tokens=True)
    reference = prompt_reference(server.model, prompt)
    expected = solo(server.model, prompt, 5)
    # The answer's text continues the prompt's as decoding them together does: this tokenizer puts a space
    # between words, which the answer decoded alone does not start with.
    full = tokenizer.decode(prompt + expected, skip_special_tokens=True)

    alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = alone.choices[0]
    assert choice.text == prompt_text and choice.finish_reason == "length"
    assert alone.usage.completion_tokens == 0 and alone.usage.prompt_tokens == len(prompt)
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == prompt_text and len(logprobs.tokens) == len(prompt)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(logprobs.token_logprobs[1:]),
                               reference.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-4, rtol=0)
    for token, value, top, row in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:],
                                      reference):
        assert top[token] == value and 2 <= len(top) <= 3
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(prompt))]

    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                      logprobs=1)
    assert whole.choices[0].text == full and full != prompt_text + tokenizer.decode(expected)
    logprobs = whole.choices[0].logprobs
    assert "".join(logprobs.tokens) == full and len(logprobs.tokens) == len(prompt) + 5
    assert logprobs.token_logprobs[:len(prompt)] == pytest.approx(alone.choices[0].logprobs.token_logprobs, abs=1e-5)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == prompt_text and "".join(texts) == full
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    assert [v for lp in streamed for v in lp.token_logprobs] == logprobs.token_logprobs
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]

    words = "w5 w6 w7 w5 w6"
    plain = client.completions.create(model="tiny", prompt=words, max_tokens=4, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(words) and plain.choices[0].logprobs is None
    batch = client.completions.create(model="tiny", prompt=[prompt, prompt[:5]], max_tokens=1, temperature=0,
                                      echo=True, logprobs=1)
    assert [len(c.logprobs.token_logprobs) for c in batch.choices] == [len(prompt) + 1, 6]
    assert batch.choices[1].logprobs.token_logprobs[1:5] == pytest.approx(
        alone.choices[0].logprobs.token_logprobs[1:5], abs=1e-5)


def test_penalties_through_the_client(server):
    """`presence_penalty`, `frequency_penalty`, `logit_bias` (OpenAI's) and `repetition_penalty` (vLLM's, as an
    extra field), each equal to decoding with the reference formulas."""
    client = server.client()
    prompt = repeating(9, 6)
    asks = [({"frequency_penalty": 0.7, "logit_bias": {"9": 4.0}},
             SamplingParams(frequency_penalty=0.7, logit_bias={9: 4.0})),
            ({"presence_penalty": -2.0, "extra_body": {"repetition_penalty": 0.5}},
             SamplingParams(presence_penalty=-2.0, repetition_penalty=0.5))]
    for ask, params in asks:
        expected = penalized_greedy(server.model, prompt, 12, params)
        assert expected != solo(server.model, prompt, 12)  # the penalties change this answer
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, **ask)
        assert out.usage.completion_tokens == len(expected)
        assert out.choices[0].text == server.engine.tokenizer.decode(expected, skip_special_tokens=True)
    # vLLM's extra fields a benchmark client sends for fixed-length answers
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0, logit_bias={str(EOS): 100},
                                    extra_body={"ignore_eos": True, "min_tokens": 2, "repetition_penalty": 1.0})
    assert out.usage.completion_tokens == 7 and out.choices[0].finish_reason == "length"


def byte_tokenizer(fallback: bool):
    """A tokenizer whose tokens are bytes: byte-level BPE (GPT-2's spelling), or SentencePiece-style pieces with byte
    fallback (`<0xNN>` tokens for what the vocabulary lacks). Multi-byte characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_specdec.tokenizers import _byte_level_alphabet

    if fallback:
        vocab = {"<unk>": 0, "</s>": 1, "\u2581": 2, **{c: 3 + i for i, c in enumerate("abcdefghij")},
                 **{f"<0x{b:02X}>": 13 + b for b in range(256)}}
        backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                             decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # as Llama 2's
    else:
        vocab = {"</s>": 0, **{c: 1 + i for i, c in enumerate(sorted(_byte_level_alphabet()))}}
        backend = Tokenizer(models.BPE(vocab, []))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>" if fallback else None)


@pytest.mark.parametrize("fallback", [False, True])
def test_logprob_tokens_join_into_the_answer_where_characters_span_tokens(fallback):
    """A character of several byte tokens shows in the token that completes it, so the tokens' texts join into the
    answer (characters of several bytes in a row, a decoder that strips the text's leading space); each token's
    `bytes` are its own, joining into the answer's UTF-8; special tokens add nothing. Fed in pieces, as streamed
    deltas are."""
    from hf_specdec.serving.logprobs import TokenLogprobs

    tokenizer = byte_tokenizer(fallback)
    answer = "caf\u00e9 \U0001f642\U0001f642 d\u00e9j\u00e0 \u4e2d\u6587\u5b57 x"
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert len(ids) > len(answer) + 1  # characters did span tokens
    entries = [(-0.5, [(t, -0.5)]) for t in ids]
    for chat in (True, False):
        formatter, texts, spelled, named = TokenLogprobs(tokenizer, chat), [], b"", []
        for start in range(0, len(ids), 3):
            out = formatter.format(ids[start:start + 3], entries[start:start + 3])
            if chat:
                texts += [t["token"] for t in out["content"]]
                spelled += b"".join(bytes(t["bytes"]) for t in out["content"])
                assert all(t["top_logprobs"][0]["token"] == t["token"] for t in out["content"])
            else:
                texts += out["tokens"]
                named += [key for alternatives in out["top_logprobs"] for key in alternatives]
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(texts) == decoded == answer and texts[-1] == ""
        if chat:
            assert spelled == answer.encode("utf-8")
        else:  # an alternative that is part of a character is named by its bytes, as OpenAI names it
            assert any(key.startswith("bytes:\\x") for key in named)


def test_models_health_metrics(server):
    import httpx

    assert [m.id for m in server.client().models.list()] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_in_use",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "generation_tokens_per_second", "prefill_chunks_total"):
        assert f"hf_specdec:{name}" in text


@pytest.mark.parametrize("body, param", [
    ({"prompt": "w1", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "w1", "temperature": 7}, "temperature"),
    ({"prompt": "w1", "top_p": 0}, "top_p"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "w1", "n": 0}, "n"),
    ({"prompt": "w1", "stop": [1]}, "stop"),
    ({"prompt": "w1", "stop": ["w2"] * 33}, "stop"),
    ({"prompt": "w1", "logprobs": 21}, "logprobs"),
    ({"prompt": "w1", "logprobs": True}, "logprobs"),  # the completions API takes a count
    ({"prompt": "w1", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "w1 " * 100, "max_tokens": 100}, "max_tokens"),
    ({"prompt": "w1 " * 140, "max_tokens": 2}, "prompt"),  # the prompt alone fills the context: its fault
    ({"prompt": "w1", "top_k": -2}, "top_k"),
    ({"prompt": "w1", "min_p": 0.1}, "min_p"),
    ({"prompt": "w1", "skip_special_tokens": False}, "skip_special_tokens"),
    ({"prompt": "w1", "include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"prompt": "w1", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "w1", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "w1", "echo": 1}, "echo"),
    ({"prompt": "w1", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"prompt": "w1", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "w1", "frequency_penalty": "high"}, "frequency_penalty"),
    ({"prompt": "w1", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "w1", "repetition_penalty": 1e-40}, "repetition_penalty"),  # float32 0: positive logits to inf
    ({"prompt": "w1", "repetition_penalty": 1e39}, "repetition_penalty"),
    ({"prompt": "w1", "logit_bias": {"w5": 1}}, "logit_bias"),
    ({"prompt": "w1", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"prompt": "w1", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "w1", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "w1", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "w1", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "w1", "stream": True, "stream_options": [1]}, "stream_options"),
    ({"prompt": "w1", "stream": True, "stream_options": {"include_usage": "no"}}, "stream_options"),
    ({"prompt": "w1", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"prompt": ["w1"] * 5, "n": 3}, "n"),  # 15 sequences: more than 4 slots and 8 queued can ever take
    ({"prompt": ["w1"] * 13}, "prompt"),
])
def test_bad_requests_get_400_naming_the_field(server, body, param):
    import httpx

    response = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert httpx.post(server.url + "/v1/completions", content=b"{not json").status_code == 400
    assert httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": []}).json()[
        "error"]["param"] == "messages"
    assert httpx.post(server.url + "/v1/completions", json={"model": "other", "prompt": "w1"}).status_code == 404
    ok = server.client().completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1
    # nothing the refused request asked for runs on
    assert server.engine.num_running == 0 and server.engine.num_waiting == 0 and no_blocks_held(server.engine)


@pytest.mark.parametrize("extra, param", [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
                                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")])
def test_bad_chat_logprobs_get_400(server, extra, param):
    import httpx

    response = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_neutral_values_some_sdks_send_are_taken(server):
    import httpx

    response = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "w5", "max_tokens": 2,
                                                                 "logprobs": False})
    assert response.status_code == 200 and response.json()["choices"][0]["logprobs"] is None, response.text

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 2}
    for extra in ({"logit_bias": {}}, {"tools": []}, {"logprobs": False}, {"presence_penalty": 0},
                  {"modalities": ["text"]}, {"audio": None}, {"functions": []}, {"function_call": "none"},
                  {"verbosity": None}, {"prompt_cache_key": "k1"}, {"safety_identifier": "u1"}, {"min_p": 0},
                  {"skip_special_tokens": True}, {"include_stop_str_in_output": False}, {"use_beam_search": False},
                  {"top_k": -1}):
        response = httpx.post(server.url + "/v1/chat/completions", json={**chat, **extra})
        assert response.status_code == 200, (extra, response.text)
    for extra in ({"modalities": ["text", "audio"]}, {"audio": {"voice": "alloy"}}, {"function_call": "auto"},
                  {"functions": [{"name": "f", "parameters": {}}]}, {"verbosity": "low"}):
        response = httpx.post(server.url + "/v1/chat/completions", json={**chat, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == next(iter(extra)), response.text
    # The openai client sends `max_completion_tokens: null` beside `max_tokens`: null is no value
    response = httpx.post(server.url + "/v1/chat/completions", json={**chat, "max_tokens": 3,
                                                                      "max_completion_tokens": None})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] <= 3, response.text
    response = httpx.post(server.url + "/v1/chat/completions", json={**chat, "max_tokens": 50,
                                                                      "max_completion_tokens": 400})
    assert response.json()["error"]["param"] == "max_completion_tokens", response.text


@pytest.mark.parametrize("message", [
    {"role": "wizard", "content": "w5"},
    {"role": "user", "content": "w5", "name": "alice"},
    {"role": "assistant", "content": "w5", "tool_calls": [{"id": "x"}]},
])
def test_chat_messages_the_template_would_drop_are_refused(server, message):
    import httpx

    response = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": [message]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages", response.text


def test_chat_roles_developer_and_null_fields(server, tokenizer):
    """`developer` is sent as `system`; fields an SDK echoes back empty (refusal, tool_calls) are taken."""
    client = server.client()
    messages = [{"role": "developer", "content": "w7 w8"}, {"role": "user", "content": "w5 w6"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    same = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "w7 w8"},
                                                                  messages[1]], max_tokens=6, temperature=0)
    assert out.choices[0].message.content == same.choices[0].message.content
    echoed = [*messages, {"role": "assistant", "content": "w9", "refusal": None, "tool_calls": []},
              {"role": "user", "content": "w5"}]
    assert client.chat.completions.create(model="tiny", messages=echoed, max_tokens=2).choices
    # An assistant turn with content null is an empty one (as vLLM reads it); text parts join with newlines (as
    # vLLM joins them)
    silent = [messages[1], {"role": "assistant", "content": None}, {"role": "user", "content": "w5"}]
    empty = [messages[1], {"role": "assistant", "content": ""}, {"role": "user", "content": "w5"}]
    assert (client.chat.completions.create(model="tiny", messages=silent, max_tokens=6, temperature=0)
            .choices[0].message.content == client.chat.completions.create(
                model="tiny", messages=empty, max_tokens=6, temperature=0).choices[0].message.content)
    from hf_specdec.serving.prompts import chat_prompt

    parts = [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}, {"type": "text", "text": "w7"}]}]
    assert chat_prompt(parts, tokenizer) == chat_prompt([{"role": "user", "content": "w5 w6\nw7"}], tokenizer)


def test_chat_template_switches(server, tokenizer):
    """`continue_final_message` continues the assistant's last message (vLLM's field), `add_generation_prompt` and
    `chat_template_kwargs` reach the template; bad values are refused naming the field."""
    import httpx

    messages = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7 w8"}]
    prompt = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    out = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "continue_final_message": True, "max_tokens": 6, "temperature": 0,
        "chat_template_kwargs": {"unused_variable": 1}}).json()
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["choices"][0]["message"]["content"] == tokenizer.decode(solo(server.model, list(prompt), 6),
                                                                       skip_special_tokens=True)
    for extra, param in (({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"tools": [{"type": "function"}]}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"return_tensors": "pt"}}, "chat_template_kwargs"),
                         ({"continue_final_message": "yes"}, "continue_final_message"),
                         ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
                         ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs")):
        response = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                                          **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (extra, response.text)
    last_user = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": messages[:1], "continue_final_message": True})
    assert last_user.status_code == 400 and last_user.json()["error"]["param"] == "continue_final_message"


def test_model_route_and_openai_error_shapes(server):
    import httpx

    assert server.client().models.retrieve("tiny").id == "tiny"
    missing = httpx.get(server.url + "/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    for response in (httpx.get(server.url + "/v1/nothing"), httpx.get(server.url + "/v1/chat/completions")):
        assert response.status_code in (404, 405) and "message" in response.json()["error"], response.text


def test_json_mode(server, tokenizer, monkeypatch):
    pytest.importorskip("xgrammar")
    import httpx

    compiled_in = []
    compile_grammar = server.engine.compile_grammar

    def recording(grammar):
        compiled_in.append(threading.current_thread())
        return compile_grammar(grammar)

    monkeypatch.setattr(server.engine, "compile_grammar", recording)
    response = httpx.post(server.url + "/v1/completions", json={
        "model": "tiny", "prompt": [5, 6], "max_tokens": 4, "response_format": {"type": "json_object"}})
    # The word tokenizer cannot spell JSON: the grammar is refused before queueing, naming the field.
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"
    # compiled off the server's event loop (up to a second for a large schema), which streams the others meanwhile
    assert compiled_in and compiled_in[0] is not server.thread


def test_a_schema_constraint_the_grammar_would_drop_gets_400_naming_it(server):
    """`uniqueItems` (xgrammar compiles it without enforcing it): refused on the field that asked, naming the keyword
    and where it is, rather than answered with a grammar that could break the schema."""
    import httpx

    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                      "uniqueItems": True}}, "required": ["xs"]}
    for field, value in [("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                     "strict": True}}),
                         ("guided_json", schema)]:
        response = httpx.post(server.url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 4, field: value})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and "'uniqueItems' at #/properties/xs" in error["message"], error


def test_openai_parse_with_pydantic_models():
    """The `openai` client's `chat.completions.parse(response_format=Model)` (its strict schema of the model), whole
    and with n > 1 sampled and seeded: every choice parses into the model; a cut answer is `length`."""
    pytest.importorskip("xgrammar")
    openai = pytest.importorskip("openai")
    import enum
    from typing import Literal

    from pydantic import BaseModel, Field
    from test_structured import constrained_model, piece_tokenizer

    class Mood(str, enum.Enum):
        good = "good"
        bad = "bad"

    class Inner(BaseModel):
        ok: bool

    class Answer(BaseModel):
        kind: Literal["a", "b"]
        mood: Mood
        inner: Inner
        flags: list[bool] = Field(max_length=2)

    from tokenizers import decoders

    tokenizer = piece_tokenizer()
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # the pieces' text joined as they are, not with spaces
    tokenizer.chat_template = TEMPLATE
    engine = ServingEngine(constrained_model(), tokenizer, "ngram", num_speculative_tokens=4, max_batch_size=4)
    srv = Server(engine)
    try:
        client = srv.client()
        messages = [{"role": "user", "content": "a b"}]
        out = client.chat.completions.parse(model="tiny", messages=messages, response_format=Answer, temperature=0,
                                            max_tokens=150)
        assert isinstance(out.choices[0].message.parsed, Answer), out
        many = client.chat.completions.parse(model="tiny", messages=messages, response_format=Answer,
                                             temperature=1.0, seed=3, n=3, max_tokens=150)
        assert [c.index for c in many.choices] == [0, 1, 2]
        assert all(isinstance(c.message.parsed, Answer) for c in many.choices)
        with pytest.raises(openai.LengthFinishReasonError):
            client.chat.completions.parse(model="tiny", messages=messages, response_format=Answer, temperature=0,
                                          max_tokens=3)
    finally:
        srv.stop()


def test_vllm_structured_output_fields():
    """vLLM's `guided_choice`, `guided_regex`, `guided_json`, `guided_grammar` and `structured_outputs` ask for the
    grammar they name: each answer equals the engine's with that grammar (whose exactness the grammar tests check);
    two ways at once, or a malformed one, get a 400 naming the field."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("openai")
    import httpx

    from hf_specdec import Grammar
    from test_structured import SCHEMA, constrained_model, piece_tokenizer

    tokenizer = piece_tokenizer()
    tokenizer.chat_template = TEMPLATE
    engine = ServingEngine(constrained_model(), tokenizer, "ngram", num_speculative_tokens=4, max_batch_size=4)
    srv = Server(engine)
    try:
        client = srv.client()
        prompt = repeating(6, seed=41)

        def ask(**extra) -> str:
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                             extra_body=extra).choices[0].text

        def direct(grammar) -> str:
            out = engine.generate(prompt, max_tokens=40, grammar=grammar).request.output_ids
            return tokenizer.decode(out, skip_special_tokens=True)

        choices = ["ab", "bca", "cc"]
        assert ask(guided_choice=choices) == direct(Grammar.choice(choices))
        assert ask(guided_choice=choices).replace(" ", "") in choices
        assert ask(guided_regex="[a-c]{2,6}") == ask(structured_outputs={"regex": "[a-c]{2,6}"}) == direct(
            Grammar.regex("[a-c]{2,6}"))
        assert ask(guided_json=SCHEMA) == ask(structured_outputs={"json": SCHEMA}) == direct(
            Grammar.json_schema(SCHEMA))
        assert ask(guided_grammar='root ::= "a" ("b" | "c")+') == direct(Grammar.ebnf('root ::= "a" ("b" | "c")+'))
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a b"}],
                                              max_tokens=10, temperature=0, extra_body={"guided_choice": choices})
        assert chat.choices[0].message.content.replace(" ", "") in choices
        for body, param in [({"guided_regex": "[a-c]+", "guided_choice": ["a"]}, "guided_choice"),
                            ({"guided_regex": "[a-c]+", "response_format": {"type": "json_object"}}, "guided_regex"),
                            ({"guided_choice": []}, "guided_choice"), ({"guided_regex": 5}, "guided_regex"),
                            ({"guided_json": "{not json"}, "guided_json"),
                            ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
                            ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
                            ({"structured_outputs": "a"}, "structured_outputs"),
                            ({"guided_choice": ["\u2603"]}, "guided_choice")]:  # a choice it cannot spell
            response = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                                      "max_tokens": 4, **body})
            assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.text)
    finally:
        srv.stop()


def test_disconnect_mid_stream_frees_every_block(server):
    import httpx

    with httpx.stream("POST", server.url + "/v1/completions", json={
            "model": "tiny", "prompt": [9, 10, 11, 9, 10, 11], "max_tokens": 120, "temperature": 0,
            "stream": True}, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # the first chunk arrived: the request holds blocks; now the client goes away
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        metrics = httpx.get(server.url + "/metrics").text
        if "hf_specdec:kv_cache_blocks_in_use 0" in metrics and "hf_specdec:num_requests_running 0" in metrics:
            break
        time.sleep(0.05)
    assert "hf_specdec:kv_cache_blocks_in_use 0" in metrics
    assert no_blocks_held(server.engine)


def test_disconnect_while_waiting_for_a_whole_answer_cancels_it(server):
    """A non-streamed request whose client goes away is cancelled while it generates (a delta every step must not
    hide the disconnect), and its blocks are freed."""
    import httpx

    engine = server.engine
    prompt = next(p for p in (repeating(6, seed) for seed in range(50)) if EOS not in solo(server.model, p, 100))
    step = engine.scheduler.step

    def slow():  # steps slow enough that the answer takes seconds
        time.sleep(0.05)
        return step()

    engine.scheduler.step = slow
    try:
        before = engine.counters["cancelled"]
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 100,
                                                             "temperature": 0}, timeout=0.3)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (engine.counters["cancelled"] == before or engine.num_running):
            time.sleep(0.05)
        assert engine.counters["cancelled"] == before + 1 and engine.num_running == 0
        assert no_blocks_held(engine)
    finally:
        engine.scheduler.step = step


def test_load_leaves_nothing_behind(server):
    """64 concurrent streamed requests, then 200 in sequence: every response complete, no block held after, and the
    process's memory not grown past a bound."""
    import asyncio
    import resource

    import openai

    async def burst():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def one(i):
            chunks = [c async for c in await client.completions.create(
                model="tiny", prompt=repeating(6, i % 9), max_tokens=8, temperature=0, stream=True)]
            return chunks[-1].choices[0].finish_reason

        try:
            results = await asyncio.gather(*(one(i) for i in range(64)), return_exceptions=True)
        finally:
            await client.close()
        return results

    server.engine.max_queue = 64
    try:
        results = asyncio.run(burst())
    finally:
        server.engine.max_queue = 8
    assert all(r in ("stop", "length") for r in results), [r for r in results if not isinstance(r, str)][:3]
    client = server.client()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i in range(200):
        out = client.completions.create(model="tiny", prompt=repeating(5, i % 7), max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 200, grown_mib
    assert no_blocks_held(server.engine)


def test_api_key(tokenizer):
    pytest.importorskip("openai")
    import openai

    engine = ServingEngine(served_model(), tokenizer, "ngram", max_batch_size=2)
    srv = Server(engine, api_key="sesame")
    try:
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        import httpx

        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert [m.id for m in srv.client(api_key="sesame").models.list()] == ["tiny"]
        # every route but the probe and the scraper needs the key
        assert httpx.get(srv.url + "/health").status_code == 200 and httpx.get(srv.url + "/metrics").status_code == 200
        assert httpx.get(srv.url + "/docs").status_code == 401
    finally:
        srv.stop()


def test_api_key_holds_under_a_mount_prefix(tokenizer):
    """`create_app` mounted under a prefix (a root path): its routes still need the key."""
    import asyncio

    import httpx
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from hf_specdec.serving.server import create_app

    engine = ServingEngine(served_model(), tokenizer, "ngram", max_batch_size=2).start()
    outer = Starlette(routes=[Mount("/api", app=create_app(engine, "tiny", "sesame"))])

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=outer), base_url="http://test") as client:
            refused = await client.get("/api/v1/models")
            allowed = await client.get("/api/v1/models", headers={"Authorization": "Bearer sesame"})
            return refused.status_code, allowed.status_code

    try:
        assert asyncio.run(ask()) == (401, 200)
    finally:
        engine.shutdown()


def test_queue_full_gets_503(tokenizer):
    pytest.importorskip("openai")
    import httpx

    engine = ServingEngine(served_model(eos=None), tokenizer, "ngram", max_batch_size=1, max_queue=0)
    step = engine.scheduler.step
    engine.scheduler.step = lambda: time.sleep(0.1) or step()  # the busy request stays busy while the test asks
    srv = Server(engine)
    try:
        with httpx.stream("POST", srv.url + "/v1/completions", json={
                "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 100, "stream": True}, timeout=30) as busy:
            next(busy.iter_lines())
            response = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": [5], "max_tokens": 2})
            assert response.status_code == 503
            assert "queue is full" in response.json()["error"]["message"]
    finally:
        srv.stop()


@pytest.mark.slow  # a server process, signalled
@pytest.mark.parametrize("grace", [1.0, 0.0])
def test_sigterm_shuts_down_cleanly(tmp_path, grace):
    """A server process: SIGTERM while a request streams ends the stream properly and the process without error,
    whether the request finishes within the grace period or is cancelled when it ends (grace 0: at once)."""
    pytest.importorskip("uvicorn")
    import os
    import signal
    import subprocess
    import sys

    import httpx

    port = free_port()
    script = tmp_path / "serve.py"
    script.write_text(
        "import sys; sys.path.insert(0, %r)\n"
        "from test_serving import served_model, word_tokenizer\n"
        "from hf_specdec.serving import ServingEngine\n"
        "from hf_specdec.serving.server import serve\n"
        "engine = ServingEngine(served_model(eos=None), word_tokenizer(), 'ngram', max_batch_size=2)\n"
        "serve(engine, 'tiny', port=%d, shutdown_grace_s=%r, log_level='warning')\n" % (
            os.path.dirname(__file__), port, grace))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(__file__)}
    process = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and process.poll() is None, process.stdout.read().decode()
            time.sleep(0.1)
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={
                "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 180, "stream": True}, timeout=30) as response:
            lines = response.iter_lines()
            next(lines)
            process.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]" or any('"finish_reason"' in line for line in rest)
        if grace == 0.0:  # cancelled, and said so: the stream ends with a finish reason before its 180 tokens
            assert sum('"text"' in line for line in rest) < 180
            assert any('"finish_reason":"stop"' in line.replace(" ", "") for line in rest), rest[-3:]
        # uvicorn shuts down gracefully, then re-raises the signal it caught: the exit status says SIGTERM.
        assert process.wait(timeout=30) in (0, -signal.SIGTERM)
        output = process.stdout.read().decode()
        assert "Traceback" not in output, output
    finally:
        if process.poll() is None:
            process.kill()


# --- offline batch work: generate_batch and the pipeline over a dataset -------------------------------------------

def test_generate_batch_refills_slots_and_equals_generate():
    from hf_specdec import generate_batch

    model = served_model()
    prompts = [repeating(4 + i % 5, seed=20 + i) for i in range(9)]
    out = generate_batch(model, prompts, "ngram", max_new_tokens=10, max_batch_size=3)
    assert out == [solo(model, p, 10) for p in prompts]
    first = generate_batch(model, prompts[:4], "ngram", max_new_tokens=6, max_batch_size=2, do_sample=True, seed=7)
    again = generate_batch(model, prompts[:4], "ngram", max_new_tokens=6, max_batch_size=4, do_sample=True, seed=7)
    assert first == again  # each prompt draws from its own seeded stream, whatever shares its steps


def test_usage_at_a_stop_string_ending_in_a_character_cut_between_tokens():
    """A stop string whose last character's bytes span tokens: the count includes every one of its tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_specdec.serving.stops import tokens_past

    vocab = {"<pad>": 0, "a": 1, "b": 2, "x": 3, "\u00c3": 4, "\u00a9": 5}  # "é" is bytes c3 a9
    backend = Tokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")
    output = [1, 2, 4, 5, 3]
    assert tokenizer.decode(output) == "ab\u00e9x" and "\ufffd" in tokenizer.decode(output[:3])
    assert tokens_past(tokenizer, output, 3, 2, "\u00e9") == 1  # "x" only: both bytes of the é are kept


def test_seeded_grammar_request_does_not_depend_on_the_drafts():
    """A seeded JSON-schema request sampled with a draft model's sampled drafts (some of them forbidden by the
    schema: the target's residual would be drawn there by rejection sampling) equals the same request with
    speculation off."""
    pytest.importorskip("xgrammar")
    from hf_specdec import Grammar
    from test_structured import SCHEMA, constrained_model, piece_tokenizer

    tokenizer, model = piece_tokenizer(), constrained_model()

    def run(spec, k):
        engine = ServingEngine(model, tokenizer, spec, num_speculative_tokens=k, max_batch_size=2,
                               schedule="constant").start()
        try:
            outs = [engine.generate(repeating(6, seed=50 + i), max_tokens=30, grammar=Grammar.json_schema(SCHEMA),
                                    sampling=SamplingParams(1.0, seed=11 + i)).request.output_ids for i in range(4)]
            return outs, engine.metrics.num_draft_tokens
        finally:
            engine.shutdown()

    off, _ = run("ngram", 0)
    drafted, num_drafts = run(constrained_model(seed=3), 3)
    assert num_drafts > 0 and drafted == off


def test_a_grammar_dead_end_fails_its_request_alone():
    """A grammar the tokenizer cannot spell past its start (a constant with a character outside the vocabulary) ends
    its own request with that error once it gets there; the requests beside it run on to what they give alone, and
    the engine serves on."""
    pytest.importorskip("xgrammar")
    from hf_specdec import Grammar
    from test_structured import constrained_model, piece_tokenizer

    stuck = Grammar.json_schema({"type": "object", "properties": {"a": {"const": "\u2603"}}, "required": ["a"]})
    tokenizer = piece_tokenizer()
    engine = ServingEngine(constrained_model(), tokenizer, "ngram", num_speculative_tokens=4, max_batch_size=4).start()
    try:
        free = [repeating(6 + i, seed=60 + i) for i in range(2)]
        alone = [engine.generate(p, max_tokens=24).request.output_ids for p in free]
        streams = [engine.submit(free[0], 24), engine.submit(repeating(5, seed=70), 24, grammar=stuck),
                   engine.submit(free[1], 24)]
        for stream in streams[::2]:
            for _ in stream:
                pass
        with pytest.raises(RequestError, match="cannot spell") as refused:
            for _ in streams[1]:
                pass
        assert refused.value.param == "response_format"
        assert [s.request.output_ids for s in streams[::2]] == alone
        assert engine.generate(free[0], max_tokens=24).request.output_ids == alone[0]
        assert engine.num_running == 0 and no_blocks_held(engine)
    finally:
        engine.shutdown()


def test_pipeline_runs_a_dataset_with_continuous_batching():
    from transformers import GenerationConfig, pipeline

    from conftest import make_tokenizer, word_prompt

    model, tokenizer = served_model(), make_tokenizer()
    model.generation_config.eos_token_id = None
    stock = pipeline("text-generation", model=make_model("llama"), tokenizer=tokenizer)
    ours = pipeline("speculative-text-generation", model=model, tokenizer=tokenizer, assistant="ngram")
    prompts = [word_prompt(i, 4 + i % 6) for i in range(7)]
    expected = [stock(p, max_new_tokens=9, do_sample=False) for p in prompts]
    produced = ours((p for p in prompts), batch_size=3, max_new_tokens=9, do_sample=False)
    assert not isinstance(produced, list)  # a generator in, results streamed out in order
    assert list(produced) == expected
    assert isinstance(ours._continuous_plan(dict(max_new_tokens=9, do_sample=False)), dict)  # it ran continuously
    assert ours._continuous_plan(dict(max_new_tokens=9, no_repeat_ngram_size=2)) == ["no_repeat_ngram_size"]
    # the settings generate would use: transformers' top-k 50 when sampling, the model's own options counted too
    assert ours._continuous_plan(dict(max_new_tokens=9, do_sample=True))["top_k"] == 50
    model.generation_config.no_repeat_ngram_size = 2
    try:
        assert ours._continuous_plan(dict(max_new_tokens=9)) == ["no_repeat_ngram_size"]
        assert ours._continuous_plan(dict(generation_config=GenerationConfig(max_new_tokens=9))) == [
            "no_repeat_ngram_size"]
    finally:
        model.generation_config.no_repeat_ngram_size = None
    # Chats, as the stock pipeline takes them
    chats = [[{"role": "user", "content": p}] for p in prompts[:4]]
    assert ours(chats, batch_size=2, max_new_tokens=6, do_sample=False) == [
        stock(c, max_new_tokens=6, do_sample=False) for c in chats]
    # A repetition penalty runs continuously too (transformers' formula), equal to the stock pipeline's
    assert isinstance(ours._continuous_plan(dict(max_new_tokens=9, repetition_penalty=1.3)), dict)
    for value in (1000.0, 0.001, 2):  # outside our bounds, or an int transformers refuses: the stock batches decide
        assert ours._continuous_plan(dict(max_new_tokens=9, repetition_penalty=value)) == ["repetition_penalty"]
    penalised = ours(prompts, batch_size=2, max_new_tokens=6, do_sample=False, repetition_penalty=1.3)
    assert penalised == [stock(p, max_new_tokens=6, do_sample=False, repetition_penalty=1.3) for p in prompts]
    assert penalised != [stock(p, max_new_tokens=6, do_sample=False) for p in prompts]
    # Options continuous batching does not take, by keyword or in a generation config: the stock batches run, with
    # speculation, and the option takes effect
    blocked = ours(prompts, batch_size=2, max_new_tokens=6, do_sample=False, no_repeat_ngram_size=1)
    assert blocked == [stock(p, max_new_tokens=6, do_sample=False, no_repeat_ngram_size=1) for p in prompts]
    config = GenerationConfig(max_new_tokens=6, do_sample=False, suppress_tokens=[4, 5, 6, 7, 8, 9, 10])
    assert ours(prompts, batch_size=2, generation_config=config) == [
        stock(p, generation_config=config) for p in prompts]
    # Sampling repeats under torch.manual_seed (each request seeded from the global generator, in input order)
    torch.manual_seed(3)
    first = ours(prompts, batch_size=3, max_new_tokens=6, do_sample=True, temperature=1.0)
    torch.manual_seed(3)
    assert ours(prompts, batch_size=2, max_new_tokens=6, do_sample=True, temperature=1.0) == first


def test_pipeline_options_given_at_construction_reach_continuous_batching():
    """Options the pipeline was built with (`return_full_text`, `num_speculative_tokens`) hold with batch_size as
    they do one prompt at a time."""
    from transformers import pipeline

    from conftest import make_tokenizer, word_prompt

    model, tokenizer = served_model(), make_tokenizer()
    model.generation_config.eos_token_id = None
    stock = pipeline("text-generation", model=make_model("llama"), tokenizer=tokenizer, return_full_text=False)
    ours = pipeline("speculative-text-generation", model=model, tokenizer=tokenizer, assistant="ngram",
                    return_full_text=False, num_speculative_tokens=2)
    prompts = [word_prompt(i, 5 + i) for i in range(4)]
    plan = ours._continuous_plan(dict(max_new_tokens=6, do_sample=False))
    assert isinstance(plan, dict) and plan["k"] == 2 and plan["postprocess"].get("return_type") is not None
    assert ours(prompts, batch_size=2, max_new_tokens=6, do_sample=False) == [
        stock(p, max_new_tokens=6, do_sample=False) for p in prompts]


def test_grammar_requests_join_a_running_batch_exactly():
    """JSON-schema and regex requests arriving while free ones run: each equals plain constrained `generate` (xgrammar's
    own processor), and the free ones their solo runs."""
    pytest.importorskip("xgrammar")
    from hf_specdec import Grammar
    from test_structured import EOS as GRAMMAR_EOS
    from test_structured import SCHEMA, constrained_model, piece_tokenizer, reference

    tokenizer = piece_tokenizer()
    model = constrained_model()
    twin = constrained_model()
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=4, max_batch_size=3).start()
    try:
        free = [engine.submit(repeating(6 + i, seed=30 + i), 16) for i in range(2)]
        next(iter(free[0]))
        grammars = [Grammar.json_schema(SCHEMA), Grammar.regex("[a-c]{2,6}"), Grammar.json_schema(SCHEMA)]
        prompts = [repeating(5 + 2 * i, seed=40 + i) for i in range(3)]
        # the server's way for the last: compiled and checked first (off its event loop), then submitted as it is
        checked = engine.compile_grammar(grammars[2])
        constrained = [engine.submit(p, 40, grammar=g) for p, g in zip(prompts[:2], grammars[:2])]
        engine.compile_grammar = None  # not called again: submit takes the checked grammar as it is
        constrained.append(engine.submit(prompts[2], 40, grammar=checked))
        del engine.compile_grammar
        for stream in free + constrained:
            for _ in stream:
                pass
    finally:
        engine.shutdown()
    for prompt, grammar, stream in zip(prompts, grammars, constrained):
        expected = reference(twin, tokenizer, [grammar], torch.tensor([prompt]), torch.ones(1, len(prompt),
                                                                                         dtype=torch.long), 40)
        tokens = expected[0, len(prompt):].tolist()
        tokens = tokens[: tokens.index(GRAMMAR_EOS) + 1] if GRAMMAR_EOS in tokens else tokens
        assert stream.request.output_ids == tokens
    assert engine.metrics.num_grammar_tokens > 0


def test_a_failing_step_fails_its_requests_and_the_server_runs_on(tokenizer):
    model = served_model(eos=None)
    engine = ServingEngine(model, tokenizer, "ngram", max_batch_size=2, warmup=False)
    original, calls = engine.scheduler.step_fn.__call__, []

    class Failing:
        def __getattr__(self, name):
            return getattr(engine.step, name)

        def __call__(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("simulated failure in a step")
            return original(*args, **kwargs)

    engine.scheduler.step_fn = Failing()
    engine.start()
    try:
        doomed = engine.submit(repeating(6, 1), 20)
        with pytest.raises(RuntimeError, match="simulated failure"):
            for _ in doomed:
                pass
        assert no_blocks_held(engine)
        after = engine.generate(repeating(6, 2), max_tokens=6)
        assert after.request.output_ids == solo(model, repeating(6, 2), 6)
    finally:
        engine.shutdown()


def test_serve_warm_up_flag():
    import hf_specdec.cli

    parse = hf_specdec.cli.build_parser().parse_args
    assert parse(["serve"]).warm_up is None  # the engine decides: on for CUDA
    assert parse(["serve", "--no-warm-up"]).warm_up is False and parse(["serve", "--warm-up"]).warm_up is True
