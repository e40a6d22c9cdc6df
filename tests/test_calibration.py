"""Measured costs (calibration.py): a cached profile prices drafting, its key, bad files, seeded runs, the
small-row linear form, and the warning when adaptive k keeps drafting off. No timing is asserted: profiles with
chosen numbers stand in for measured ones."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from hf_specdec import calibration
from hf_specdec.adaptive import StepCost
from hf_specdec.calibration import Profile, calibrate, load_profile, profile_key, profile_path, save_profile
from hf_specdec.generation import resolve_speculator

from conftest import make_model, ragged_batch
from test_quantization import _prompts, _trained_llama, needs_bnb, needs_torchao

# A verify of k + 1 tokens costs k + 1 plain steps: drafting can never pay.
DEAR = StepCost(per_row=0.0, points=((1, 10.0), (2, 20.0), (64, 640.0)))
# A verify costs what a plain step does, whatever its width: drafting pays whenever drafts are accepted.
FLAT = StepCost(per_row=0.0, points=((1, 10.0), (256, 10.0)))
TINY_GRID = dict(rows=(1, 2), tokens=(1, 2), contexts=(8,), repeats=1, linear_rows=(1, 2))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own empty cache directory and forgets earlier warnings."""
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_SPECDEC_CALIBRATION", "on")  # conftest turns it off for every other test
    monkeypatch.setattr(calibration, "_reported", set())
    monkeypatch.setattr(calibration, "_loaded", {})
    return tmp_path


@pytest.fixture(scope="module")
def trained():
    return _trained_llama()


def _profile(model, step_cost, draft=None, draft_cost=None, thin_rows=()) -> Profile:
    costs = {calibration.speculator_key(resolve_speculator(draft)): draft_cost} if draft is not None else {}
    return Profile(profile_key(model), step_cost, tuple(thin_rows), costs)


def _quantized(target, quantization):
    from hf_specdec import load_draft

    return load_draft(target, quantization=quantization)


QUANTIZED = [pytest.param("fp8", marks=needs_torchao), pytest.param("int8", marks=needs_bnb)]


@pytest.mark.parametrize("quantization", QUANTIZED)
def test_a_profile_where_drafting_pays_makes_a_quantized_copy_draft(trained, quantization, caplog):
    draft = _quantized(trained, quantization)
    input_ids, mask = _prompts()
    plain = trained.generate(input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, speculator=draft,
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
    kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, speculator=draft,
                  num_speculative_tokens=4, return_dict_in_generate=True)
    save_profile(target, _profile(target, FLAT, draft, 0.0))
    assert target.generate(input_ids, **kwargs).speculative_metrics.num_draft_tokens > 0  # the same draft pays here
    # ... only by this profile: without it (static defaults, the draft priced by its size) it does not.
    assert target.generate(input_ids, **kwargs, speculative_calibration=False).speculative_metrics.num_draft_tokens \
        == 0
    calibration._loaded.clear()
    caplog.clear()
    save_profile(target, _profile(target, DEAR, draft, 0.5))
    with caplog.at_level(logging.INFO, logger="hf_specdec"):
        out = target.generate(input_ids, **kwargs)
        again = target.generate(input_ids, **kwargs)
    m = out.speculative_metrics
    assert m.num_draft_tokens == 0 and m.k_per_step == [0] * m.num_steps
    assert torch.equal(out.sequences, target.generate(input_ids, attention_mask=mask, max_new_tokens=16,
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
    from hf_specdec.adaptive import AdaptiveK

    # n-gram offers drafts only where the text repeats; steps where no row offered any are not declined ones.
    policy = AdaptiveK(1, 4, DEAR)
    for _ in range(8):
        policy.choose([0], available=[0])
    assert policy.idle_explanation() is None and policy.chosen == [0] * 8
    for _ in range(9):
        policy.choose([0], available=[4])
    assert policy.chosen == [0] * 17 and "kept drafting off in 9 of 17 steps" in policy.idle_explanation()
    paying = AdaptiveK(1, 4, FLAT)
    for _ in range(8):
        paying.choose([0])
    assert paying.idle_explanation() is None and min(paying.chosen) > 0


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
    assert calibration.speculator_key(resolve_speculator(one)) != calibration.speculator_key(
        resolve_speculator(make_model("llama", dtype=torch.float64)))
    assert calibration.speculator_key(resolve_speculator("ngram")) is None


@pytest.mark.parametrize("content", [
    "{not json", "\x00\xff", json.dumps([1, 2]), json.dumps({"format": "something else"}),
    "FOREIGN",  # a valid profile, but measured for another model
    "BAD_CURVE",  # the right key, a step cost whose times decrease
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
    path.write_bytes(content.encode("latin-1"))
    input_ids, mask = ragged_batch()
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        assert load_profile(target) is None
        out = target.generate(input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False, speculator="ngram")
    assert out.shape[1] == input_ids.shape[1] + 6
    assert [r for r in caplog.records if "ignoring the calibration profile" in r.getMessage()]
    rebuilt = calibrate(target, **TINY_GRID)
    assert load_profile(target) == rebuilt and rebuilt.key == profile_key(target)


def test_calibrate_measures_once_and_leaves_the_random_state_alone():
    target = make_model("llama", dtype=torch.float32)
    draft = make_model("llama", seed=1, dtype=torch.float32)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    profile = calibrate(target, [draft, "ngram"], **TINY_GRID)
    assert torch.equal(torch.rand(3), expected)
    key = calibration.speculator_key(resolve_speculator(draft))
    assert set(profile.draft_costs) == {key} and profile.draft_costs[key] > 0
    assert all(t > 0 for _, t in profile.step_cost.points)
    mtime = profile_path(target).stat().st_mtime_ns
    assert calibrate(target, [draft], **TINY_GRID) == profile  # cached: nothing measured again
    assert profile_path(target).stat().st_mtime_ns == mtime


def test_seeded_sampling_is_reproducible_with_calibration_on():
    target = make_model("llama", dtype=torch.float64)
    draft = make_model("llama", seed=1, dtype=torch.float64)
    # Drafting pays at some widths and not at others, so adaptive k moves between 0 and a few.
    save_profile(target, _profile(target, StepCost(per_row=0.0, points=((1, 10.0), (9, 10.0), (12, 40.0))), draft,
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
    with calibration.thin_linear([target], rows=(3,)):
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight))
        assert "forward" in vars(layer)
    assert "forward" not in vars(layer)


def test_cli_calibrate_writes_a_profile(tmp_path, monkeypatch, capsys):
    from hf_specdec import cli

    target = make_model("llama", dtype=torch.float32)
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: (target, None))
    monkeypatch.setattr(calibration, "calibrate", lambda model, speculators=(), force=False, progress=None,
                        _real=calibration.calibrate: _real(model, speculators, force, progress=progress, **TINY_GRID))
    assert cli.main(["calibrate", "--threads", str(torch.get_num_threads())]) == 0
    assert load_profile(target) is not None
    assert "plain steps" in capsys.readouterr().out
