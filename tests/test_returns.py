"""`DraftReturns`: what drafting returned per band of batch sizes, and adaptive k's margin from it."""

import math

import pytest

from hf_specdec.adaptive import AdaptiveK, StepCost
from hf_specdec.returns import DraftReturns

# A step cost under which, at the acceptance below, drafts promise to pay: a token costs 1% of a 4-row step.
CURVE = StepCost(per_row=0.0, points=((1.0, 10.0), (64.0, 10.0 + 63 * 0.1)))


def _policy(rows: int = 4) -> AdaptiveK:
    policy = AdaptiveK(rows, 3, CURVE, priors=(0.6,), packed=True, check_returns=True)
    for _ in range(20):
        policy.update(list(range(rows)), [3] * rows, [2] * rows)  # acceptance about 0.67
    return policy


def _steps(returns: DraftReturns, rows: int, plain_s: float, drafting_s: float, accepted: float, n: int) -> None:
    """n plain steps then n drafting steps at `rows` rows over 100 cached tokens a row."""
    for _ in range(n):
        returns.observe(rows, 100.0 * rows, plain_s, 0.0, float(rows), False)
    for _ in range(n):
        returns.observe(rows, 100.0 * rows, drafting_s, accepted, float(rows), True)


@pytest.mark.parametrize("rows", [1, 4, 12])
def test_return_is_accepted_drafts_over_the_tokens_the_extra_time_would_have_made(rows):
    """A band's return: accepted drafts per token that the drafting steps' extra time would have made in plain steps
    of the same band (the plain steps' time, whatever the curve says in absolute terms), shrunk towards the prior."""
    returns = DraftReturns(CURVE, decay=1.0, prior_tokens=1e-9)
    _steps(returns, rows, plain_s=0.050, drafting_s=0.075, accepted=rows / 4, n=10)
    # each drafting step took half a plain step more: rows / 2 tokens spent, rows / 4 accepted
    assert returns.value(rows) == pytest.approx(0.5, rel=1e-6)
    assert returns.factor(rows) == pytest.approx(0.5, rel=1e-6)
    assert DraftReturns.band(rows) == DraftReturns.band(rows + 1 if rows > 1 else 1)
    prior = DraftReturns(CURVE)  # no evidence: the prior, which does not restrain
    assert prior.value(rows) == pytest.approx(1.2) and prior.factor(rows) == 1.0


def test_a_band_where_drafting_lost_needs_a_larger_margin_and_other_bands_do_not():
    """Drafting steps at 4 rows that take twice a plain step and get a token accepted: the margin there grows until
    the policy, which drafts on its models' promise, declines; at 16 rows (another band) nothing changes."""
    policy = _policy(16)
    rows4, rows16 = list(range(4)), list(range(16))
    assert sum(policy.choose_rows(rows4, [3] * 4)) > 0 and sum(policy.choose_rows(rows16, [3] * 16)) > 0
    _steps(policy.returns, 4, plain_s=0.010, drafting_s=0.020, accepted=1.0, n=10)
    assert policy.margin(4) > 2 * policy.min_gain
    assert policy.choose_rows(rows4, [3] * 4) == [0] * 4
    assert policy.choose(rows4, [3] * 4) == 0  # one k for all rows: the same margin
    assert policy.margin(16) == policy.min_gain and sum(policy.choose_rows(rows16, [3] * 16)) > 0


def test_a_band_where_drafting_pays_keeps_the_margin():
    policy = _policy()
    _steps(policy.returns, 4, plain_s=0.010, drafting_s=0.011, accepted=3.0, n=10)
    assert policy.returns.value(4) > 3 and policy.margin(4) == policy.min_gain
    assert sum(policy.choose_rows(list(range(4)), [3] * 4)) > 0


def test_a_band_that_stopped_drafting_is_tried_again():
    """While drafting is off in a band its plain steps decay the evidence, so the margin falls back to `min_gain`."""
    policy = _policy()
    _steps(policy.returns, 4, plain_s=0.010, drafting_s=0.020, accepted=1.0, n=10)
    assert policy.choose_rows(list(range(4)), [3] * 4) == [0] * 4
    margin, steps = policy.margin(4), 0
    while policy.choose_rows(list(range(4)), [3] * 4) == [0] * 4 and steps < 500:
        policy.returns.observe(4, 400.0, 0.010, 0.0, 4.0, False)
        steps += 1
    assert 20 < steps < 500 and policy.margin(4) < margin
    for _ in range(500):
        policy.returns.observe(4, 400.0, 0.010, 0.0, 4.0, False)
    assert policy.margin(4) == policy.min_gain


def test_one_outlier_step_counts_as_a_few_plain_steps_at_most():
    """A drafting step 100 times slower than a plain one (a compile, a pause) is spent as `SLOWEST` plain steps."""
    returns = DraftReturns(CURVE, decay=1.0, prior_tokens=1e-9)
    _steps(returns, 4, plain_s=0.010, drafting_s=1.0, accepted=2.0, n=1)
    assert returns.bands[2].spent == pytest.approx(4 * DraftReturns.SLOWEST)


def test_the_plain_reference_follows_context_and_the_hosts_speed():
    """Plain steps priced by the curve (context included) and timed: a drafting step over a longer context is
    compared with what a plain step costs there, and a host that slowed down is followed by the recent steps."""
    returns = DraftReturns(CURVE, decay=1.0, prior_tokens=1e-9)
    for _ in range(50):
        returns.observe(4, 400.0, 0.020, 0.0, 4.0, False)  # the host slowed: twice the earlier 0.010
    returns.observe(4, 400.0, 0.030, 2.0, 4.0, True)
    assert returns.bands[2].spent == pytest.approx(4 * 0.5, rel=0.01)
    # No plain step in this band yet: the other bands' ratio stands in.
    returns.observe(16, 1600.0, 2 * 0.020 * CURVE.at(16, 1.0, 1600.0) / CURVE.at(4, 1.0, 400.0), 8.0, 16.0, True)
    assert returns.bands[4].spent == pytest.approx(16.0, rel=0.01)
    nothing = DraftReturns(CURVE)
    nothing.observe(4, 400.0, 0.020, 2.0, 4.0, True)  # nothing to compare with yet: not counted
    assert 2 not in nothing.bands or nothing.bands[2].drafting_steps == 0
    assert math.isinf(DraftReturns(CURVE, prior_tokens=0.0).value(4))
