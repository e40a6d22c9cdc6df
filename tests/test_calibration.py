"""Measured costs (costs/: calibration, profile, step_cost, linear_forms, draft_cost, timing): a cached profile prices drafting, its key, bad files, seeded runs,
the small-row linear form, the warning when adaptive k keeps drafting off, and measurements a busy host spoils
(re-measured, or rejected for the static default). No timing is asserted: profiles with chosen numbers, and timers
that return chosen numbers, stand in for measured ones."""

from __future__ import annotations

import copy
import json
import logging
import time

import pytest
import torch
from conftest import make_model, ragged_batch
from test_quantization import _prompts, _trained_llama, needs_bnb, needs_torchao

from hf_specdec.costs import calibration, draft_cost, linear_forms, linear_weights
from hf_specdec.costs import profile as profiles
from hf_specdec.costs.calibration import calibrate
from hf_specdec.costs.profile import Profile, load_profile, profile_key, profile_path, save_profile
from hf_specdec.costs.step_cost import DEFAULT_STEP_COST, HOST_FORMS_CPU_STEP_COST, StepCost
from hf_specdec.speculators.resolve import resolve_speculator

# A verify of k + 1 tokens costs k + 1 plain steps: drafting can never pay.
DEAR = StepCost(per_row=0.0, points=((1, 10.0), (2, 20.0), (64, 640.0)))
# A verify costs what a plain step does, whatever its width: drafting pays whenever drafts are accepted.
FLAT = StepCost(per_row=0.0, points=((1, 10.0), (256, 10.0)))


def steady(key) -> float:
    """Made-up seconds for a timing key: a forward costs 40 ms + 2 ms per token + a little per cached token; the
    thin and packed linear forms are as fast as the stock one, a group's one product as its members apart."""
    if key[0] == "step":
        _, rows, tokens, context = key
        return 0.040 + 0.002 * rows * tokens + 1e-5 * rows * context
    if key[:2] == ("packed", "fused") and isinstance(key[3], str):  # a group's one product: as its members apart
        return 1e-4 * key[2] * len(key[3].split("+"))
    return 1e-4 * key[2]  # ("linear" or "packed", form, rows, shape, ...)


def fake_timer(cost=steady, slowdown=lambda key, call: 1.0, order=None):
    """A `timing.Timer` that runs what it times (so the real code path runs) and returns `cost(key)` times
    `slowdown(key, how many times this key was timed)`; `order` collects the keys timed."""
    calls = {}

    def timer(key, fn):
        fn()
        calls[key] = calls.get(key, 0) + 1
        if order is not None:
            order.append(key)
        return cost(key) * slowdown(key, calls[key])
    return timer


TINY_GRID = dict(rows=(1, 2), tokens=(1, 2), contexts=(8,), repeats=1, linear_rows=(1, 2), timer=fake_timer())
GRID = dict(rows=(1, 2), tokens=(1, 2, 4), contexts=(8,), repeats=5, linear_rows=(1, 2, 3))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own empty cache directory and forgets earlier warnings."""
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    # Profiles written by hand, none measured on a first call (tests/test_first_call.py); conftest turns profiles off
    # for every other test
    monkeypatch.setenv("HF_SPECDEC_CALIBRATION", "cached")
    monkeypatch.setattr(calibration, "_reported", set())
    monkeypatch.setattr(profiles, "_loaded", {})
    return tmp_path


@pytest.fixture(scope="module")
def trained():
    return _trained_llama()


def _profile(model, step_cost, draft=None, draft_cost=None, thin_rows=()) -> Profile:
    costs = {profiles.speculator_key(resolve_speculator(draft)): draft_cost} if draft is not None else {}
    return Profile(profile_key(model), step_cost, tuple(thin_rows), costs)


def _quantized(target, quantization):
    from hf_specdec import load_draft

    return load_draft(target, quantization=quantization)


QUANTIZED = [pytest.param("fp8", marks=needs_torchao), pytest.param("int8", marks=needs_bnb)]


@pytest.mark.parametrize("quantization", QUANTIZED)
def test_a_profile_where_drafting_pays_makes_a_quantized_copy_draft(trained, quantization, caplog):
    draft = _quantized(trained, quantization)
    input_ids, mask = _prompts()
    plain = trained.generate(input_ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    kwargs = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, speculator=draft,
                  num_speculative_tokens=4, return_dict_in_generate=True)
    # Without a profile the copy is priced by its parameter count, about one plain step per draft: no drafting.
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        unpriced = trained.generate(input_ids, **kwargs).speculative_metrics
    assert unpriced.num_draft_tokens == 0
    assert any("estimated from parameter counts" in r.getMessage() for r in caplog.records)  # and it says so
    caplog.clear()
    save_profile(trained, _profile(trained, FLAT, draft, 0.05))
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        out = trained.generate(input_ids, **kwargs)
    m = out.speculative_metrics
    assert torch.equal(out.sequences, plain)
    assert m.num_draft_tokens > 0 and m.acceptance_rate > 0.9
    assert len(m.k_per_step) == m.num_steps and max(m.k_per_step) > 0
    assert not [r for r in caplog.records if "kept drafting off" in r.getMessage()]


def test_a_profile_where_drafting_cannot_pay_drafts_nothing_and_says_why(caplog):
    target = make_model("llama", dtype=torch.float32)
    draft = copy.deepcopy(target)  # identical: every draft would be accepted
    input_ids, mask = ragged_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, speculator=draft,
                  num_speculative_tokens=4, return_dict_in_generate=True)
    save_profile(target, _profile(target, FLAT, draft, 0.0))
    assert target.generate(input_ids, **kwargs).speculative_metrics.num_draft_tokens > 0  # the same draft pays here
    # ... only by this profile: without it (static defaults, the draft priced by its size) it does not.
    assert target.generate(input_ids, **kwargs, speculative_calibration=False).speculative_metrics.num_draft_tokens \
        == 0
    profiles._loaded.clear()
    caplog.clear()
    save_profile(target, _profile(target, DEAR, draft, 0.5))
    with caplog.at_level(logging.INFO, logger="hf_specdec"):
        out = target.generate(input_ids, **kwargs)
        again = target.generate(input_ids, **kwargs)
    m = out.speculative_metrics
    assert m.num_draft_tokens == 0 and m.k_per_step == [0] * m.num_steps
    assert torch.equal(out.sequences, target.generate(input_ids, attention_mask=mask, max_new_tokens=40,
                                                      do_sample=False))
    warned = [r for r in caplog.records if "kept drafting off" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING, logging.INFO]  # once at WARNING, then INFO
    message = warned[0].getMessage()
    assert "speculative_schedule='constant'" in message and "measured on this host" in message
    assert "a drafted token 0.50" in message and f"{m.num_steps} of {m.num_steps} steps" in message
    assert again.speculative_metrics.num_draft_tokens == 0
    # Forcing drafting still works.
    forced = target.generate(input_ids, **{**kwargs, "speculative_schedule": "constant"}).speculative_metrics
    assert forced.num_draft_tokens > 0 and set(forced.k_per_step) == {4}
    with pytest.raises(TypeError, match="speculative_calibration"):
        target.generate(input_ids, **kwargs, speculative_calibration="yes")


def test_steps_with_nothing_to_draft_are_not_reported_as_declined():
    from hf_specdec.costs.adaptive import AdaptiveK

    # n-gram offers drafts only where the text repeats; steps where no row offered any are not declined ones.
    policy = AdaptiveK(1, 4, DEAR)
    for _ in range(8):
        policy.choose([0], available=[0])
    assert policy.idle_explanation(min_steps=4) is None and policy.chosen == [0] * 8
    for _ in range(9):
        policy.choose([0], available=[4])
    assert policy.chosen == [0] * 17 and "kept drafting off in 9 of 17 steps" in policy.idle_explanation(min_steps=4)
    assert policy.idle_explanation() is None  # too short a call to say anything about
    paying = AdaptiveK(1, 4, FLAT)
    for _ in range(8):
        paying.choose([0])
    assert paying.idle_explanation(min_steps=4) is None and min(paying.chosen) > 0


def test_the_idle_sentence_names_the_calls_batch_where_rows_ended_apart():
    """The sentence prices a verify at the rows of the call's last steps; where rows ended before the others, those
    are fewer than the batch the user passed, and it says so instead of naming a batch size nobody asked for."""
    from hf_specdec.costs.adaptive import AdaptiveK

    policy = AdaptiveK(4, 4, DEAR)
    for _ in range(6):
        policy.choose([0, 1, 2, 3])
    assert "at batch 4 a verify" in policy.idle_explanation(min_steps=4)
    for _ in range(6):  # rows 2 and 3 ended
        policy.choose([0, 1])
    assert policy.chosen == [0] * 12
    assert "at batch 2 (the rows left at the end of a batch of 4) a verify" in policy.idle_explanation(min_steps=4)


def test_a_call_that_drafts_by_its_end_is_not_explained_as_idle():
    """Declined in most steps while acceptance was low, then drafting once it rose: the sentence would read its
    reasons off the end's estimates, which say drafting pays, so nothing is said."""
    from hf_specdec.costs.adaptive import AdaptiveK

    # A draft costs 0.3 of a step: it pays at high acceptance only.
    policy = AdaptiveK(1, 4, StepCost(per_row=0.0, points=((1, 10.0), (2, 13.0), (5, 22.0))), priors=(0.1,))
    for _ in range(9):
        policy.choose([0])
    assert policy.chosen == [0] * 9 and "kept drafting off" in policy.idle_explanation(min_steps=4)
    for _ in range(4):  # the text turns to copying: every draft tried is accepted
        policy.update([0], [4], [4])
    assert policy.choose([0]) > 0
    assert sum(k == 0 for k in policy.chosen) > len(policy.chosen) / 2
    assert policy.idle_explanation(min_steps=4) is None
    # Estimates discounted by calibration (drafts accepted less often than their estimates said) are named as such.
    doubted = AdaptiveK(1, 4, DEAR, calibrate=True)
    for _ in range(9):
        doubted.update([0], [4], [0])
        doubted.choose([0])
    message = doubted.idle_explanation(min_steps=4)
    assert "times as often as their estimates said" in message and "kept drafting off in 9 of 9 steps" in message


def test_profile_key_separates_models_dtypes_and_threads():
    target = make_model("llama", dtype=torch.float32)
    save_profile(target, _profile(target, FLAT))
    assert load_profile(target) is not None
    assert load_profile(make_model("llama", seed=5, dtype=torch.float32)) is not None  # other weights, same cost
    assert load_profile(make_model("qwen2", dtype=torch.float32)) is None  # another model
    assert load_profile(make_model("llama", dtype=torch.float64)) is None  # another dtype
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert load_profile(target) is None  # another thread count
    finally:
        torch.set_num_threads(threads)
    assert load_profile(target) is not None
    one = make_model("llama", dtype=torch.float32)
    assert profiles.speculator_key(resolve_speculator(one)) != profiles.speculator_key(
        resolve_speculator(make_model("llama", dtype=torch.float64)))
    assert profiles.speculator_key(resolve_speculator("ngram")) is None


@pytest.mark.parametrize("content", [
    "{not json", "\x00\xff", json.dumps([1, 2]), json.dumps({"format": "something else"}),
    "FOREIGN",  # a valid profile, but measured for another model
    "BAD_CURVE",  # the right key, a step cost whose times decrease
    "IMPLAUSIBLE",  # the right key, a 2-token forward at 4.6 plain steps (as one measured on a busy host)
    "OLD_VERSION",  # the right key, written before measurements were checked
])
def test_a_corrupt_or_foreign_file_is_ignored_with_a_warning_and_rebuilt(content, caplog):
    target = make_model("llama", dtype=torch.float32)
    path = profile_path(target)
    path.parent.mkdir(parents=True)
    if content == "FOREIGN":
        other = make_model("qwen2", dtype=torch.float32)
        content = json.dumps(_profile(other, FLAT).to_json())
    elif content == "BAD_CURVE":
        data = _profile(target, FLAT).to_json()
        data["step_cost"]["points"] = [[1, 10.0], [2, 5.0]]
        content = json.dumps(data)
    elif content == "IMPLAUSIBLE":
        content = json.dumps(_profile(target, StepCost(per_row=0.0, points=((1, 10.0), (2, 46.0), (64, 100.0))))
                             .to_json())
    elif content == "OLD_VERSION":
        content = json.dumps({**_profile(target, FLAT).to_json(), "version": 1})
    path.write_bytes(content.encode("latin-1"))
    input_ids, mask = ragged_batch()
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        assert load_profile(target) is None
        out = target.generate(input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False, speculator="ngram")
    assert out.shape[1] == input_ids.shape[1] + 6
    assert [r for r in caplog.records if "ignoring the calibration profile" in r.getMessage()]
    rebuilt = calibrate(target, **TINY_GRID)
    assert load_profile(target) == rebuilt and rebuilt.key == profile_key(target)


def test_calibrate_measures_once_and_leaves_the_random_state_alone(monkeypatch):
    real = draft_cost.draft_sample
    # The draft's own calls run; their timings are replaced: 2 ms a drafted token, 40 ms a verify step.
    monkeypatch.setattr(draft_cost, "draft_sample", lambda *args: (real(*args), (2.0, 40.0))[1])
    target = make_model("llama", dtype=torch.float32)
    draft = make_model("llama", seed=1, dtype=torch.float32)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    profile = calibrate(target, [resolve_speculator(draft), resolve_speculator("ngram")], **TINY_GRID)
    assert torch.equal(torch.rand(3), expected)
    key = profiles.speculator_key(resolve_speculator(draft))
    verify_steps = float(profile.step_cost.relative(1, torch.tensor(5.0), 64 + 12))  # k = 4: a 5-token verify
    assert set(profile.draft_costs) == {key} and profile.draft_costs[key] == round(2.0 / 40.0 * verify_steps, 4)
    assert all(t > 0 for _, t in profile.step_cost.points)
    mtime = profile_path(target).stat().st_mtime_ns
    assert calibrate(target, [resolve_speculator(draft)], **TINY_GRID) == profile  # cached: nothing measured again
    assert profile_path(target).stat().st_mtime_ns == mtime


def test_seeded_sampling_is_reproducible_with_calibration_on():
    target = make_model("llama", dtype=torch.float64)
    draft = make_model("llama", seed=1, dtype=torch.float64)
    # Drafting pays at some widths and not at others, so adaptive k moves between 0 and a few.
    save_profile(target, _profile(target, StepCost(per_row=0.0, points=((1, 10.0), (9, 10.0), (12, 30.0))), draft,
                                  0.1, thin_rows=(2, 3, 4)))
    input_ids, mask = ragged_batch()

    def run():
        torch.manual_seed(123)
        return target.generate(input_ids, attention_mask=mask, max_new_tokens=24, do_sample=True, top_k=0,
                               speculator=draft, num_speculative_tokens=4, return_dict_in_generate=True)

    first, second = run(), run()
    assert torch.equal(first.sequences, second.sequences)
    assert first.speculative_metrics.k_per_step == second.speculative_metrics.k_per_step
    assert first.speculative_metrics.num_draft_tokens > 0


def test_thin_linear_is_exact_in_float64_and_only_inside_our_calls():
    target = make_model("llama", dtype=torch.float64)
    draft = make_model("llama", seed=1, dtype=torch.float64)
    input_ids, mask = ragged_batch()
    plain = target.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    save_profile(target, _profile(target, FLAT, draft, 0.0, thin_rows=tuple(range(1, 65))))
    seen = []
    layer = target.model.layers[0].mlp.down_proj
    layer.register_forward_hook(lambda module, args, out: seen.append("forward" in vars(module)))
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False, speculator=draft,
                          num_speculative_tokens=3, speculative_schedule="constant", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    steps = out.speculative_metrics.num_steps
    assert len(seen) >= steps and all(seen[-steps:])  # the decode loop's forwards ran with the layer switched ...
    assert "forward" not in vars(layer) and not any("forward" in vars(m) for m in draft.modules())  # ... and back
    x = torch.randn(3, layer.in_features, dtype=torch.float64)
    with linear_forms.thin_linear([target], rows=(3,)):
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight))
        assert "forward" in vars(layer)
    assert "forward" not in vars(layer)


def test_thin_linear_between_measured_row_counts(monkeypatch):
    """A row count between two measured ones takes the choice made at the lower; past the last measured count, and
    below the first, the stock form stays; without measured counts, exactly the counts given. A profile keeps the
    counts it measured, and `host_linear` reads them."""
    table = linear_forms.thin_row_table((2, 16), (1, 2, 4, 16, 32))
    assert [n for n, thin in enumerate(table) if thin] == [2, 3, *range(16, 32)]
    assert [n for n, thin in enumerate(linear_forms.thin_row_table((3, 5))) if thin] == [3, 5]
    assert linear_forms.thin_row_table((), (1, 2)) == [False] * 3
    layer = torch.nn.Linear(8, 4).double()
    stock = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: stock.append(a[0].shape[0]) or linear(*a, **k))
    with linear_forms.thin_linear([layer], (2, 16), (1, 2, 4, 16, 32)):
        for rows in (1, 2, 3, 4, 15, 16, 31, 32, 33):
            x = torch.randn(rows, 8, dtype=torch.float64)
            y = layer(x)
            torch.testing.assert_close(y, linear(x, layer.weight, layer.bias), rtol=0, atol=1e-12)
            assert y.is_contiguous()  # row-major, as the stock form's (the next ops are slow on a transposed one)
    assert stock == [1, 4, 15, 32, 33]
    # A shape measured takes its own choice (here: never thin); one not measured (a draft's) the choice for all.
    other = torch.nn.Linear(8, 5).double()
    with linear_forms.thin_linear([layer, other], (2,), (1, 2, 4), {"4x8": ()}):
        stock.clear()
        layer(torch.randn(3, 8, dtype=torch.float64))
        other(torch.randn(3, 8, dtype=torch.float64))
    assert stock == [3]

    target = make_model("llama", dtype=torch.float64)
    profile = Profile(profile_key(target), FLAT, (2,), {}, {}, (1, 2, 4))
    assert Profile.from_json(json.loads(json.dumps(profile.to_json())), profile_key(target)) == profile
    save_profile(target, profile)
    with calibration.host_linear(target):
        stock.clear()
        target.model.layers[0].mlp.down_proj(torch.randn(3, target.config.intermediate_size, dtype=torch.float64))
    assert stock == []  # 3 rows: between 2 (thin) and 4


def test_cli_calibrate_writes_a_profile(tmp_path, monkeypatch, capsys):
    from hf_specdec import cli

    target = make_model("llama", dtype=torch.float32)
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: (target, None))
    monkeypatch.setattr(cli, "calibrate", lambda model, speculators=(), force=False, progress=None, retry=True,
                        _real=calibration.calibrate: _real(model, speculators, force, progress=progress, retry=retry,
                                                           **TINY_GRID))
    assert cli.main(["calibrate", "--threads", str(torch.get_num_threads())]) == 0
    assert load_profile(target) is not None
    assert "plain steps" in capsys.readouterr().out


# Measurements a busy host spoils ------------------------------------------------------------------------------------
def _relative(profile, tokens, rows=1) -> float:
    return float(profile.step_cost.relative(rows, torch.tensor(float(tokens)), rows * 8))


def test_timings_whose_repeats_disagree_are_measured_again_and_a_steady_pass_kept(caplog):
    target = make_model("llama", dtype=torch.float32)
    # Two of the first five timings of 2-token forwards at batch 1 run 4x slow (a busy moment); then all is quiet.
    slow = fake_timer(slowdown=lambda key, call: 4.0 if key == ("step", 1, 2, 8) and call in (2, 3) else 1.0)
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        profile = calibrate(target, **GRID, timer=slow)
    assert profile is not None and profile.details["step_attempts"] == 2 and load_profile(target) == profile
    quiet = calibrate(make_model("llama", dtype=torch.float32), **GRID, force=True, timer=fake_timer())
    assert quiet.details["step_attempts"] == 1
    # The second pass alone, as if the host had been quiet (to rounding: LAPACK's least squares is not bitwise
    # reproducible from call to call).
    got, want = profile.step_cost, quiet.step_cost
    assert got.per_row == pytest.approx(want.per_row, abs=1e-9)
    assert got.per_context_token == pytest.approx(want.per_context_token, abs=1e-9)
    assert [n for n, _ in got.points] == [n for n, _ in want.points]
    assert [t for _, t in got.points] == pytest.approx([t for _, t in want.points], rel=1e-9)
    assert _relative(profile, 2) == pytest.approx((0.040 + 0.004 + 8e-5) / (0.040 + 0.002 + 8e-5))
    assert not caplog.records


@pytest.mark.parametrize("spoiled", ["disagree", "implausible"])
def test_an_untrustworthy_step_cost_is_not_cached_but_the_forms_are_and_calls_keep_the_static_default(spoiled, caplog, monkeypatch):
    target = make_model("llama", dtype=torch.float32)
    if spoiled == "disagree":  # every pass has a 2-token forward at batch 1 slowed 4x in two of its five repeats
        timer = fake_timer(slowdown=lambda key, call: 4.0 if key == ("step", 1, 2, 8) and call % 5 in (2, 3) else 1.0)
        reason = "disagree between repeats (worst: a forward of 1 row(s) x 2 token(s) over 8 cached"
    else:  # steady, but a 2-token forward at batch 1 at 4.6 one-token ones (what a busy host measured)
        timer = fake_timer(cost=lambda key: steady(key) * (4.6 * 0.04208 / 0.04408 if key == ("step", 1, 2, 8)
                                                           else 1.0))
        reason = "a forward of 1 row(s) x 2 token(s) over 8 cached took 4.60 times the one-token (one-row) cost"
    # The thin form steadily at half the stock one's time over 2 and 3 rows: the forms are trusted, and kept.
    thin = fake_timer(cost=lambda key: 0.5 * steady(key) if key[:2] == ("linear", "thin") and key[2] > 1
                      else steady(key))
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        profile = calibrate(target, **GRID, timer=lambda key, fn: (thin if key[0] == "linear" else timer)(key, fn))
    assert profile == load_profile(target) and profile.step_cost is None
    assert profile.thin_linear_rows == (2, 3) and profile.linear_rows == GRID["linear_rows"]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "the step cost measured now is not trustworthy" in warning and reason in warning
    assert "measured 2 time(s)" in warning and "static default" in warning and "forms measured are cached" in warning
    step_cost, _, source = calibration.adaptive_costs(target, resolve_speculator("ngram"))
    # Priced by the static curve timed with a host's own forms, which this call runs (the stock forms' curve prices a
    # second token at half a plain step, where these make it next to free)
    assert step_cost == HOST_FORMS_CPU_STEP_COST.pessimistic() and "static default" in source
    assert "this host's linear forms" in source
    with monkeypatch.context() as patch:  # the forms turned off: the stock forms' curve
        patch.setenv("HF_SPECDEC_THIN_LINEAR", "off")
        assert calibration.adaptive_costs(target, resolve_speculator("ngram"))[0] == \
            DEFAULT_STEP_COST["cpu"].pessimistic()
    assert "not trustworthy" in source and "no step cost" in calibration.describe(profile)
    # The same host, quiet again: the step cost is measured with the cached forms in use, which are not timed again.
    order = []
    quiet = calibrate(target, **GRID, timer=fake_timer(order=order))
    assert quiet == load_profile(target) and quiet.step_cost is not None and quiet.thin_linear_rows == (2, 3)
    assert order and all(key[0] == "step" for key in order)
    assert calibration.adaptive_costs(target, resolve_speculator("ngram"))[0] == quiet.step_cost


def test_the_small_row_linear_form_is_timed_side_by_side_and_a_burst_of_load_does_not_pick_it(caplog):
    target = make_model("llama", dtype=torch.float32)
    order = []
    # Both forms cost the same; a burst of load slows 6 consecutive timings in the second round 20x.
    timer = fake_timer(slowdown=lambda key, call: 1.0, order=order)
    burst = set()

    def timed(key, fn):
        seconds = timer(key, fn)
        n = len(order)
        if key[0] == "linear" and 40 < n <= 46:
            burst.add(key[1])
            return 20 * seconds
        return seconds

    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        profile = calibrate(target, **GRID, timer=timed)
    assert burst == {"stock", "thin"} or len(burst) == 1  # the burst hit some timings ...
    assert profile.thin_linear_rows == () and profile.details["linear_attempts"] == 1  # ... and changed nothing
    linear = [key for key in order if key[0] == "linear"]
    pairs = {(key[2], key[3]) for key in linear}
    assert len(linear) == 2 * len(pairs) * GRID["repeats"]
    for first, second in zip(linear[::2], linear[1::2]):  # each (rows, shape) in both forms, one after the other
        assert first[2:] == second[2:] and {first[1], second[1]} == {"stock", "thin"}
    assert {first[1] for first in linear[::2]} == {"stock", "thin"}  # either form goes first in some rounds
    # Where the thin form is steadily twice as fast over 2 and 3 rows, it is chosen there.
    halved = fake_timer(cost=lambda key: steady(key) / (2 if key[:2] == ("linear", "thin") and key[2] > 1 else 1))
    assert calibrate(target, **GRID, force=True, timer=halved).thin_linear_rows == (2, 3)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_load_that_slows_both_forms_of_a_pair_alike_does_not_hide_the_faster_form(caplog):
    """A host whose load comes and goes (round after round 1x, 3x, 1x, 5x, 2x slower) spoils absolute linear timings
    but not the side-by-side ratio: thin steadily at half stock's time over 2 and 3 rows is still chosen."""
    target = make_model("llama", dtype=torch.float32)
    load = [1.0, 3.0, 1.0, 5.0, 2.0]

    def cost(key):
        return steady(key) / (2 if key[:2] == ("linear", "thin") and key[2] > 1 else 1)

    # Each (form, rows, shape) key is timed once per round: its call count is the round.
    timer = fake_timer(cost=cost, slowdown=lambda key, call: load[(call - 1) % 5] if key[0] == "linear" else 1.0)
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        profile = calibrate(target, **GRID, timer=timer)
    assert profile.thin_linear_rows == (2, 3) and profile.details["linear_attempts"] == 1
    # One row is timed too (as two, `thin_product`): at stock's time here, so it keeps the stock form.
    assert profile.details["linear_thin_over_stock"] == {"1": 1.0, "2": 0.5, "3": 0.5}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_linear_form_is_chosen_per_weight_shape(caplog):
    """Thin steadily at half stock's time for the LM head's weight alone (as an LM head's `[vocab, hidden]` product
    is on an AMD EPYC with MKL): the profile takes it there, for that shape only, though over all the layers the
    forms tie; under `host_linear` the LM head runs thin and the other layers are left as they are."""
    target = make_model("llama", dtype=torch.float32)
    head = linear_forms.shape_key(target.lm_head.weight.shape)

    def cost(key):
        return steady(key) / (2 if key[:2] == ("linear", "thin") and key[2] > 1 and key[3] == tuple(
            target.lm_head.weight.shape) else 1)

    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        profile = calibrate(target, **GRID, timer=fake_timer(cost=cost))
    assert profile.thin_linear_rows == () and {k: v for k, v in profile.thin_linear_shapes.items() if v} == {
        head: (2, 3)}
    assert set(profile.thin_linear_shapes) == {linear_forms.shape_key(m.weight.shape) for m in target.modules()
                                               if isinstance(m, torch.nn.Linear)}  # every shape measured
    assert profile.details["linear_thin_over_stock_by_shape"][head] == {"1": 1.0, "2": 0.5, "3": 0.5}
    assert load_profile(target) == profile
    layers = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    with calibration.host_linear(target):
        assert [m for m in layers if "forward" in vars(m)] == [target.lm_head]
    assert not [m for m in layers if "forward" in vars(m)]
    assert f"linear layers of weight {head} as (W @ x.T).T at 2-3 input rows" in calibration.describe(profile)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_shape_takes_the_pooled_thin_choice_unless_its_own_ratio_says_thin_is_slower():
    """Over all layers the thin form takes half stock's time at 2 rows. One small shape's own ratio there sits past
    the margin yet below 1 (its products are short, its timing wanders): it takes thin with the others. Another's
    ratio is above 1: it keeps the stock form. At 1 row nothing is faster: stock everywhere."""
    target = make_model("llama", dtype=torch.float32)
    shapes = sorted({tuple(m.weight.shape) for m in target.modules() if isinstance(m, torch.nn.Linear)})
    near, slower = shapes[0], shapes[1]

    def cost(key):
        if key[:2] != ("linear", "thin") or key[2] == 1:
            return steady(key)
        return steady(key) * (0.9 if key[3] == near else 1.2 if key[3] == slower else 0.3)

    profile = calibrate(target, **GRID, timer=fake_timer(cost=cost))
    assert profile.thin_linear_rows == (2, 3)
    forms = {tuple(int(n) for n in k.split("x")): v for k, v in profile.thin_linear_shapes.items()}
    assert forms[near] == (2, 3) and forms[slower] == ()
    assert all(v == (2, 3) for s, v in forms.items() if s not in (near, slower))


def test_one_row_runs_as_two_where_the_thin_form_won_there(caplog):
    """Thin chosen at one row (timed as two rows, `thin_product`): a decode step's layers compute their one row in
    the matrix kernel, the row twice and the first result kept. Each result is the product's (up to the kernel's
    rounding), and greedy output with the engine stays the target's own."""
    target = make_model("llama", dtype=torch.float32)
    weight, x = torch.randn(24, 16), torch.randn(1, 16)
    assert linear_forms.thin_product(weight, x).shape == (1, 24)
    torch.testing.assert_close(linear_forms.thin_product(weight, x), torch.nn.functional.linear(x, weight))
    two_rows = linear_forms.thin_product(weight, x.repeat(2, 1))
    torch.testing.assert_close(linear_forms.thin_product(weight, x), two_rows[:1], rtol=0, atol=0)

    def cost(key):
        return steady(key) / (2 if key[:2] == ("linear", "thin") else 1)

    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        profile = calibrate(target, **GRID, timer=fake_timer(cost=cost))
    assert 1 in profile.thin_linear_rows
    calls = []
    original = linear_forms.thin_product

    def counting(weight, x):
        calls.append(x.shape[0])
        return original(weight, x)

    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    expected = target.generate(ids, max_new_tokens=8, do_sample=False)
    linear_forms.thin_product = counting
    try:
        out = target.generate(ids, max_new_tokens=8, do_sample=False, speculator="off")
    finally:
        linear_forms.thin_product = original
    assert torch.equal(out, expected) and 1 in calls


def test_the_thin_form_is_timed_only_at_the_rows_asked_for():
    """`thin_rows` (the first call leaves out its largest row count): the thin form is timed there only, and where it
    is not timed the stock form stays, though it would win."""
    target = make_model("llama", dtype=torch.float32)

    def cost(key):
        return steady(key) / (2 if key[:2] == ("linear", "thin") else 1)

    profile = calibrate(target, **dict(GRID, thin_rows=(1, 2)), timer=fake_timer(cost=cost))
    assert set(profile.details["linear_ms"]) == {"1", "2"} and profile.linear_rows == (1, 2, 3)
    assert profile.thin_linear_rows == (1, 2)
    assert calibration.thin_row_table(profile.thin_linear_rows, profile.linear_rows) == [False, True, True, False]
    with pytest.raises(ValueError, match="thin_rows"):
        calibrate(target, **dict(GRID, thin_rows=(1, 5)), timer=fake_timer(cost=cost))


def test_a_ratio_on_both_sides_of_the_margin_keeps_the_stock_form_there(caplog):
    """Over 2 rows the thin form takes half stock's time in some rounds and all of it in others: no choice there;
    over 3 rows it is steadily twice as fast: chosen. Nothing is untrustworthy about that."""
    target = make_model("llama", dtype=torch.float32)

    def slowdown(key, call):
        return 2.0 if key[:3] == ("linear", "thin", 2) and call % 2 == 0 else 1.0

    timer = fake_timer(cost=lambda key: steady(key) / (2 if key[:2] == ("linear", "thin") and key[2] > 1 else 1),
                       slowdown=slowdown)
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        profile = calibrate(target, **GRID, timer=timer)
    assert profile.thin_linear_rows == (3,) and profile.details["linear_attempts"] == 1
    assert profile.details["linear_thin_over_stock"]["2"] == 0.5  # the median alone would have chosen it
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_untrustworthy_linear_timing_keeps_the_stock_form():
    target = make_model("llama", dtype=torch.float32)
    # Thin looks 3x faster over 2 and 3 rows, but 3 rows take 10x what 2 do, in either form: more than 1.25x the
    # work (one row is not timed, so the least row count timed, 2, is the unit).
    timer = fake_timer(cost=lambda key: steady(key) * (10 if key[0] == "linear" and key[2] > 2 else 1)
                       / (3 if key[:2] == ("linear", "thin") and key[2] > 1 else 1))
    profile = calibrate(target, **GRID, timer=timer)
    assert profile.thin_linear_rows == ()  # the faster form (thin) over 3 rows is 15x two rows: not trusted
    assert profile.details["linear_attempts"] == 2 and profile.details["step_attempts"] == 1


@pytest.mark.parametrize("noisy", [False, True])
def test_a_draft_cost_is_kept_only_when_its_calls_agree(noisy, monkeypatch, caplog):
    target = make_model("llama", dtype=torch.float32)
    draft = make_model("llama", seed=1, dtype=torch.float32)
    calls = []

    def sample(model, speculator, ids, k, max_new_tokens):
        calls.append(max_new_tokens)
        slow = 5.0 if noisy and len(calls) % 3 == 0 else 1.0  # each pass's third call drafts 5x slower
        return 2.0 * slow, 40.0  # ms per drafted token, ms per verify step

    monkeypatch.setattr(draft_cost, "draft_sample", sample)
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        profile = calibrate(target, [resolve_speculator(draft)], **GRID, timer=fake_timer())
    key = profiles.speculator_key(resolve_speculator(draft))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if noisy:
        assert key not in profile.draft_costs and key not in load_profile(target).draft_costs
        assert len(calls) == 1 + 3 + 3  # a warm-up, then two passes of three calls
        assert len(warnings) == 1 and "DraftModelSpeculator's draft cost is not trustworthy" in warnings[0]
        assert "a drafted token's cost, 0.05951 plain steps to 0.2975" in warnings[0]
        assert "priced by its parameter count" in warnings[0]
        assert "estimated from parameter counts" in calibration.adaptive_costs(target, resolve_speculator(draft))[2]
    else:
        # Drafting's time over the same calls' 5-token verifies, in plain steps.
        expected = round(2.0 / 40.0 * float(profile.step_cost.relative(1, torch.tensor(5.0), 64 + 12)), 4)
        assert load_profile(target).draft_costs[key] == expected and len(calls) == 1 + 3 and not warnings


def test_a_busy_host_is_noticed_before_the_grid_is_measured(caplog):
    target = make_model("llama", dtype=torch.float32)
    order = []
    # Every third one-token forward (the first thing timed) runs 10x slow, in every try.
    timer = fake_timer(slowdown=lambda key, call: 10.0 if call % 3 == 2 else 1.0, order=order)
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        assert calibrate(target, **GRID, timer=timer) is None
    # nothing else was measured
    assert order == [("step", 1, 1, 8)] * (calibration.PROBE_REPEATS * calibration.PROBE_ATTEMPTS)
    [warning] = [r.getMessage() for r in caplog.records]
    assert "this host's timing now is not trustworthy" in warning and "nothing is measured or cached" in warning
    assert not profile_path(target).exists()


def test_a_hiccup_in_the_first_probe_is_tried_again():
    """Two slow one-token forwards in the probe's first try (a hiccup, not a busy host): the probe tries again, finds
    the host steady and the grid is measured and cached."""
    target = make_model("llama", dtype=torch.float32)
    order = []
    probe_key = ("step", 1, 1, 8)
    timer = fake_timer(slowdown=lambda key, call: 10.0 if key == probe_key and call in (2, 5) else 1.0, order=order)
    profile = calibrate(target, **GRID, timer=timer)
    assert profile is not None and profile.step_cost is not None and profile_path(target).exists()
    assert order[:2 * calibration.PROBE_REPEATS] == [probe_key] * (2 * calibration.PROBE_REPEATS)
    assert len(order) > 2 * calibration.PROBE_REPEATS  # then the grid


def test_calls_that_calibrate_on_their_own_do_not_retry_an_unsteady_host_at_once(monkeypatch):
    """`run`, `serve` and the demo calibrate with `retry=False`: after a measurement found the host unsteady, they
    skip it (each try costs minutes on a busy host) until `UNSTEADY_RETRY_S` has passed; `hf-specdec calibrate`
    (`retry=True`) and `force` measure at once, and a trusted measurement clears the note."""
    target = make_model("llama", dtype=torch.float32)
    busy = fake_timer(slowdown=lambda key, call: 10.0 if call % 3 == 2 else 1.0)
    assert calibrate(target, **GRID, timer=busy, retry=False) is None
    assert profiles.recently_unsteady(target, "step") is not None
    order = []
    assert calibrate(target, **GRID, timer=fake_timer(order=order), retry=False) is None
    assert order == []  # skipped: nothing timed
    later = time.time() + profiles.UNSTEADY_RETRY_S + 1
    with monkeypatch.context() as patch:
        patch.setattr(profiles.time, "time", lambda: later)
        assert profiles.recently_unsteady(target, "step") is None
    assert calibrate(target, **GRID, timer=fake_timer(), retry=True) == load_profile(target) is not None
    assert profiles.recently_unsteady(target, "step") is None


needs_onednn = pytest.mark.skipif(not linear_forms.packed_linear_supported(torch.zeros(1)),
                                  reason="torch built without oneDNN")


@needs_onednn
def test_the_packed_form_is_chosen_where_it_beats_the_other_and_taken_before_thin(monkeypatch):
    """The packed form steadily at half the chosen form's time for the LM head over 2 and 3 rows (thin chosen there
    too): the profile names it for that shape and those rows, `host_linear` computes the head packed there (and
    thin/stock elsewhere), and `HF_SPECDEC_PACKED_LINEAR=off` leaves only the thin choice."""
    target = make_model("llama", dtype=torch.float32)
    head = tuple(target.lm_head.weight.shape)

    def cost(key):
        if key[0] == "linear" and key[1] == "thin" and key[2] > 1 and key[3] == head:
            return steady(key) / 2
        if key[0] == "packed" and key[1] == "packed" and key[2] > 1 and key[3] == head:
            return steady(key) / 2
        return steady(key)

    profile = calibrate(target, **GRID, timer=fake_timer(cost=cost))
    key = linear_forms.shape_key(head)
    assert {k: v for k, v in profile.packed_linear_shapes.items() if v} == {key: (2, 3)}
    assert profile.details["linear_packed_over_chosen_by_shape"][key] == {"1": 1.0, "2": 0.5, "3": 0.5}
    # Past the last count measured (3) the packed choice made there holds up to four times it.
    assert f"linear layers of weight {key} packed for oneDNN at 2-12 input rows" in calibration.describe(profile)
    calls = []
    packed = linear_forms.packed_linear
    monkeypatch.setattr(linear_forms, "packed_linear", lambda x, *a: calls.append(x.shape[0]) or packed(x, *a))
    hidden = target.config.hidden_size
    with calibration.host_linear(target), torch.no_grad():  # as in our calls (the packed product has no backward)
        for rows in (1, 2, 3, 12, 13):
            x = torch.randn(rows, hidden)
            torch.testing.assert_close(target.lm_head(x), torch.nn.functional.linear(x, target.lm_head.weight))
    assert calls == [2, 3, 12]
    monkeypatch.setenv("HF_SPECDEC_PACKED_LINEAR", "off")
    calls.clear()
    with calibration.host_linear(target):
        target.lm_head(torch.randn(2, hidden))
        assert "forward" in vars(target.lm_head)  # thin there still
    assert calls == []



@needs_onednn
def test_a_count_between_thin_and_packed_choices_takes_the_packed_form(monkeypatch):
    """Measured at 1, 2, 4, 6 and 8 rows: thin at 1-4, packed at 6 and 8. Five rows lie between a thin and a packed
    choice: packed (the thin form's time grows with rows, the packed form's hardly); three lie between two thin
    choices: thin; seven between two packed: packed."""
    assert linear_forms._packed_above_thin([0, 1, 1, 1, 1, 1, 2, 2, 2], (1, 2, 4, 6, 8)) == [0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert linear_forms._packed_above_thin([0, 1, 1, 1, 1, 0, 0], (1, 2, 4, 6)) == [0, 1, 1, 1, 1, 0, 0]  # no packed
    layer = torch.nn.Linear(8, 4)
    calls = []
    packed = linear_forms.packed_linear
    monkeypatch.setattr(linear_forms, "packed_linear", lambda x, *a: calls.append(x.shape[0]) or packed(x, *a))
    with linear_forms.thin_linear([layer], (1, 2, 4), (1, 2, 4, 6, 8), packed={"4x8": (6, 8)}), torch.no_grad():
        for rows in (3, 4, 5, 6, 7):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert calls == [5, 6, 7]

@needs_onednn
def test_packed_linear_follows_plain_generate_and_the_weights(monkeypatch):
    """Every float32 layer packed at every row count: greedy output equals plain `generate` (float32 rounding
    differs in the last bits, as any other product kernel's; these prompts sit on no near-tie), each product is
    within float32 rounding of `F.linear`, the copy is kept between calls, and packed again once the weight
    changes in place. Nothing packed when the copies would not fit in memory."""
    target = make_model("llama", dtype=torch.float32)
    input_ids, mask = ragged_batch()
    plain = target.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    every = {linear_forms.shape_key(m.weight.shape): tuple(range(1, 65)) for m in target.modules()
             if isinstance(m, torch.nn.Linear)}
    save_profile(target, Profile(profile_key(target), FLAT, (), {}, {}, tuple(range(1, 65)), {}, every))
    packs = []
    pack = linear_weights.pack_linear_weight
    monkeypatch.setattr(linear_weights, "pack_linear_weight", lambda w: packs.append(w.shape) or pack(w))
    for _ in range(2):
        out = target.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False, speculator="ngram",
                              num_speculative_tokens=3, speculative_schedule="constant")
        assert torch.equal(out, plain)
    layers = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    assert len(packs) == len(layers)  # packed once, kept for the second call
    assert not any("forward" in vars(m) for m in layers)
    layer = target.model.layers[0].mlp.down_proj
    x = torch.randn(5, layer.in_features)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    with calibration.host_linear(target), torch.no_grad():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(x[None]), torch.nn.functional.linear(x[None], layer.weight), rtol=1e-5,
                                   atol=1e-5)  # 3-d input, as a model's
    assert len(packs) == len(layers) + 1  # the changed weight alone packed again

    class Scarce:
        available = 1024

    import psutil

    other = make_model("llama", seed=3, dtype=torch.float32)
    save_profile(other, Profile(profile_key(other), FLAT, (), {}, {}, tuple(range(1, 65)), {}, every))
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Scarce())
    packs.clear()
    with calibration.host_linear(other):
        assert not any("forward" in vars(m) for m in other.modules())
    assert packs == []


@needs_onednn
def test_packed_linear_stands_aside_where_its_copy_cannot_serve(monkeypatch):
    """Inside one block: a weight changed in place, an input that wants gradients, a bfloat16 input all get the
    product of the live weight (the other forms), not the copy's; two layers sharing a weight share one copy; and
    with the packed form turned off the copies kept are freed."""
    layer = torch.nn.Linear(64, 32)
    twin = torch.nn.Linear(64, 32)
    twin.weight = layer.weight  # tied, as an LM head to its embedding
    every = {"32x64": tuple(range(1, 65))}
    with linear_forms.thin_linear([layer, twin], (), tuple(range(1, 65)), None, every):
        assert len({id(linear_forms._PACKED[m][1]) for m in (layer, twin)}) == 1
        x = torch.randn(4, 64)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
            layer.weight.mul_(-1.0)
            torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        wanted = torch.randn(4, 64, requires_grad=True)
        layer(wanted).sum().backward()
        assert wanted.grad is not None and layer.weight.grad is not None
        with torch.no_grad():
            half = x.bfloat16()
            assert layer.bfloat16()(half).dtype == torch.bfloat16  # cast: the copy no longer stands for it
    target = make_model("llama", dtype=torch.float32)
    shapes = {linear_forms.shape_key(m.weight.shape): tuple(range(1, 65)) for m in target.modules()
              if isinstance(m, torch.nn.Linear)}
    save_profile(target, Profile(profile_key(target), FLAT, (), {}, {}, tuple(range(1, 65)), {}, shapes))
    with calibration.host_linear(target):
        pass
    assert target.lm_head in linear_forms._PACKED
    monkeypatch.setenv("HF_SPECDEC_PACKED_LINEAR", "off")
    with calibration.host_linear(target):
        pass
    assert not any(m in linear_forms._PACKED for m in target.modules())


def test_linear_forms_are_timed_over_distinct_weights_as_a_forward_reads_them(monkeypatch):
    """A forward reads each layer's weight from memory, so each form is timed over up to `COLD_PRODUCTS` of the
    model's own weights of a shape, each form over its own where the model has enough (the second would otherwise
    find the first's in cache), never one weight over and over."""
    items = list(range(20))
    assert linear_forms.cold_weights(items, 2) == [list(range(8)), list(range(8, 16))]
    assert linear_forms.cold_weights(items[:3], 2) == [[0, 1, 2], [0, 1, 2]]  # too few: shared, each once
    target = make_model("llama", dtype=torch.float32)
    read: dict[tuple, list[int]] = {}
    current = []
    stock = torch.nn.functional.linear

    def linear(x, w, *args):
        if current:  # not the untimed warm-up
            read.setdefault(current[0], []).append(w.data_ptr())
        return stock(x, w, *args)

    def timer(key, fn):
        current[:] = [key]
        fn()
        current.clear()
        return steady(key)

    monkeypatch.setattr(linear_forms.F, "linear", linear)
    linear_forms.measure_thin_linear(target, (1,), 0.8, repeats=1, timer=timer, attempts=1)
    layers = [m for m in target.modules() if isinstance(m, torch.nn.Linear)]
    for shape in {tuple(m.weight.shape) for m in layers}:
        own = {m.weight.data_ptr() for m in layers if tuple(m.weight.shape) == shape}
        ptrs = read["linear", "stock", 1, shape]
        assert len(ptrs) == len(set(ptrs)) == min(len(own), linear_forms.COLD_PRODUCTS) and set(ptrs) <= own


def _groups(model) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {}
    for g in linear_forms.linear_groups([model]):
        out.setdefault(linear_forms.group_key(g), []).append(g)
    return out


@needs_onednn
def test_sibling_layers_run_as_one_product_where_the_profile_says(monkeypatch):
    """A profile naming the q/k/v and gate/up groups at every row count: each group runs one packed product per
    forward in place of its members' (so a layer makes 2 products there instead of 5), each member's output is its
    own `F.linear` within float32 rounding, and greedy output equals plain `generate`, with and without drafts."""
    target = make_model("llama", dtype=torch.float32)
    groups = _groups(target)
    layers = len(target.model.layers)
    assert sorted(len(g[0]) for g in groups.values()) == [2, 3] and all(len(g) == layers for g in groups.values())
    input_ids, mask = ragged_batch()
    plain = target.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    every = {key: tuple(range(1, 65)) for key in groups}
    save_profile(target, Profile(profile_key(target), FLAT, (), {}, {}, tuple(range(1, 65)), {}, {}, every))
    for speculator in ("off", "ngram"):
        out = target.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                              speculator=speculator, num_speculative_tokens=3, speculative_schedule="constant")
        assert torch.equal(out, plain)
    assert not any("forward" in vars(m) for m in target.modules())  # restored after the call
    calls = []
    packed = linear_weights.packed_linear
    monkeypatch.setattr(linear_weights, "packed_linear", lambda x, p, b: calls.append(p) or packed(x, p, b))
    x = torch.randn(1, 4, target.config.hidden_size)
    with calibration.host_linear(target), torch.no_grad():
        target(inputs_embeds=x)
        attention, mlp = target.model.layers[0].self_attn, target.model.layers[0].mlp
        for m in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj):
            torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.weight), rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 * layers + 2  # the forward's, then the members above (called with one input) share too
    profile = load_profile(target)
    key = next(k for k in groups if k.count("+") == 2)
    assert f"sibling linear layers of weights {key} as one packed product at 1-64 input rows" in \
        calibration.describe(profile)
    monkeypatch.setenv("HF_SPECDEC_PACKED_LINEAR", "off")
    with calibration.host_linear(target):
        assert not any("forward" in vars(m) for m in target.modules())


@needs_onednn
def test_a_group_whose_members_do_not_share_their_input_computes_each_its_own():
    """Inside one block: members called with different inputs, an input changed in place between two members, a
    weight changed in place, and an input that wants gradients each get their own product, never a sibling's."""
    attention = make_model("llama", dtype=torch.float32).model.layers[0].self_attn
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    key = linear_forms.group_key((q, k, v))
    linear = torch.nn.functional.linear

    def check(m, x):
        torch.testing.assert_close(m(x), linear(x, m.weight), rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        x, y = torch.randn(2, q.in_features), torch.randn(2, q.in_features)
        with linear_forms.thin_linear([attention], (), tuple(range(1, 65)), None, None, {key: tuple(range(1, 65))}):
            check(q, x)
            check(k, y)  # another input: not q's sibling output
            check(v, x)  # the group now computes each member on its own
            check(q, x)
        with linear_forms.thin_linear([attention], (), tuple(range(1, 65)), None, None, {key: tuple(range(1, 65))}):
            check(q, x)
            x.mul_(2.0)  # changed in place after q's product
            check(k, x)
            v.weight.mul_(-1.0)
            check(v, x)
            check(q, x)
        with linear_forms.thin_linear([attention], (), tuple(range(1, 65)), None, None, {key: tuple(range(1, 65))}):
            v.weight.mul_(-1.0)  # changed before the group's first product: the stacked copy no longer stands for it
            check(q, x)
            check(k, x)
            check(v, x)
    with linear_forms.thin_linear([attention], (), tuple(range(1, 65)), None, None, {key: tuple(range(1, 65))}):
        wanted = torch.randn(2, q.in_features, requires_grad=True)
        sum(m(wanted).sum() for m in (q, k, v)).backward()
        assert wanted.grad is not None and q.weight.grad is not None


@needs_onednn
def test_a_group_is_fused_where_its_one_product_beats_its_members_timed_in_a_forward_order():
    """The q/k/v group's one product at half its members' time over 2 and 3 rows: the profile names it there. Each
    form is timed in passes over the model's layers in their order, the chosen form's pass between the packed
    and the fused ones, and the fused pass over the packed pass's blocks."""
    target = make_model("llama", dtype=torch.float32)
    key = next(k for k in _groups(target) if k.count("+") == 2)

    def cost(k):
        return steady(k) / (2 if k[:2] == ("packed", "fused") and k[2] > 1 and k[3] == key else 1)

    order = []
    profile = calibrate(target, **GRID, timer=fake_timer(cost=cost, order=order))
    assert {k: v for k, v in profile.fused_linear_groups.items() if v} == {key: (2, 3)}
    assert profile.details["linear_fused_over_apart_by_group"][key] == {"1": 1.0, "2": 0.5, "3": 0.5}
    passes = []
    for k in order:
        if k[0] == "packed" and (not passes or passes[-1][:2] != k[1:3]):
            passes.append(k[1:3])
    for i in range(0, len(passes), 3):
        assert [p[0] for p in passes[i:i + 3]] in (["packed", "chosen", "fused"], ["fused", "chosen", "packed"])
    fused = [k[3:] for k in order if k[:3] == ("packed", "fused", 1)]
    first = fused[:len(fused) // GRID["repeats"]]
    assert [position for _, position in first] == list(range(len(first)))
    attention, mlp = target.model.layers[0].self_attn, target.model.layers[0].mlp
    gate_up = linear_forms.group_key((mlp.gate_proj, mlp.up_proj))
    block = [key, tuple(attention.o_proj.weight.shape), gate_up, tuple(mlp.down_proj.weight.shape)]
    assert [what for what, _ in first] == block * (len(first) // 4)  # a forward's order, the LM head left out
