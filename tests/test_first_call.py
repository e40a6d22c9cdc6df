"""No command first: the first `generate(speculator=...)` on a new host, model, dtype and thread count measures this
host's costs before its first step and caches them; `speculator="off"` runs the engine without drafts."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from conftest import make_model, ragged_batch
from test_calibration import fake_timer, steady

from hf_specdec.costs import calibration, draft_cost
from hf_specdec.costs import profile as profiles
from hf_specdec.costs.profile import load_profile, profile_path

# Small enough for the tiny test models; timed with made-up, steady timings so a busy host cannot reject them.
TINY_FIRST_CALL = dict(rows=(1, 2), tokens=(1, 2), contexts=(8,), repeats=1, linear_rows=(1, 2), attempts=1)


@pytest.fixture(autouse=True)
def first_call(tmp_path, monkeypatch):
    """An empty cache with measuring on, a first-call grid the tiny models measure in a blink, and a count of
    `calibrate` calls."""
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_SPECDEC_CALIBRATION", "on")  # conftest turns it off for every other test
    monkeypatch.setattr(profiles, "_loaded", {})
    monkeypatch.setattr(calibration, "FIRST_CALL_GRID", dict(TINY_FIRST_CALL, timer=fake_timer()))
    calls = []
    real = calibration.calibrate
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


def _generate(model, speculator="ngram", **kwargs):
    input_ids, mask = ragged_batch(rows=2)
    return model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=12, speculator=speculator,
                          num_speculative_tokens=3, return_dict_in_generate=True, **kwargs)


def test_an_empty_cache_measures_once(first_call, caplog):
    model = make_model("llama", dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="hf_specdec"):
        first = _generate(model)
    assert len(first_call) == 1 and load_profile(model) is not None
    assert first.speculative_metrics.measure_time_s > 0
    said = [r.getMessage() for r in caplog.records if "measured this host" in r.getMessage()]
    assert len(said) == 1 and str(profile_path(model)) in said[0]
    second = _generate(model)
    assert len(first_call) == 1  # cached: nothing measured again
    assert second.speculative_metrics.measure_time_s < first.speculative_metrics.measure_time_s
    assert torch.equal(first.sequences, second.sequences)


def test_a_seeded_sampled_call_repeats_across_the_first_and_second_call(first_call):
    model = make_model("llama", dtype=torch.float32)
    torch.manual_seed(11)
    first = _generate(model, do_sample=True, temperature=0.9).sequences
    assert len(first_call) == 1
    torch.manual_seed(11)
    second = _generate(model, do_sample=True, temperature=0.9).sequences
    assert len(first_call) == 1 and torch.equal(first, second)


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_the_opt_out_measures_nothing(first_call, monkeypatch, how):
    model = make_model("llama", dtype=torch.float32)
    if how == "environment":
        monkeypatch.setenv("HF_SPECDEC_CALIBRATION", "off")
        out = _generate(model)
    else:
        out = _generate(model, speculative_calibration=False)
    assert first_call == [] and not profile_path(model).exists()
    assert out.speculative_metrics.measure_time_s < 0.5


def test_a_corrupt_profile_is_rebuilt_with_a_warning(first_call, caplog):
    model = make_model("llama", dtype=torch.float32)
    path = profile_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        _generate(model)
    assert any("ignoring the calibration profile" in r.getMessage() for r in caplog.records)
    assert len(first_call) == 1 and load_profile(model) is not None
    json.loads(path.read_text())  # rewritten whole


def test_a_model_speculator_gets_its_draft_cost_measured_on_its_first_call(first_call, monkeypatch):
    real = draft_cost.draft_sample  # the draft's own calls run; their timings are made up (2 ms a token, 40 a step)
    monkeypatch.setattr(draft_cost, "draft_sample", lambda *args: (real(*args), (2.0, 40.0))[1])
    target = make_model("llama", dtype=torch.float32)
    draft = make_model("llama", seed=1, dtype=torch.float32)
    _generate(target, speculator="ngram")  # the target's profile, no draft cost (n-gram runs no model)
    assert len(first_call) == 1 and load_profile(target).draft_costs == {}
    _generate(target, speculator=draft)
    assert len(first_call) == 2 and len(load_profile(target).draft_costs) >= 1
    _generate(target, speculator=draft)
    assert len(first_call) == 2


def test_a_step_cost_found_untrustworthy_keeps_the_forms_and_is_measured_again_later(first_call, monkeypatch, caplog):
    """A first call whose step cost breaks the bounds (a 2-row x 2-token forward at 4 times a 2-row x 1-token one)
    caches the linear forms without it; calls within the retry window measure nothing, and the first call after it
    measures the step cost alone, with the forms in use."""
    model = make_model("llama", dtype=torch.float32)
    order = []
    spoiled = fake_timer(cost=lambda key: 0.16 if key == ("step", 2, 2, 8) else steady(key), order=order)
    monkeypatch.setattr(calibration, "FIRST_CALL_GRID", dict(TINY_FIRST_CALL, timer=spoiled))
    with caplog.at_level(logging.INFO, logger="hf_specdec"):
        first = _generate(model).sequences
    profile = load_profile(model)
    assert len(first_call) == 1 and profile is not None and profile.step_cost is None
    assert profile.linear_rows == TINY_FIRST_CALL["linear_rows"] and any(key[0] == "linear" for key in order)
    said = [r.getMessage() for r in caplog.records if "hf_specdec measured" in r.getMessage()]
    assert len(said) == 1 and "linear-layer forms for" in said[0] and "step cost" not in said[0].split(" for ")[0]
    order.clear()
    assert torch.equal(_generate(model).sequences, first) and order == []  # within the window: nothing timed
    monkeypatch.setattr(calibration, "FIRST_CALL_GRID", dict(TINY_FIRST_CALL, timer=fake_timer(order=order)))
    later = time.time() + profiles.UNSTEADY_RETRY_S + 1
    monkeypatch.setattr(profiles.time, "time", lambda: later)
    assert torch.equal(_generate(model).sequences, first)
    assert order and all(key[0] == "step" for key in order)  # the step cost alone
    again = load_profile(model)
    assert again.step_cost is not None and again.linear_rows == profile.linear_rows
    order.clear()
    _generate(model)
    assert order == []


@pytest.mark.parametrize("do_sample", [False, True])
def test_speculation_off_is_the_engine_alone(do_sample):
    """`speculator="off"`: no drafts, output as exact as every speculator's (greedy: plain generate's tokens)."""
    model = make_model("llama")
    input_ids, mask = ragged_batch(rows=3)
    torch.manual_seed(3)
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=10, speculator="off",
                         do_sample=do_sample, return_dict_in_generate=True)
    metrics = out.speculative_metrics
    assert metrics.num_draft_tokens == 0 and metrics.num_steps >= 10
    if not do_sample:
        plain = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        assert torch.equal(out.sequences, plain)
    else:
        torch.manual_seed(3)
        again = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=10, speculator="off",
                               do_sample=True)
        assert torch.equal(out.sequences, again)


def test_an_unknown_speculator_name_lists_off():
    model = make_model("llama")
    input_ids, mask = ragged_batch(rows=1)
    with pytest.raises(ValueError, match="'off'"):
        model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=2, speculator="of")
