"""`DraftReturns`: what steps with drafts really cost against what adaptive k priced, per band of batch sizes, and
adaptive k's draft prices corrected by it."""

import pytest

from hf_specdec.costs.adaptive import AdaptiveK
from hf_specdec.costs.step_cost import StepCost
from hf_specdec.costs.returns import DraftReturns

# A token costs 5% of a 4-row step: at acceptance 0.67, drafting pays on this curve.
CURVE = StepCost(per_row=0.0, points=((1.0, 10.0), (64.0, 10.0 + 63 * 0.5)))


def _policy(rows: int, rate_accepted: int = 2, curve: StepCost = CURVE) -> AdaptiveK:
    policy = AdaptiveK(rows, 3, curve, priors=(0.6,), packed=True, check_returns=True)
    for _ in range(20):
        policy.update(list(range(rows)), [3] * rows, [rate_accepted] * rows)
    return policy


def _steps(returns: DraftReturns, rows: int, plain_s: float, drafting_s: float, priced: float, n: int) -> None:
    """n plain steps, then n steps with 2 drafts (1 accepted) priced at `priced` plain steps, 100 tokens a row."""
    for _ in range(n):
        returns.observe(rows, 100.0 * rows, plain_s)
    for _ in range(n):
        returns.observe(rows, 100.0 * rows, drafting_s, priced, drafted=2, accepted=1)


@pytest.mark.parametrize("rows", [1, 4, 12])
def test_scale_is_realized_over_priced_extra_in_plain_steps_of_the_band(rows):
    """Steps with drafts took half a plain step more (whatever the curve says a plain step costs: the band's plain
    steps set it) where the model priced a quarter: their extra costs twice the price."""
    returns = DraftReturns(CURVE, decay=1.0, prior=1e-9)
    _steps(returns, rows, plain_s=0.050, drafting_s=0.075, priced=0.25, n=10)
    assert returns.scale(rows) == pytest.approx(2.0, rel=1e-6)
    assert returns.scale(2 * rows) == 1.0  # another band: nothing seen
    assert DraftReturns.band(rows) == DraftReturns.band(rows + 1 if rows > 1 else 1)
    band = returns.bands[DraftReturns.band(rows)]
    assert (band.drafting_steps, band.plain_steps, band.drafted, band.accepted) == (10, 10, 20, 10)
    cheap = DraftReturns(CURVE, decay=1.0, prior=1e-9)
    _steps(cheap, rows, plain_s=0.050, drafting_s=0.0525, priced=0.25, n=10)
    assert cheap.scale(rows) == pytest.approx(0.25)  # 0.05 over 0.25 = 0.2, held at the lower bound


def test_drafts_dearer_than_priced_in_one_band_are_declined_there_only():
    policy = _policy(16)
    rows4, rows16 = list(range(4)), list(range(16))
    assert sum(policy.choose_rows(rows4, [3] * 4)) > 0 and sum(policy.choose_rows(rows16, [3] * 16)) > 0
    assert policy.choose(rows4, [3] * 4) > 0
    tokens = 1 + 6 / 4  # the drafts below: 6 over 4 rows
    priced = policy.priced_extra(4, tokens, 0, 400.0)
    for _ in range(10):
        policy.returns.observe(4, 400.0, 0.010)
        policy.returns.observe(4, 400.0, 0.010 * (1 + 4 * priced), priced, drafted=6, accepted=3)
    assert policy.returns.scale(4) > 3
    assert policy.choose_rows(rows4, [3] * 4) == [0] * 4
    assert policy.choose(rows4, [3] * 4) == 0  # one k for all rows: the same correction
    assert policy.returns.scale(16) == 1.0 and sum(policy.choose_rows(rows16, [3] * 16)) > 0


def test_drafts_cheaper_than_priced_are_verified_where_the_model_alone_declines():
    """At acceptance 0.5 and a token at 15% of a 4-row step the curve's price says no; steps that took a fifth of
    the priced extra say yes."""
    policy = _policy(4, rate_accepted=1, curve=StepCost(per_row=0.0, points=((1.0, 10.0), (64.0, 10.0 + 63 * 1.5))))
    rows = list(range(4))
    assert policy.choose_rows(rows, [3] * 4) == [0] * 4
    priced = policy.priced_extra(4, 1.5, 0, 400.0)
    for _ in range(10):
        policy.returns.observe(4, 400.0, 0.010)
        policy.returns.observe(4, 400.0, 0.010 * (1 + priced / 5), priced, drafted=2, accepted=1)
    assert policy.returns.scale(4) < 0.5 and sum(policy.choose_rows(rows, [3] * 4)) > 0


def test_a_band_that_stopped_drafting_drifts_back_and_is_tried_again():
    policy = _policy(4)
    rows = list(range(4))
    for _ in range(10):
        policy.returns.observe(4, 400.0, 0.010)
        policy.returns.observe(4, 400.0, 0.030, 0.2, drafted=6, accepted=3)
    assert policy.choose_rows(rows, [3] * 4) == [0] * 4
    steps = 0
    while policy.choose_rows(rows, [3] * 4) == [0] * 4 and steps < 500:
        policy.returns.observe(4, 400.0, 0.010)  # drafting off: plain steps only
        steps += 1
    assert 10 < steps < 500
    for _ in range(1000):
        policy.returns.observe(4, 400.0, 0.010)
    assert policy.returns.scale(4) == pytest.approx(1.0, abs=1e-6)


def test_one_outlier_step_counts_as_its_price_times_the_largest_correction_at_most():
    """A step with drafts 100 times slower than a plain one (a compile, a pause) counts 4 times its price (the
    largest correction), or a quarter of a plain step where its price is smaller."""
    returns = DraftReturns(CURVE, decay=1.0, prior=1e-9)
    _steps(returns, 4, plain_s=0.010, drafting_s=1.0, priced=0.5, n=1)
    assert returns.bands[2].realized == pytest.approx(4 * 0.5)
    returns.observe(4, 400.0, 1.0, 0.01, drafted=1, accepted=0)
    assert returns.bands[2].realized == pytest.approx(2.0 + 0.25)
    returns.observe(4, 400.0, 0.001, 0.1, drafted=1, accepted=0)  # far faster than the reference: capped too
    assert returns.bands[2].realized == pytest.approx(2.25 - 0.4)


def test_the_plain_reference_resists_a_slow_first_step_and_single_pauses():
    """The reference starts at the median of the first plain steps (the first carries one-off allocations), and a
    plain step ten times slower later moves it by a few percent; drafting steps that cost what was priced keep the
    correction near 1."""
    returns = DraftReturns(CURVE, decay=1.0, prior=1e-9)
    price = CURVE.at(4, 1.0, 400.0)
    for seconds in (0.030, 0.010, 0.010):
        returns.observe(4, 400.0, seconds)
    assert returns.bands[2].plain_ratio == pytest.approx(0.010 / price)
    for _ in range(20):
        returns.observe(4, 400.0, 0.010)
    returns.observe(4, 400.0, 0.100)
    assert returns.bands[2].plain_ratio < 1.06 * 0.010 / price
    for _ in range(10):
        returns.observe(4, 400.0, 0.010)
        returns.observe(4, 400.0, 0.0125, 0.25, drafted=2, accepted=1)
    assert 0.75 < returns.scale(4) < 1.1  # undamped, the pause would have read as drafts at a quarter of the price


def test_a_band_with_too_few_plain_steps_never_makes_drafts_cheaper():
    """One slow first plain step, then drafting steps at normal speed: they read as cheaper than priced, but with
    fewer than `SEED` plain steps the correction does not go below 1; a second plain step at normal speed takes over
    the reference (the lower median)."""
    returns = DraftReturns(CURVE, decay=1.0, prior=1e-9)
    price = CURVE.at(4, 1.0, 400.0)
    returns.observe(4, 400.0, 0.030)
    for _ in range(5):
        returns.observe(4, 400.0, 0.011, 0.1, drafted=2, accepted=1)
    assert returns.scale(4) == 1.0
    returns.observe(4, 400.0, 0.010)
    assert returns.bands[2].plain_ratio == pytest.approx(0.010 / price)


def test_a_band_without_a_fresh_plain_step_never_makes_drafts_cheaper():
    """A band that drafts every step has no fresh reference: after `STALE` such steps its correction may raise the
    price of drafts (the error heals as evidence decays) but not lower it (that error would keep drafting on with
    nothing to correct it); a band with no plain step of its own at all borrows the others' ratio on the same
    terms."""
    returns = DraftReturns(CURVE, decay=1.0, prior=1e-9)
    for _ in range(3):
        returns.observe(4, 400.0, 0.010)
    for _ in range(DraftReturns.STALE):
        returns.observe(4, 400.0, 0.0105, 0.25, drafted=2, accepted=1)  # a fifth of the price
    assert returns.scale(4) == pytest.approx(0.25)  # fresh enough: cheaper
    returns.observe(4, 400.0, 0.0105, 0.25, drafted=2, accepted=1)
    assert returns.scale(4) == 1.0  # stale: not cheaper
    for _ in range(10):
        returns.observe(4, 400.0, 0.030, 0.25, drafted=2, accepted=1)  # now dearer than priced
    assert returns.scale(4) > 1.0
    returns.observe(16, 1600.0, 0.001, 0.25, drafted=2, accepted=1)  # no plain step at 16 rows
    assert returns.scale(16) == 1.0


def test_the_plain_reference_follows_context_and_the_hosts_speed():
    """A drafting step is compared with what a plain step costs at its own context (the curve's shape) on the host
    as it is now (recent plain steps); a band without plain steps borrows the other bands' ratio; before any plain
    step nothing is counted."""
    returns = DraftReturns(CURVE, decay=1.0, prior=1e-9)
    for _ in range(50):
        returns.observe(4, 400.0, 0.020)  # the host slowed: every step now twice what it was
    returns.observe(4, 400.0, 0.030, 0.25, drafted=2, accepted=1)
    assert returns.bands[2].realized == pytest.approx(0.5, rel=0.01)
    longer = 2 * 0.020 * CURVE.at(16, 1.0, 3200.0) / CURVE.at(4, 1.0, 400.0)
    returns.observe(16, 3200.0, longer, 0.5, drafted=8, accepted=2)  # no plain step at 16 rows yet
    assert returns.bands[4].realized == pytest.approx(1.0, rel=0.01)
    nothing = DraftReturns(CURVE)
    nothing.observe(4, 400.0, 0.020, 0.25, drafted=2, accepted=1)
    assert nothing.bands[2].drafting_steps == 0 and nothing.scale(4) == 1.0
    with pytest.raises(ValueError, match="decay"):
        DraftReturns(CURVE, decay=0.0)
