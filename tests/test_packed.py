"""The packed (varlen) step layout: rows of different widths go through the model as one stream of real tokens
(`layout.PackedLayout`), so a row feeding 1 token does not pay for another's 8 in every linear layer.

Packed and padded steps must give the same logits and hidden states; generation stays the target's own; models
that cannot take the packed stream keep the padded layout; adaptive k prices a packed verify by the tokens fed."""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import ARCHITECTURES, VOCAB, make_model, ragged_batch
from hf_specdec.runners import model_runner
from hf_specdec.costs.adaptive import AdaptiveK
from hf_specdec.costs.step_cost import StepCost
from hf_specdec.decode.logits import LogitsProcessing
from hf_specdec.kernels import rejection_sample as rejection_sample_module
from hf_specdec.kernels.rejection_sample import rejection_sample_reference
from hf_specdec.runners.support import check_model_supported
from hf_specdec.runners.model_runner import ModelRunner, paged_attention


def _steps(seed: int, rows: int, vocab: int, joins: bool = False):
    """Ragged steps as the engine feeds them: a prompt each, then 1 to 5 tokens per row per step. `joins`: then a
    longer stretch fed by one row beside the others' one or two (a newcomer's prompt beside a verify), which the
    PyTorch attention takes as two groups of rows (`layout.query_groups`)."""
    g = torch.Generator().manual_seed(seed)
    steps = [[int(n) for n in torch.randint(1, 12, (rows,), generator=g)]]
    steps += [[int(n) for n in torch.randint(1, 6, (rows,), generator=g)] for _ in range(3)]
    if joins:
        steps += [[1, 1, 12][:rows], [14, 1, 2][:rows], [2, 1, 2][:rows]]
    return [(counts, torch.randint(2, vocab, (rows, max(counts)), generator=g)) for counts in steps]


def _three_rows(model, packed: bool) -> ModelRunner:
    runner = ModelRunner(model, packed=packed)
    for row in range(3):
        runner.add_sequence(row)
    return runner


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_packed_steps_give_the_padded_logits_and_hidden_states(arch, monkeypatch):
    model = make_model(arch)
    check_model_supported(model, "target model")
    assert model._hf_specdec_packable
    from hf_specdec.cache import paged as paged_cache

    grouped, query_groups = [], paged_cache.query_groups  # (patched where `plan_step` looks it up)
    monkeypatch.setattr(paged_cache, "query_groups", lambda *a: grouped.append(query_groups(*a)) or grouped[-1])
    outputs = {}
    with torch.no_grad(), paged_attention(model):
        for packed in (False, True):
            runner = _three_rows(model, packed)
            outputs[packed] = []
            for counts, ids in _steps(seed=7, rows=3, vocab=model.config.vocab_size, joins=True):
                out = runner.forward([0, 1, 2], ids, counts, num_logits=3, output_hidden_states=True)
                # Only each row's real positions count: padding's logits are never read.
                for row, n in enumerate(counts):
                    real = min(n, 3)
                    outputs[packed].append(out.logits[row, 3 - real:])
                    width = ids.shape[1]
                    outputs[packed].extend(h[row, width - n:] for h in out.hidden_states)
            if packed:
                assert runner.num_packed_forwards == 7  # every step had rows of different widths
            else:
                assert runner.num_packed_forwards == 0
    assert sum(g is not None for g in grouped) >= 2  # the joining steps' attention ran in two groups
    assert len(outputs[True]) == len(outputs[False])
    for got, expected in zip(outputs[True], outputs[False]):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


def test_committed_states_picked_from_the_packed_stream_equal_the_padded_ones():
    """A packed step leaves the hidden states a speculator reads as its stream (`packed_states=True`); the
    committed ones are picked from it row after row (`TargetHiddenStates.ragged`), never padded to the widest row
    (a newcomer's prompt): each row's states, its newest, and the padded path's, equal."""
    model = make_model("llama")
    layers = (1, 2)
    with torch.no_grad(), paged_attention(model):
        states = {}
        for packed_states in (False, True):
            runner = _three_rows(model, True)
            states[packed_states] = []
            for counts, ids in _steps(seed=3, rows=3, vocab=model.config.vocab_size, joins=True):
                out = runner.forward([0, 1, 2], ids, counts, num_logits=1, output_hidden_states=layers,
                                     packed_states=packed_states)
                assert getattr(out, "states_packed", False) == packed_states
                committed = [max(0, n - 1 - (i % 2)) for i, n in enumerate(counts)]  # a rejected draft or two
                states[packed_states].append(model_runner.committed_hidden_states(
                    out.hidden_states, layers, [0, 1, 2], counts, [0, 0, 0], committed,
                    getattr(out, "states_packed", False)))
    for padded, ragged in zip(states[False], states[True]):
        assert ragged.ragged and not padded.ragged
        assert ragged.states.shape[0] == sum(padded.num_states)  # no padding made
        for i in range(3):
            torch.testing.assert_close(ragged.row(i), padded.row(i), atol=1e-10, rtol=1e-10)
        has = torch.tensor(padded.num_states) > 0
        torch.testing.assert_close(ragged.newest()[has], padded.newest()[has], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_a_row_per_token_gives_the_padded_logits_and_hidden_states(arch, monkeypatch):
    """Token rows (every token of a packed step its own attention row, one query over its row's context up to
    itself) give what the padded layout gives, sliding windows and mixed layer types included."""
    from hf_specdec.cache import paged as paged_cache

    model = make_model(arch)
    check_model_supported(model, "target model")
    layouts = []
    plan_step = paged_cache.PagedKVCache.plan_step
    monkeypatch.setattr(paged_cache.PagedKVCache, "plan_step",
                        lambda self, *a, **k: layouts.append(plan_step(self, *a, **k).packed) or self.plan)
    outputs = {}
    with torch.no_grad(), paged_attention(model):
        for token_rows in (None, True):
            runner = _three_rows(model, packed=token_rows is True)
            runner.cache.token_rows = token_rows
            outputs[token_rows] = []
            for counts, ids in _steps(seed=3, rows=3, vocab=model.config.vocab_size):
                out = runner.forward([0, 1, 2], ids, counts, num_logits=3, output_hidden_states=True)
                for row, n in enumerate(counts):
                    outputs[token_rows].append(out.logits[row, 3 - min(n, 3):])
                    outputs[token_rows].extend(h[row, ids.shape[1] - n:] for h in out.hidden_states)
    assert sum(layout is not None and layout.token_rows is not None for layout in layouts) == 4
    for got, expected in zip(outputs[True], outputs[None], strict=True):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


def test_token_rows_are_taken_where_few_rows_verify_a_few_drafts():
    from hf_specdec.cache.layout import token_rows_pay

    smollm2 = dict(num_context=300, kv_width=3 * 64)
    # One row of 12 verifying 2 drafts: otherwise a second attention group, which copies that row's context anyway.
    assert token_rows_pay([3] + [1] * 11) and token_rows_pay([3] + [1] * 11, 8192, 8 * 128)
    assert token_rows_pay([2, 2, 2] + [1] * 9, **smollm2) and not token_rows_pay([2, 2, 2, 2] + [1] * 9, **smollm2)
    assert token_rows_pay([3, 1, 1, 1], **smollm2) and not token_rows_pay([4, 1, 1, 1], **smollm2)
    # Few rows that would attend as one padded group: not over long contexts (each extra token gathers one more),
    # nor before the pools exist (kv width unknown).
    assert not token_rows_pay([3, 1], num_context=2048, kv_width=8 * 128) and not token_rows_pay([3, 1, 1, 1])
    assert not token_rows_pay([1] * 8, **smollm2)  # nothing to verify: the plain layout
    assert not token_rows_pay([40] + [1] * 11, **smollm2)  # a newcomer's prompt: its context gathered 40 times


@pytest.mark.parametrize("speculator", ["ngram", "draft"])
def test_generation_on_token_rows_is_the_targets_own(speculator, monkeypatch):
    from hf_specdec.cache import paged as paged_cache
    from hf_specdec.cache.layout import PackedLayout
    from hf_specdec.decode.engine import SpeculativeEngine

    monkeypatch.setattr(paged_cache.PagedKVCache, "token_rows", True)  # every packed step, whatever it feeds
    monkeypatch.setattr(SpeculativeEngine, "REGION_MAX_NEW_TOKENS", 0)  # contexts gathered, not read in place
    built = []
    from_parts = PackedLayout.from_parts
    monkeypatch.setattr(PackedLayout, "from_parts",
                        lambda *a, **k: built.append(from_parts(*a, **k)) or built[-1])
    target = make_model("mistral")
    input_ids, mask = ragged_batch(rows=4, width=14)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    draft = "ngram" if speculator == "ngram" else make_model("mistral", seed=1)
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False, speculator=draft,
                          num_speculative_tokens=3, speculative_schedule="constant")
    assert torch.equal(out, expected)
    assert any(layout.token_rows is not None for layout in built)


@pytest.mark.parametrize("token_rows", [None, True])
def test_context_slots_from_the_host_or_from_the_device_tables_plan_the_same_step(token_rows, monkeypatch):
    """A step's plan with each row's context slots computed on the host (a CPU) equals the plan an accelerator builds
    from its block tables, token rows included, and so does the output."""
    from hf_specdec.cache import paged as paged_cache

    monkeypatch.setattr(paged_cache.PagedKVCache, "token_rows", token_rows)
    plans = {}
    original = paged_cache.PagedKVCache.plan_step

    def spy(self, *args, **kwargs):
        plan = original(self, *args, **kwargs)
        plans.setdefault(self.host_slots, []).append(plan)
        return plan

    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=4, width=14)
    target.generate(input_ids, attention_mask=mask, max_new_tokens=2, do_sample=False, speculator="ngram")  # trial
    monkeypatch.setattr(paged_cache.PagedKVCache, "plan_step", spy)
    outputs = []
    for host_slots in (True, False):
        monkeypatch.setattr(paged_cache.PagedKVCache, "host_slots", host_slots)
        outputs.append(target.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                       speculator="ngram", num_speculative_tokens=3, speculative_schedule="constant"))
    assert torch.equal(outputs[0], outputs[1])
    assert len(plans[True]) == len(plans[False]) > 1
    for host, device in zip(plans[True], plans[False]):
        for name in ("write_slots", "block_tables", "query_positions", "context_lens", "context_slots"):
            assert torch.equal(getattr(host, name), getattr(device, name)), name
        assert (host.packed is None) == (device.packed is None)
        if host.packed is not None:
            assert torch.equal(host.packed.pack_index, device.packed.pack_index)
    if token_rows:
        assert any(p.packed is not None and p.packed.token_rows is not None for p in plans[False])


@pytest.mark.parametrize("speculator", ["ngram", "draft"])
def test_generation_with_packed_steps_is_the_targets_own(speculator, monkeypatch):
    runners = []
    original = ModelRunner.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        runners.append(self)

    monkeypatch.setattr(ModelRunner, "__init__", spy)
    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=4, width=14)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    draft = "ngram" if speculator == "ngram" else make_model("llama", seed=1)
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False, speculator=draft,
                          num_speculative_tokens=3, speculative_schedule="constant", return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    engine_runner = next(r for r in runners if r.model is target and r.cache.manager.num_blocks >= 64)
    assert engine_runner.packed and engine_runner.num_packed_forwards > 0


@pytest.mark.parametrize("mode", ["greedy", "processed", "sampled"])
def test_a_packed_verify_leaves_its_logits_packed(mode, monkeypatch):
    """Nothing but the verify reading the scores: a packed verify's logits stay `[1, K, vocab]` and are read through
    `logit_index` (a step whose rows all feed as many tokens is not packed). Greedy alone reads their argmax; with a
    logits processor (here one reading each position's history) the processor runs once per kept position, not on
    `[rows, k + 1]` entries padded to the widest row; sampled, the rejection rule reads the packed probabilities
    through the index too. The output is the target's own (sampling with top-k 1: its greedy output)."""
    seen, processed_entries, packed_rule = [], [], []
    forward, process = ModelRunner.forward, LogitsProcessing.__call__

    def spy(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if kwargs.get("logit_counts") is not None:
            seen.append((getattr(out, "logit_index", None) is not None, sum(kwargs["logit_counts"]),
                         len(kwargs["logit_counts"]) * kwargs["num_logits"]))
        return out

    def count(self, token_ids, rows, history_lens, scores, *args, **kwargs):
        processed_entries.append(len(scores))
        return process(self, token_ids, rows, history_lens, scores, *args, **kwargs)

    def rule(*args, **kwargs):
        packed_rule.append(args[-1] is not None)
        return rejection_sample_reference(*args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", spy)
    monkeypatch.setattr(LogitsProcessing, "__call__", count)
    monkeypatch.setattr(rejection_sample_module, "rejection_sample_reference", rule)
    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=4, width=14)
    extra = {"greedy": {}, "processed": dict(repetition_penalty=1.3), "sampled": dict(do_sample=True, top_k=1)}[mode]
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                               **(extra if mode == "processed" else {}))
    processed_entries.clear()
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=16, speculator="ngram",
                          num_speculative_tokens=3, speculative_schedule="constant", **{"do_sample": False, **extra})
    assert torch.equal(out, expected)
    assert any(packed and kept < padded for packed, kept, padded in seen)  # rows verifying fewer than the widest
    if mode == "greedy":
        assert not processed_entries and not packed_rule
    else:  # a packed step's processor sees one entry per kept position, a padded step's every entry
        assert processed_entries == [kept if packed else padded for packed, kept, padded in seen]
    if mode == "sampled":
        assert packed_rule == [packed for packed, _, _ in seen]


def test_nan_logits_in_a_packed_verify_are_refused(monkeypatch):
    """A NaN at one kept position of a packed verify's logits (left packed) stops the call, naming its row."""
    forward = ModelRunner.forward
    spoiled = []

    def spoil(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        index = getattr(out, "logit_index", None)
        if index is not None and not spoiled:
            position = int(index.view(len(args[0]), -1)[1, 0])  # the second row's first kept position
            out.logits[0, position, 0] = float("nan")
            spoiled.append(args[0][1])
        return out

    monkeypatch.setattr(ModelRunner, "forward", spoil)
    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=3, width=12)
    with pytest.raises(FloatingPointError, match="NaN or inf logits") as error:
        target.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, speculator="ngram",
                        num_speculative_tokens=3, speculative_schedule="constant")
    assert spoiled and f"rows [{spoiled[0]}]" in str(error.value)


def test_the_padded_layout_can_be_forced_and_gives_the_same_output(monkeypatch):
    target = make_model("mistral")
    input_ids, mask = ragged_batch(rows=3, width=16)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, speculator="ngram",
                  speculative_schedule="constant")
    packed = target.generate(input_ids, **kwargs)
    monkeypatch.setenv("HF_SPECDEC_PACKED", "0")
    assert not model_runner.packs(target)
    assert torch.equal(target.generate(input_ids, **kwargs), packed)


def test_a_model_that_cannot_take_the_packed_stream_keeps_the_padded_layout():
    """A model that refuses a tensor `logits_to_keep` (or gives other logits packed) still runs, padded."""
    target = make_model("llama")
    forward = target.forward

    @functools.wraps(forward)
    def no_tensor_logits_to_keep(*args, logits_to_keep=0, **kwargs):
        if isinstance(logits_to_keep, torch.Tensor):
            raise TypeError("logits_to_keep must be an int")
        return forward(*args, logits_to_keep=logits_to_keep, **kwargs)

    target.forward = no_tensor_logits_to_keep
    input_ids, mask = ragged_batch(rows=3, width=12)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False, speculator="ngram",
                          speculative_schedule="constant")
    assert target._hf_specdec_trial_passed and not target._hf_specdec_packable
    assert torch.equal(out, expected)


def test_adaptive_k_prices_a_packed_verify_by_the_tokens_fed():
    """One row of eight offers 4 drafts. Padded, every row would feed 5 tokens; packed, the step feeds 12 instead
    of 8, which a curve rising steeply past 8 tokens makes worth it only packed."""
    cost = StepCost(per_row=0.0, points=((1, 10.0), (8, 10.0), (12, 12.0), (40, 60.0)))
    offered = [4] + [0] * 7
    padded = AdaptiveK(8, 4, cost, priors=(0.9,))
    packed = AdaptiveK(8, 4, cost, priors=(0.9,), packed=True)
    assert padded.choose(list(range(8)), offered, [0] * 8) == 0
    assert packed.choose(list(range(8)), offered, [0] * 8) == 4


def _speculator(kind: str, target, tmp_path):
    if kind == "ngram":
        return "ngram"
    if kind == "draft":
        return make_model("llama", seed=1)
    from hf_specdec import EagleSpeculator, HybridSpeculator, MedusaSpeculator
    if kind in ("eagle", "hybrid"):
        from test_eagle import convert  # a random-init EAGLE-1 checkpoint for the target, converted

        head = EagleSpeculator.from_pretrained(convert(tmp_path, target, 1))
        return head if kind == "eagle" else HybridSpeculator(head, head_tokens=3)
    from test_heads_mlp_medusa import convert_reference, medusa_reference

    return MedusaSpeculator.from_pretrained(convert_reference(tmp_path, target, *medusa_reference()))


@pytest.mark.parametrize("speculator", ["ngram", "draft", "eagle", "hybrid", "medusa"])
def test_rows_joining_a_running_batch_are_prefilled_inside_the_others_verify(speculator, monkeypatch, tmp_path):
    """With packed steps a newcomer's prompt costs the running rows nothing in width, so it goes into their verify
    instead of a step of its own; every request still gets exactly its solo greedy output. Heads that draft from the
    target's states (EAGLE, Medusa) propose nothing for the newcomer in that step, which has no states yet, and draft
    for the others. With the padded layout (`HF_SPECDEC_PACKED=0`) the same requests get prefill-only steps, so the
    count below can fail."""
    from hf_specdec import ServingEngine
    from hf_specdec.decode.step import Step

    target = make_model("llama")
    draft = _speculator(speculator, target, tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (int(n),), generator=g).tolist() for n in (9, 4, 13, 6, 11)]
    expected = [target.generate(torch.tensor([p]), max_new_tokens=8 + 3 * i, do_sample=False)[0, len(p):].tolist()
                for i, p in enumerate(prompts)]
    original, original_propose = Step.__call__, Step._propose
    prefill_only, drafts_beside_newcomers = [], []

    def spy(self, batch, *args, **kwargs):
        prefill_only.append(not self.drafting)
        return original(self, batch, *args, **kwargs)

    def propose_spy(self, batch, budget):
        draft, classes, fed = original_propose(self, batch, budget)
        assert fed == draft.num_tokens.tolist()
        newcomers = [i for i, r in enumerate(batch.active) if cache[0].length(r) == 0]  # nothing fed yet
        if newcomers and len(newcomers) < len(batch.active):
            counts = draft.num_tokens.tolist()
            if speculator in ("eagle", "medusa"):  # no target states for them yet
                assert all(counts[i] == 0 for i in newcomers), counts
            drafts_beside_newcomers.append(sum(counts))
        return draft, classes, fed

    cache = []  # the serving engine's target runner
    monkeypatch.setattr(Step, "__call__", spy)
    monkeypatch.setattr(Step, "_propose", propose_spy)
    counts = {}
    for packed in ("1", "0"):
        monkeypatch.setenv("HF_SPECDEC_PACKED", packed)
        prefill_only.clear()
        engine = ServingEngine(target, None, draft, num_speculative_tokens=3, max_batch_size=2,
                               schedule="constant")
        cache[:] = [engine.scheduler.target]
        engine.start()
        try:  # all queued at once: each joins when an earlier (shorter) request leaves its slot
            streams = [engine.submit(p, 8 + 3 * i) for i, p in enumerate(prompts)]
            for stream in streams:
                for _ in stream:
                    pass
        finally:
            engine.shutdown()
        assert [s.request.output_ids for s in streams] == expected
        counts[packed] = sum(prefill_only)
    assert counts["1"] == 0 and counts["0"] > 0
    assert drafts_beside_newcomers  # steps that fed a newcomer beside running rows
    if speculator != "ngram":  # (random prompts: nothing for the lookup to find)
        assert max(drafts_beside_newcomers) > 0  # the running rows drafted in them


@pytest.mark.parametrize("version", [1, 3])
def test_an_eagle_heads_ragged_catch_up_is_packed_and_gives_the_padded_outputs(version, tmp_path):
    """A newcomer's prompt caught up beside rows with a state or two: the head takes the entries as one packed stream
    (its input features packed alongside) and returns what the padded forward returns at every real entry."""
    from hf_specdec import EagleSpeculator
    from test_eagle import convert, make_target

    target = make_target(num_layers=4)
    head = EagleSpeculator.from_pretrained(
        convert(tmp_path, target, version, **({"aux_layers": [1, 2, 3]} if version == 3 else {}))).head
    head.to(torch.float64).bind(target)
    width = head.fc.in_features - (target.config.hidden_size if version == 1 else 0)
    g = torch.Generator()
    outputs = {}
    with torch.no_grad():
        for packed in (False, True):
            runner = ModelRunner(head, packed=packed)
            for row in range(3):
                runner.add_sequence(row)
            outputs[packed] = []
            g.manual_seed(5)
            for counts in ([9, 2, 5], [1, 12, 3], [2, 2, 1]):
                ids = torch.randint(2, target.config.vocab_size, (3, max(counts)), generator=g)
                features = torch.randn(3, max(counts), width, generator=g, dtype=torch.float64)
                out = runner.forward([0, 1, 2], ids, counts, num_logits=1, features=features, from_target=True)
                outputs[packed] += [out[row, out.shape[1] - n:] for row, n in enumerate(counts)]
            assert runner.num_packed_forwards == (3 if packed else 0)
    for got, expected in zip(outputs[True], outputs[False]):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_rows_in_regions_read_their_context_in_place_and_give_the_gathered_outputs(arch, monkeypatch):
    """Rows given consecutive regions of the pool (`ModelRunner.give_regions`, what a one-call `generate` does)
    attend to a view of the pool instead of a gathered copy: padded and packed steps, a tree step, and steps over
    part of the rows (gathered again) give the same logits and hidden states as rows taking blocks as they grow."""
    from hf_specdec.cache import paged as paged_cache
    from hf_specdec.cache.layout import TreeAttention

    model = make_model(arch)
    check_model_supported(model, "target model")
    plans = []
    plan_step = paged_cache.PagedKVCache.plan_step
    monkeypatch.setattr(paged_cache.PagedKVCache, "plan_step",
                        lambda self, *a, **k: plans.append(plan_step(self, *a, **k)) or plans[-1])
    outputs = {}
    with torch.no_grad(), paged_attention(model):
        for regions in (False, True):
            runner = ModelRunner(model, block_size=4, num_blocks=3)
            if regions:
                assert runner.give_regions([0, 1, 2], 40)
            for row in range(3):
                runner.add_sequence(row)
            plans.clear()
            outputs[regions] = []
            steps = _steps(seed=3, rows=3, vocab=model.config.vocab_size, joins=True)
            for i, (counts, ids) in enumerate(steps):
                rows = [0, 1, 2] if i != 3 else [0, 2]  # one step over two of the rows: not one run of regions
                if i == 3:
                    counts, ids = counts[:2], ids[:2]
                out = runner.forward(rows, ids, counts, num_logits=2, output_hidden_states=True)
                for row, n in enumerate(counts):
                    outputs[regions].append(out.logits[row, 2 - min(n, 2):])
                    outputs[regions].extend(h[row, ids.shape[1] - n:] for h in out.hidden_states)
                for row in rows:  # roll back a token, as a rejected draft would be
                    runner.rollback(row, runner.length(row) - 1)
            # A tree step: two nodes under the last committed token, siblings.
            lengths = torch.tensor([runner.length(r) for r in range(3)])
            node_positions = lengths[:, None].repeat(1, 2)
            positions = torch.cat([lengths[:, None] - 1, node_positions], dim=1)
            region_mask = torch.tensor([[False, False], [True, False], [False, True]]).expand(3, 3, 2)
            runner.rollback(0, runner.length(0) - 1)
            runner.rollback(1, runner.length(1) - 1)
            runner.rollback(2, runner.length(2) - 1)
            ids = torch.randint(2, model.config.vocab_size, (3, 3), generator=torch.Generator().manual_seed(5))
            out = runner.forward([0, 1, 2], ids, [3, 3, 3], num_logits=3,
                                 tree=TreeAttention(lengths, positions, region_mask, node_positions))
            outputs[regions].append(out.logits)
            views = [p.context_view is not None for p in plans]
            if regions:
                assert views == [True, True, True, False, True, True, True, True]
            else:
                assert not any(views)
    assert len(outputs[True]) == len(outputs[False])
    for got, expected in zip(outputs[True], outputs[False]):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


def test_a_one_call_generate_reads_its_rows_in_place_until_one_finishes(monkeypatch):
    from hf_specdec.cache import paged as paged_cache
    from hf_specdec.decode.engine import SpeculativeEngine

    plans = []
    plan_step = paged_cache.PagedKVCache.plan_step
    monkeypatch.setattr(paged_cache.PagedKVCache, "plan_step",
                        lambda self, *a, **k: plans.append(plan_step(self, *a, **k)) or plans[-1])
    target = make_model("llama")
    input_ids, mask = ragged_batch(rows=4, width=14)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    eos = int(expected[1, 14 + 5])  # row 1 stops early at its sixth token
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                               eos_token_id=eos, pad_token_id=0)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=0,
                  speculator="ngram", num_speculative_tokens=3, speculative_schedule="constant")
    plans.clear()
    assert torch.equal(target.generate(input_ids, **kwargs), expected)
    target_plans = [p for p in plans if p.context_slots is not None and p.block_tables.shape[0] in (3, 4)]
    views = [p.context_view is not None for p in target_plans]
    assert views[0] and views.count(True) >= 2 and not views[-1]  # in place while every row runs, then gathered
    plans.clear()
    monkeypatch.setattr(SpeculativeEngine, "REGION_MAX_NEW_TOKENS", 0)  # long answers: blocks as rows grow
    assert torch.equal(target.generate(input_ids, **kwargs), expected)
    assert not any(p.context_view is not None for p in plans)


def test_a_verify_feeds_each_row_only_its_own_drafts(monkeypatch):
    """Rows with a lookup match verify their drafts while rows without one feed a single token in the same step (not
    padded to the widest row's k + 1), and the output is still the target's own."""
    from conftest import repetitive_prompt

    fed = []
    forward = ModelRunner.forward

    def spy(self, seq_ids, input_ids, num_tokens, *args, **kwargs):
        if len(seq_ids) == 4 and self.model is target:
            fed.append(list(num_tokens))
        return forward(self, seq_ids, input_ids, num_tokens, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", spy)
    target = make_model("llama")
    repeating = repetitive_prompt(rows=2, width=16, seed=4)
    random = torch.randint(2, VOCAB, (2, 16), generator=torch.Generator().manual_seed(9))
    input_ids = torch.cat([repeating[:1], random[:1], repeating[1:], random[1:]])
    expected = target.generate(input_ids, max_new_tokens=20, do_sample=False)
    out = target.generate(input_ids, max_new_tokens=20, do_sample=False, speculator="ngram", num_speculative_tokens=4,
                          speculative_schedule="constant")
    assert torch.equal(out, expected)
    later = fed[1:]  # after the prompts
    assert any(max(n) > 1 and min(n) == 1 for n in later), later  # drafting rows beside rows feeding one token


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_logits_only_where_rows_need_them(arch, monkeypatch):
    """`logit_counts`: row i gets its last `logit_counts[i]` positions, left-aligned; a packed step runs the LM head
    over those alone (a verify of 4 drafts beside rows feeding one token: 1 + 5 + 2 positions, not 3 x 5), with the
    padded step's values."""
    model = make_model(arch)
    check_model_supported(model, "target model")
    head = model.get_output_embeddings()
    positions = []
    monkeypatch.setattr(head, "forward", lambda x, f=head.forward: positions.append(x.shape[0] * x.shape[1]) or f(x))
    g = torch.Generator().manual_seed(5)
    steps = [([7, 9, 6], 1, [1, 1, 1]), ([1, 5, 2], 5, [1, 5, 2]), ([2, 1, 3], 3, [1, 1, 3])]
    steps = [(counts, torch.randint(2, VOCAB, (3, max(counts)), generator=g), n, want) for counts, n, want in steps]
    outputs = {}
    with torch.no_grad(), paged_attention(model):
        for packed in (False, True):
            runner = _three_rows(model, packed)
            positions.clear()
            outputs[packed] = [runner.forward([0, 1, 2], ids, counts, num_logits=n, logit_counts=want).logits
                               for counts, ids, n, want in steps]
            if packed:
                assert positions == [3, 8, 5]
            else:
                assert positions == [3, 15, 9]
    for got, expected in zip(outputs[True], outputs[False]):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    # Left-aligned: row 1 of the second step holds its 5 positions in order; row 0's one repeats.
    second = outputs[True][1]
    assert torch.equal(second[0, 0], second[0, 4]) and not torch.equal(second[1, 0], second[1, 4])


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_rows_of_very_different_contexts_attend_in_two_groups_and_give_the_one_group_outputs(arch, monkeypatch):
    """A long prompt's row beside short ones: the PyTorch path gathers the short rows' contexts padded to their own
    longest only (`layout.context_groups`), reading rows that sit in consecutive regions in place; padded and
    packed steps give the logits and hidden states of one group padded to the longest context."""
    from hf_specdec.cache import layout
    from hf_specdec.cache import paged as paged_cache

    model = make_model(arch)
    check_model_supported(model, "target model")
    monkeypatch.setattr(layout, "CONTEXT_SPLIT_MIN", 0)
    plans = []
    plan_step = paged_cache.PagedKVCache.plan_step
    monkeypatch.setattr(paged_cache.PagedKVCache, "plan_step",
                        lambda self, *a, **k: plans.append(plan_step(self, *a, **k)) or plans[-1])
    g = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size
    steps = [([60, 5, 7], torch.randint(2, vocab, (3, 60), generator=g))]
    steps += [(counts, torch.randint(2, vocab, (3, max(counts)), generator=g))
              for counts in ([1, 1, 1], [2, 3, 1], [1, 2, 2], [3, 3, 3])]
    outputs = {}
    with torch.no_grad(), paged_attention(model):
        for split, packed, regions in ((False, False, False), (None, False, False), (None, True, False),
                                       (None, True, True)):
            runner = ModelRunner(model, block_size=4, num_blocks=8, packed=packed)
            runner.cache.context_split = split
            if regions:  # the long row outgrows its region; the short rows stay in theirs, one after another
                assert runner.give_regions([0, 1, 2], 40)
            for row in range(3):
                runner.add_sequence(row)
            plans.clear()
            outputs[split, packed, regions] = out_list = []
            for counts, ids in steps:
                out = runner.forward([0, 1, 2], ids, counts, num_logits=2, output_hidden_states=True)
                for row, n in enumerate(counts):
                    out_list.append(out.logits[row, 2 - min(n, 2):])
                    out_list.extend(h[row, ids.shape[1] - n:] for h in out.hidden_states)
            groups = [p.context_groups for p in plans]
            if split is False:
                assert not any(groups)
            else:  # every step after the prompts (their contexts differ too little) but those on token rows
                grouped = [p.context_groups for p in plans[1:] if p.packed is None or p.packed.token_rows is None]
                assert len(grouped) >= 3 and all(grouped)
                for step_groups in grouped:
                    assert [g.rows.tolist() for g in step_groups] == [[1, 2], [0]]
                    assert [g.view is not None for g in step_groups] == [regions, False]
    reference = outputs[False, False, False]
    for key, got in outputs.items():
        assert len(got) == len(reference)
        for a, b in zip(got, reference):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_context_groups_are_taken_where_padding_would_cost_more_than_a_second_group():
    from hf_specdec.cache.layout import CONTEXT_SPLIT_MIN, context_groups

    assert context_groups([2000] + [300] * 6) == ([1, 2, 3, 4, 5, 6], 300)
    assert context_groups([300, 2000, 250]) == ([0, 2], 300)
    assert context_groups([400] * 20 + [450] * 5) is None  # rows about as long: one group
    assert context_groups([300] * 8 + [500] * 8) is None  # saves a fifth of the padded context
    assert context_groups([CONTEXT_SPLIT_MIN // 2 + 10, 10, 20]) is None  # saves fewer than CONTEXT_SPLIT_MIN
    assert context_groups([CONTEXT_SPLIT_MIN * 2, 10, 20]) == ([1, 2], 20)


@pytest.mark.parametrize("model_type, groups", [("llama", True), ("deepseek_v3", False), ("diffllama", False),
                                                ("jetmoe", False)])
def test_models_that_reshape_keys_or_values_after_the_cache_keep_one_context_group(model_type, groups, monkeypatch):
    """Grouped attention hands attention the KV pools; a model that reshapes keys or values between the cache's
    update and attention (multi-head latent attention expands its cached latents there) fails the grouped trial and
    keeps one group: steps whose contexts differ widely still run, with one group's logits."""
    from hf_specdec.cache import layout
    from hf_specdec.cache import paged as paged_cache
    from model_sweep import build

    monkeypatch.setattr(layout, "CONTEXT_SPLIT_MIN", 0)
    model = build(model_type, dtype=torch.float64)
    check_model_supported(model, "target model")
    assert model._hf_specdec_context_groups is groups
    plans = []
    plan_step = paged_cache.PagedKVCache.plan_step
    monkeypatch.setattr(paged_cache.PagedKVCache, "plan_step",
                        lambda self, *a, **k: plans.append(plan_step(self, *a, **k)) or plans[-1])
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, model.config.vocab_size, (2, 40), generator=g)
    decode = torch.randint(2, model.config.vocab_size, (2, 1), generator=g)
    logits = {}
    with torch.no_grad(), paged_attention(model):
        for split in (False, None):
            runner = ModelRunner(model, block_size=4, num_blocks=8, packed=False)
            if split is False:
                runner.cache.context_split = False
            for row in (0, 1):
                runner.add_sequence(row)
            runner.forward([0, 1], prompts, [40, 3], num_logits=1)
            logits[split] = runner.forward([0, 1], decode, [1, 1], num_logits=1).logits
    torch.testing.assert_close(logits[None], logits[False], atol=1e-10, rtol=1e-10)
    assert any(p.context_groups is not None for p in plans) is groups
