"""Adaptive k: drafts more when drafts are accepted, stops when they are not, tries again later, and trusts a
proposal by its confidence class."""

import numpy as np
import pytest
import torch

from hf_specdec.costs.step_cost import DEFAULT_STEP_COST, HOST_FORMS_CPU_STEP_COST, MeasuredStepCost, StepCost
from hf_specdec.costs.adaptive import AdaptiveK

# A forward costs 1 + 0.18 per token: 5 drafts at batch 1 cost 1.6 plain steps.
LINEAR = StepCost(per_row=0.0, points=((1, 1.18), (2, 1.36)))
# A CPU curve timed with a host's own faster linear forms in place: what a measured CPU's verifies cost.
MEASURED_CPU = HOST_FORMS_CPU_STEP_COST


def test_high_acceptance_drafts_the_most():
    policy = AdaptiveK(num_rows=2, max_k=8, step_cost=LINEAR)
    for _ in range(10):
        policy.update([0, 1], [8, 8], [8, 8])
    assert policy.choose([0, 1]) == 8


def test_low_acceptance_switches_speculation_off():
    policy = AdaptiveK(num_rows=1, max_k=8, step_cost=LINEAR)
    for _ in range(10):
        policy.update([0], [4], [0])
    assert policy.choose([0]) == 0


def test_idle_rows_drift_back_and_are_tried_again():
    policy = AdaptiveK(num_rows=1, max_k=8, step_cost=LINEAR)
    for _ in range(10):
        policy.update([0], [4], [0])
    steps = 0
    while policy.choose([0]) == 0:
        policy.update([0], [0], [0])
        steps += 1
        assert steps < 100
    assert steps > 2  # not immediately


@pytest.mark.parametrize("rate,expected", [(0.5, 2), (0.8, 5), (0.3, 1)])
def test_k_maximises_expected_tokens_per_cost(rate, expected):
    policy = AdaptiveK(num_rows=1, max_k=10, step_cost=LINEAR, priors=(rate,))
    assert policy.choose([0]) == expected


def test_expensive_drafting_lowers_k():
    cheap = AdaptiveK(num_rows=1, max_k=10, step_cost=LINEAR, priors=(0.8,))
    dear = AdaptiveK(num_rows=1, max_k=10, step_cost=LINEAR, draft_cost_per_token=0.3, priors=(0.8,))
    assert dear.choose([0]) < cheap.choose([0])
    as_big_as_target = AdaptiveK(num_rows=1, max_k=10, step_cost=LINEAR, draft_cost_per_token=1.0, priors=(0.95,))
    assert as_big_as_target.choose([0]) == 0  # a draft as costly as the target never pays


def test_larger_batches_draft_less():
    policy = AdaptiveK(num_rows=16, max_k=10, step_cost=LINEAR, priors=(0.7,))
    assert policy.choose(list(range(16))) < policy.choose([0])


def test_step_cost_relative_to_a_plain_step():
    assert float(LINEAR.relative(1, torch.tensor(6.0))) == pytest.approx(2.08 / 1.18)
    cpu = MEASURED_CPU
    # Measured on the development CPU: at batch 16 one draft per row costs 14-18% more than a plain step (more over
    # short contexts, where the forward itself is cheaper), at batch 1 five drafts cost about 1.6 plain steps.
    long, short = (float(cpu.relative(16, torch.tensor(2.0), 16 * c)) for c in (256, 64))
    assert 1.0 < long < short < 1.25
    assert 1.2 < float(cpu.relative(1, torch.tensor(6.0), 256)) < 1.8


def test_a_cpu_that_measured_nothing_prices_a_verify_dear_and_drafts_only_likely_matches():
    """The static CPU curve is timed with the stock linear forms, as a call without a profile runs: there a second
    token costs half a plain step at batch 1, and such a call prices its extra at twice that. At batch 1 an n-gram's
    short match (acceptance prior 0.25-0.40) is not verified and a long one (0.9) is, several drafts deep; at batch 4,
    where the rows' plain step already pays the stock form's dear small-row products, the long match drafts deeper."""
    unmeasured = DEFAULT_STEP_COST["cpu"].pessimistic()
    assert float(DEFAULT_STEP_COST["cpu"].relative(1, torch.tensor(2.0), 64)) > 1.4
    assert float(unmeasured.relative(1, torch.tensor(2.0), 64)) > 1.8

    def drafts(rows: int, prior: float) -> list[int]:
        policy = AdaptiveK(num_rows=rows, max_k=8, step_cost=unmeasured, priors=(prior,), packed=True)
        return policy.choose_rows(list(range(rows)), [8] * rows, context=100.0 * rows)

    assert drafts(1, 0.25) == drafts(1, 0.4) == [0] and drafts(1, 0.9)[0] >= 3
    assert min(drafts(4, 0.9)) > max(drafts(4, 0.25))


def test_fit_recovers_a_known_cost_and_refuses_bad_curves():
    per_row, curve = 2.0, {1: 10.0, 2: 11.0, 4: 15.0, 8: 15.0, 16: 30.0, 32: 40.0}
    per_context = 0.01
    samples = [(b, b * q, b * c, per_row * b + per_context * b * c + curve[b * q])
               for b in (1, 2, 4) for q in (1, 2, 4, 8) for c in (64, 256) if b * q in curve]
    fitted = StepCost.fit(samples)
    assert fitted.per_row == pytest.approx(per_row, abs=1e-3)
    assert fitted.per_context_token == pytest.approx(per_context, abs=1e-5)
    assert dict(fitted.points) == pytest.approx(curve, abs=1e-2)
    assert float(fitted(2, torch.tensor(8.0))) == pytest.approx(4 + 30)
    assert float(fitted(1, torch.tensor(3.0))) == pytest.approx(2 + 13)  # between points
    assert float(fitted(1, torch.tensor(64.0))) == pytest.approx(2 + 40 + 30 / 31 * 32)  # past the last point
    with pytest.raises(ValueError, match="not decreasing"):
        StepCost(per_row=0.0, points=((1, 5.0), (2, 4.0)))


def test_measure_times_a_real_model():
    from conftest import make_model

    cost = StepCost.measure(make_model("llama", dtype=torch.float32), rows=(1, 2), tokens=(1, 2, 4),
                            contexts=(8, 16), repeats=1)
    assert [n for n, _ in cost.points] == [1, 2, 4, 8]
    assert cost.per_row >= 0 and all(t > 0 for _, t in cost.points)


def test_measure_times_the_tokens_given_per_row_count():
    """The first call's grid times other token counts at each row count: exactly the cells asked for."""
    from conftest import make_model

    from hf_specdec.costs.step_cost import measure_step_cost

    cost, measurement = measure_step_cost(make_model("llama", dtype=torch.float32), (1, 3), {1: (1, 2, 4), 3: (1, 2)},
                                          (8,), 1)
    assert sorted(measurement.medians) == [("step", 1, 1, 8), ("step", 1, 2, 8), ("step", 1, 4, 8),
                                           ("step", 3, 1, 8), ("step", 3, 2, 8)]
    assert [n for n, _ in cost.points] == [1, 2, 3, 4, 6]
    with pytest.raises(ValueError, match="row count"):
        measure_step_cost(make_model("llama", dtype=torch.float32), (1, 3), {1: (1, 2)}, (8,), 1)


def test_a_total_timed_at_fewer_rows_that_costs_more_is_pooled_not_carried_up():
    """Totals come from different row counts: one row of 3 tokens can cost more than 4 rows of 1. The curve is the
    nearest non-decreasing one (their mean for both), not a running maximum that would price the 4-row plain step at
    the 1-row verify's cost and every 4-row verify too cheap against it."""
    samples = [(1, 1, 0, 33.0), (1, 2, 0, 33.0), (1, 3, 0, 43.0), (4, 4, 0, 41.0), (4, 8, 0, 49.0)]
    fitted = StepCost.fit(samples)
    assert [t for _, t in fitted.points] == pytest.approx([33.0, 33.0, 42.0, 42.0, 49.0], abs=1e-2)
    from hf_specdec.costs.step_cost import _non_decreasing

    assert _non_decreasing([1.0, 3.0, 2.0, 2.0, 5.0]) == pytest.approx([1.0, 7 / 3, 7 / 3, 7 / 3, 5.0])
    assert _non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


def test_one_context_length_puts_its_cost_on_the_rows_not_on_every_cached_token():
    """Timed over one context length per row, cached tokens grow with rows alone: the fit gives what they cost to the
    rows, so a call with long contexts is not priced as if every cached token cost what a row does."""
    samples = [(b, b * q, b * 32, 30.0 + 1.0 * b + 5.0 * b * q) for b in (1, 16) for q in (1, 2)]
    fitted = StepCost.fit(samples)
    assert fitted.per_context_token == 0.0
    for b, n, c, t in samples:
        assert fitted.at(b, n / b, c) == pytest.approx(t, rel=1e-3)
    assert fitted.at(1, 1.0, 2000) == fitted.at(1, 1.0, 32)


def test_verifies_are_timed_ragged_where_steps_go_packed():
    """Several rows of more than one token a row are timed as verifies come where the model packs ragged steps: the
    extra tokens on the first half of the rows, as many in all; the context is reserved, not computed."""
    from conftest import make_model

    from hf_specdec.costs.step_cost import measure_step_cost, verify_counts
    from hf_specdec.runners.model_runner import ModelRunner
    from hf_specdec.runners.support import check_model_supported

    assert verify_counts(4, 2, True) == [3, 3, 1, 1] and verify_counts(3, 2, True) == [3, 2, 1]
    assert verify_counts(16, 3, True) == [5] * 8 + [1] * 8
    assert verify_counts(4, 2, False) == [2] * 4 and verify_counts(1, 3, True) == [3]
    fed = []
    forward = ModelRunner.forward

    def spy(self, seq_ids, input_ids, num_tokens, *args, **kwargs):
        fed.append((self.packed, tuple(num_tokens), tuple(self.length(s) for s in seq_ids)))
        return forward(self, seq_ids, input_ids, num_tokens, *args, **kwargs)

    model = make_model("llama", dtype=torch.float32)
    check_model_supported(model)  # its trial (forwards of its own) finds that the tiny llama packs ragged steps
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ModelRunner, "forward", spy)
        measure_step_cost(model, (1, 4), {1: (1, 3), 4: (1, 2)}, (8,), 1)
    assert {(packed, counts) for packed, counts, _ in fed} == {
        (True, (1,)), (True, (3,)), (True, (1, 1, 1, 1)), (True, (3, 3, 1, 1))}
    # Every timed forward attends to the 8 tokens reserved before it (rolled back after each), none fed a prefill.
    assert all(lengths == (8,) * len(counts) for _, counts, lengths in fed)


def test_offered_drafts_cap_the_expected_gain():
    """A row with 1 draft to offer gains nothing from k = 8; rows with none make k = 0."""
    policy = AdaptiveK(num_rows=1, max_k=8, step_cost=LINEAR, priors=(0.9,))
    assert policy.choose([0], available=[8]) == 8
    assert policy.choose([0], available=[1]) == 1
    assert policy.choose([0], available=[0]) == 0


@pytest.mark.parametrize("packed", [True, False])
def test_may_draft_asks_whether_the_likeliest_proposals_could_pay(packed):
    """Before a lookup: drafting could pay while some class of a row is trusted, and not once every class of every
    row has been rejected; a no is recorded as a declined step, as `choose_rows` records one."""
    policy = AdaptiveK(num_rows=2, max_k=8, step_cost=LINEAR, priors=(0.5, 0.5), packed=packed)
    assert policy.may_draft([0, 1], [8, 8]) and policy.chosen == []
    assert not policy.may_draft([0, 1], [0, 0])  # nothing could be offered
    for _ in range(10):
        policy.update([0, 1], [4, 4], [0, 0], classes=[0, 0])
        policy.update([0, 1], [8, 8], [8, 8], classes=[1, 1])
    assert policy.choose_rows([0, 1], [8, 8], [0, 0], record=False) == [0, 0]
    assert policy.choose([0, 1], [8, 8], [0, 0]) == 0
    assert policy.may_draft([0, 1], [8, 8])  # class 1 is accepted: a row whose proposal is of it would draft
    for _ in range(40):
        policy.update([0, 1], [4, 4], [0, 0], classes=[1, 1])
    declined = policy.num_declined
    assert not policy.may_draft([0, 1], [8, 8])
    assert policy.chosen[-1] == 0 and policy.num_declined == declined + 1
    for _ in range(200):  # evidence fades: drafting is tried again
        policy.update([0, 1], [0, 0], [0, 0])
    assert policy.may_draft([0, 1], [8, 8])


def test_confidence_classes_keep_separate_estimates():
    """Evidence about one class (short matches, always rejected) does not lower another (long matches)."""
    policy = AdaptiveK(num_rows=1, max_k=8, step_cost=LINEAR, priors=(0.5, 0.5))
    for _ in range(10):
        policy.update([0], [4], [0], classes=[0])
        policy.update([0], [8], [8], classes=[1])
    assert policy.choose([0], classes=[0]) == 0
    assert policy.choose([0], classes=[1]) == 8
    low, high = policy.acceptance([0, 0], [0, 1]).tolist()
    assert low < 0.1 < 0.9 < high


def test_a_class_without_evidence_borrows_how_the_priors_fared():
    """Free text: short matches are rejected far more often than their prior says, so a long match seen for the
    first time is trusted less than its prior (and no draft is made at a cost where the prior alone would draft);
    copying: the opposite, capped below certainty."""
    priors = (0.4, 0.57, 0.67, 0.73)
    cost = StepCost(per_row=0.0, points=((1, 1.0), (2, 1.3), (5, 1.6)))
    fresh = AdaptiveK(num_rows=2, max_k=4, step_cost=cost, priors=priors)
    free, copying = (AdaptiveK(num_rows=2, max_k=4, step_cost=cost, priors=priors) for _ in range(2))
    for _ in range(6):
        free.update([0], [2], [0], classes=[1])
        copying.update([0], [4], [4], classes=[1])
    prior_only = fresh.acceptance([1], [3]).item()
    assert prior_only == pytest.approx(0.73)
    assert free.acceptance([1], [3]).item() < 0.5 * prior_only
    assert prior_only + 0.1 < copying.acceptance([1], [3]).item() <= 0.95
    assert fresh.choose([1], available=[4], classes=[3]) > 0
    assert free.choose([1], available=[4], classes=[3]) == 0


def test_rows_share_evidence_through_the_pooled_estimate():
    """A row with no evidence of its own starts from what other rows of the call showed for the class."""
    policy = AdaptiveK(num_rows=3, max_k=8, step_cost=LINEAR, priors=(0.5,))
    for _ in range(10):
        policy.update([0, 1], [8, 8], [8, 8])
    fresh = AdaptiveK(num_rows=3, max_k=8, step_cost=LINEAR, priors=(0.5,))
    assert policy.acceptance([2]).item() > fresh.acceptance([2]).item() + 0.2


def test_priors_are_checked():
    with pytest.raises(ValueError, match="priors"):
        AdaptiveK(num_rows=1, max_k=4, step_cost=LINEAR, priors=(1.0,))


def test_generate_takes_a_step_cost_and_refuses_a_wrong_one():
    from conftest import make_model

    model = make_model("llama")
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    # Drafts free at any width: every offered draft is verified, and the output is still the target's own.
    flat = StepCost(per_row=0.0, points=((1, 1.0), (1000, 1.0)))
    out = model.generate(ids, max_new_tokens=12, do_sample=False, speculator="ngram", speculative_step_cost=flat,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    with pytest.raises(TypeError, match="StepCost"):
        model.generate(ids, max_new_tokens=4, speculator="ngram", speculative_step_cost=0.18)
    with pytest.raises(ValueError, match="adaptive"):
        model.generate(ids, max_new_tokens=4, speculator="ngram", speculative_step_cost=flat,
                       speculative_schedule="constant")
    with pytest.raises(ValueError, match="only applies together with speculator"):
        model.generate(ids, max_new_tokens=4, speculative_step_cost=flat)


def test_generate_calibrates_acceptance_by_the_drafts_it_saw_accepted():
    """`generate`'s policy scales its estimates by accepted over expected drafts (as the serving engine's does): the
    policy a call binds has the sums, fed by the call's own drafts, and the output is the target's own."""
    from conftest import make_model

    from hf_specdec import NgramSpeculator

    bound = []

    class Recording(NgramSpeculator):
        def bind_policy(self, policy):
            bound.append(policy)
            super().bind_policy(policy)

    model = make_model("llama")
    ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)
    flat = StepCost(per_row=0.0, points=((1, 1.0), (1000, 1.0)))
    out = model.generate(ids, max_new_tokens=12, do_sample=False, speculator=Recording(), speculative_step_cost=flat)
    assert torch.equal(out, expected)
    policy = bound[-1]
    assert policy.calibrate and policy.expected_accepted > 0


def test_a_gain_below_the_margin_does_not_draft():
    """Free verification and 5% acceptance: drafting promises 1.05x, under the 10% margin; without it, it drafts."""
    flat = StepCost(per_row=0.0, points=((1, 1.0), (1000, 1.0)))
    assert AdaptiveK(num_rows=1, max_k=4, step_cost=flat, priors=(0.05,)).choose([0]) == 0
    assert AdaptiveK(num_rows=1, max_k=4, step_cost=flat, priors=(0.05,), min_gain=1.0).choose([0]) > 0


def _value(policy, rows, classes, ks, context=0.0, discount=1.0):
    """Expected tokens per unit of cost of verifying `ks[i]` drafts in row i of a packed step (each draft's gain
    divided by `discount`)."""
    rates = policy.acceptance(rows, classes).tolist()
    expected = len(rows) + sum(sum(p ** j for j in range(1, k + 1)) for p, k in zip(rates, ks)) / discount
    tokens = torch.tensor(1 + sum(ks) / len(rows), dtype=torch.float64)
    return expected / float(policy.step_cost.relative(len(rows), tokens, context))


@pytest.mark.parametrize("cost", [LINEAR, MEASURED_CPU, StepCost(per_row=0.0, points=((1, 1.0), (3, 1.0), (4, 2.0)))])
@pytest.mark.parametrize("seed", range(6))
def test_per_row_drafts_are_the_best_set_of_their_size(cost, seed):
    """A packed verify takes, per row, the drafts whose expected tokens per unit of cost, each draft's gain
    discounted by the margin, beat every other choice (checked against all per-row choices of three rows), or none
    where that choice does not beat plain decoding by the margin."""
    import itertools

    g = torch.Generator().manual_seed(seed)
    priors = tuple(float(p) for p in torch.rand(3, generator=g) * 0.9)
    policy = AdaptiveK(num_rows=3, max_k=3, step_cost=cost, priors=priors, packed=True)
    rows, classes = [0, 1, 2], [0, 1, 2]
    available = torch.randint(0, 4, (3,), generator=g).tolist()
    ks = policy.choose_rows(rows, available, classes, context=50.0)
    assert all(0 <= k <= a for k, a in zip(ks, available))
    margin = policy.min_gain
    choices = list(itertools.product(*(range(a + 1) for a in available)))
    best = max(choices, key=lambda c: _value(policy, rows, classes, c, 50.0, margin))
    plain = _value(policy, rows, classes, [0, 0, 0], 50.0)
    if any(best) and _value(policy, rows, classes, best, 50.0) >= margin * plain:
        assert _value(policy, rows, classes, ks, 50.0, margin) == pytest.approx(
            _value(policy, rows, classes, best, 50.0, margin))
    else:
        assert ks == [0, 0, 0]
    assert policy.chosen[-1] == max(ks)


def test_a_likely_row_verifies_beside_unlikely_ones():
    """At batch 16 on the CPU curve one k for all drafts nothing (the unlikely rows would pay for width); per row,
    the likely one verifies its proposal and the others feed one token."""
    policy = AdaptiveK(num_rows=16, max_k=8, step_cost=MEASURED_CPU, priors=(0.1, 0.9), packed=True)
    rows, available, classes = list(range(16)), [8] * 16, [1] + [0] * 15
    assert policy.choose(rows, available, classes) == 0
    ks = policy.choose_rows(rows, available, classes)
    assert ks[0] > 0 and ks[1:] == [0] * 15


def test_a_heads_drafts_are_made_only_where_they_would_pay_for_themselves():
    """The hybrid asks before its head runs: at batch 16 drafts of a 0.4 acceptance are not worth a forward per
    draft, drafts of 0.9 are, and a dear head is not run for a few rows' gain."""
    cpu = MEASURED_CPU
    rows = list(range(16))
    lookup, lookup_classes = [4] + [0] * 15, [1] + [0] * 15  # one row copies (class 1), the rest have nothing
    head = [4] + [2] * 15  # with the head: the copying row keeps its lookup, the others get 2 head drafts
    head_classes = [1] + [2] * 15
    for rate, cost, pays in ((0.4, 0.1, False), (0.9, 0.1, True), (0.9, 5.0, False)):
        policy = AdaptiveK(num_rows=16, max_k=4, step_cost=cpu, draft_cost_per_token=cost,
                           priors=(0.1, 0.9, rate), packed=True)
        assert policy.drafting_pays(rows, lookup, lookup_classes, head, head_classes, 2, 2000.0) is pays, rate
        assert policy.chosen == []  # asking records nothing


def test_drafts_already_made_are_trimmed_per_row_without_a_second_record():
    """A model speculator's k is chosen (and recorded) before it drafts; once the drafts are made, each row keeps
    the ones worth verifying by its own acceptance, and nothing more is recorded."""
    policy = AdaptiveK(num_rows=16, max_k=4, step_cost=MEASURED_CPU, priors=(0.5,), packed=True)
    for _ in range(10):
        policy.update(list(range(16)), [4] * 16, [4] + [0] * 15)  # row 0 accepts everything, the others nothing
    k = policy.choose(list(range(16)), context=2000.0)
    trimmed = policy.choose_rows(list(range(16)), [4] * 16, context=2000.0, record=False)
    assert policy.chosen == [k]
    assert trimmed[0] > 0 and trimmed[1:] == [0] * 15


def _timed_steps(cost: MeasuredStepCost, truth, steps: int, seed: int = 0, draft_share: float = 0.5) -> None:
    """Feeds `cost` steps of random shapes timed by `truth(rows, other tokens, drafts, context)` (ms; other tokens:
    those fed beyond one per row that are not drafts, a newcomer's prompt) with 2% noise: about `draft_share` of them
    verify drafts, a quarter carry a prompt."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = int(torch.randint(1, 33, (), generator=g))
        drafts = int(torch.randint(1, 4 * rows + 1, (), generator=g)) if torch.rand((), generator=g) < draft_share else 0
        other = int(torch.randint(8, 200, (), generator=g)) if torch.rand((), generator=g) < 0.25 else 0
        context = rows * float(torch.randint(50, 400, (), generator=g))
        noise = 1 + 0.02 * float(torch.randn((), generator=g))
        cost.observe(rows, rows + other + drafts, context, drafts, truth(rows, other, drafts, context) * noise / 1e3)


@pytest.mark.parametrize("scale,marginal,draft_price,overhead", [(3.0, 1.5, 6.0, 4.0), (0.5, 0.5, 4.0, 0.0)])
def test_measured_step_cost_recovers_how_the_host_prices_tokens(scale, marginal, draft_price, overhead):
    """Steps timed on a host whose plain steps cost `scale` times the base curve, whose newcomers' prompt tokens cost
    `marginal` times the curve's, whose draft tokens cost `draft_price` ms each and whose drafting steps carry
    `overhead` ms more: the fitted relative costs of drafting are the host's, not the base curve's."""
    base = MEASURED_CPU
    one = torch.ones((), dtype=torch.float64)

    def truth(rows, other, drafts, context):
        plain = float(base(rows, one, context))
        extra = float(base(rows, one * (1 + other / rows), context)) - plain
        return scale * plain + marginal * scale * extra + draft_price * drafts + overhead * (drafts > 0)

    measured = MeasuredStepCost(base)
    _timed_steps(measured, truth, 15)
    assert not measured.ready  # too few steps yet
    _timed_steps(measured, truth, 200, seed=1)
    assert measured.ready
    for rows, tokens, context in [(4, 2.0, 400.0), (16, 1.5, 3000.0), (30, 1.25, 9000.0)]:
        drafts = round(rows * (tokens - 1))
        want = truth(rows, 0, drafts, context) / truth(rows, 0, 0, context)
        got = float(measured.relative(rows, torch.tensor(tokens, dtype=torch.float64), context))
        assert got == pytest.approx(want, rel=0.03)
        static = float(base.relative(rows, torch.tensor(tokens, dtype=torch.float64), context))
        assert abs(static - want) > 3 * abs(got - want)  # the correction is what made it right
    assert float(measured.relative(8, torch.ones((), dtype=torch.float64), 800.0)) == pytest.approx(1.0)


def test_without_drafting_steps_drafts_are_priced_at_the_curves_average_token():
    """Only plain steps seen (some with newcomers' prompts): nothing says what a draft costs, so each is priced at
    the base curve's average price of a token, in the host's units; a flat stretch of the curve does not make drafts
    free."""
    base = StepCost(per_row=0.0, points=((1.0, 40.0), (16.0, 40.0), (32.0, 72.0)))  # 1 ms a token on average
    measured = MeasuredStepCost(base)
    one = torch.ones((), dtype=torch.float64)
    _timed_steps(measured, lambda r, o, d, c: 2.0 * float(base(r, one * (1 + o / r), c)), 40, draft_share=0.0)
    assert measured.ready
    tokens = torch.tensor([1.0, 1.25, 2.0], dtype=torch.float64)
    want = 1 + (tokens - 1) * 8 * 1.0 / 40.0 + 0.0  # 8 rows: their drafts at 1 ms each against a 40 ms step
    assert torch.allclose(measured.relative(8, tokens, 0.0), want, rtol=0.02)
    assert float(base.relative(8, tokens, 0.0)[1]) == pytest.approx(1.0)  # the curve alone: 2 drafts are free


def test_a_prefill_step_does_not_set_the_price_of_drafts():
    """A step dominated by a newcomer's prompt (other tokens outnumbering its rows), however slow, is not fitted;
    one where they do not is."""
    base = MEASURED_CPU
    one = torch.ones((), dtype=torch.float64)
    measured = MeasuredStepCost(base)
    _timed_steps(measured, lambda r, o, d, c: float(base(r, one * (1 + (o + d) / r), c)), 100, seed=3)
    before, seen = measured.params, measured.steps
    measured.observe(4, 4 + 3 + 180, 800.0, 3, 2.0)  # 180 prompt tokens beside 3 drafts, 2 s
    assert measured.params == before and measured.steps == seen and measured.skipped > 0
    measured.observe(8, 8 + 3 + 6, 800.0, 3, 2.0)
    assert measured.steps == seen + 1 and measured.params != before


def test_one_step_far_off_the_fit_does_not_set_the_price_of_drafts():
    """Steps at 16 rows with and without drafts (2% noise), then one step of 16 drafts taking three times what it
    should (the host paused): the price of a draft moves by under a fifth of what the same fit without the damping
    makes of it, and a step consistent with the fit keeps its full weight."""
    base = MEASURED_CPU
    one = torch.ones((), dtype=torch.float64)

    def truth(drafts):
        return float(base(16, one, 3200.0)) + 3.0 * drafts + 8.0 * (drafts > 0)

    shifts = {}
    for damped in (True, False):
        g = torch.Generator().manual_seed(4)
        measured = MeasuredStepCost(base)
        if not damped:
            measured.OUTLIER_FLOOR = float("inf")
        for i in range(60):
            drafts = [0, 0, 4, 8][i % 4]
            noise = 1 + 0.02 * float(torch.randn((), generator=g))
            measured.observe(16, 16 + drafts, 3200.0, drafts, truth(drafts) * noise / 1e3)
        before = measured.params[2]
        assert before == pytest.approx(3.0, abs=0.5)
        measured.observe(16, 32, 3200.0, 16, 3 * truth(16) / 1e3)
        shifts[damped] = measured.params[2] - before
        if damped:
            weight = measured.weight
            measured.observe(16, 24, 3200.0, 8, truth(8) / 1e3)
            assert measured.weight == pytest.approx(weight * measured.decay + 1.0)
    assert shifts[False] > 4.0 and 0 < shifts[True] < shifts[False] / 5


def test_a_policy_measuring_its_steps_stops_drafting_where_tokens_cost_more_than_the_curve_says():
    """At batch 16, half the rows accepting half their drafts: a curve pricing an extra token at 1.1% of a plain
    step says drafting pays; steps timed at three times that price say it does not, and the measuring policy
    declines. Without `measure_steps` the policy keeps the curve."""
    base = StepCost(per_row=0.0, points=((1.0, 10.0), (64.0, 10.0 + 63 * 0.2)))
    one = torch.ones((), dtype=torch.float64)

    def truth(rows, tokens, context, drafted):
        plain = float(base(rows, one, context))
        return plain + 3.0 * (float(base(rows, torch.tensor(float(tokens), dtype=torch.float64), context)) - plain)

    rows, context = list(range(16)), 16 * 200.0
    chosen = {}
    for measure in (False, True):
        policy = AdaptiveK(16, 4, base, priors=(0.45,), packed=True, measure_steps=measure)
        for _ in range(30):  # evidence: rows 0-7 accept half their drafts, rows 8-15 none
            policy.update(rows, [4] * 16, [1] * 8 + [0] * 8)
        g = torch.Generator().manual_seed(0)
        for _ in range(60):
            n = int(torch.randint(16, 48, (), generator=g))
            if policy.measured is not None:  # what the serving engine's steps report
                policy.measured.observe(16, n, context, n - 16, truth(16, n / 16, context, n > 16) / 1e3)
        chosen[measure] = policy.choose_rows(rows, [4] * 16, context=context)
    assert sum(chosen[False]) > 0
    assert sum(chosen[True]) == 0


def test_calibrated_policy_scales_its_estimates_by_the_drafts_it_saw_accepted():
    """Rows whose drafts are accepted half as often as their estimates say: with `calibrate`, the expected gains are
    scaled by accepted over expected (about 0.5 after many steps), and at a cost where the raw estimates say drafting
    pays but the calibrated ones say it does not, the policy declines; without `calibrate` it keeps drafting.
    Calibration is at most 1.5, and a draft's gain at most one token."""
    cost = StepCost(per_row=0.0, points=((1.0, 10.0), (64.0, 10.0 + 63 * 0.9)))  # a token: 9% of an 8-row step
    rows = list(range(8))
    chosen = {}
    for calibrate in (False, True):
        policy = AdaptiveK(8, 2, cost, priors=(0.6,), packed=True, calibrate=calibrate, decay=1.0, strength=1e6)
        for _ in range(200):
            # The estimates stay at the prior (0.6: a huge strength) while half as many drafts are accepted as
            # they expect (0.6 + 0.36 = 0.96 of 2 per row, 0.5 realised).
            policy.update(rows, [2] * 8, [1 if i % 2 else 0 for i in rows])
        if calibrate:
            assert policy.calibration == pytest.approx(4 / (8 * 0.96), rel=0.05)
        else:
            assert policy.calibration == 1.0
        chosen[calibrate] = policy.choose_rows(rows, [2] * 8)
    assert sum(chosen[False]) > 0 and sum(chosen[True]) == 0

    optimist = AdaptiveK(2, 3, cost, priors=(0.8,), calibrate=True)
    optimist.actual_accepted, optimist.expected_accepted = 100.0, 10.0
    assert optimist.calibration == 1.5
    gains = optimist._gains([0, 1], None, np.arange(0, 4, dtype=np.float64))
    # 0.8 * 1.5 > 1: the first draft's gain is capped at one token, deeper ones (0.64, 0.51 times 1.5) are not
    assert (gains[:, 0] == 1.0).all() and (gains[:, 1] == 1.0).all()
    assert gains[0, 2] == pytest.approx(0.96) and gains[0, 3] == pytest.approx(0.768)


def test_calibration_uses_the_estimates_the_drafts_were_chosen_by_and_fades_while_drafting_is_off():
    """The expected side of the calibration is what the estimates said before the step's outcome is folded in; with
    drafting off, calibration drifts back towards 1 as the acceptance counts drift back to the prior, so a policy that
    stopped drafting after a bad stretch drafts again later."""
    cost = StepCost(per_row=0.0, points=((1.0, 10.0), (64.0, 10.0 + 63 * 2.5)))  # a draft: a quarter of a step
    policy = AdaptiveK(1, 2, cost, priors=(0.5,), calibrate=True)
    policy.update([0], [2], [1])  # some evidence, so the estimate moves with the next outcome
    rate = float(policy.acceptance([0])[0])
    policy.update([0], [2], [0])
    assert policy.expected_accepted == pytest.approx(0.98 * (0.5 + 0.25) + rate + rate ** 2)
    assert float(policy.acceptance([0])[0]) < rate  # the update moved it: the expected side used the old one
    # Estimates that stay put (a strength no evidence moves) while nothing is accepted: calibration alone says no.
    policy = AdaptiveK(1, 1, cost, priors=(0.5,), calibrate=True, strength=1e9)
    for _ in range(30):  # a bad stretch: nothing accepted
        policy.update([0], [1], [0])
    assert policy.calibration < 0.5 and policy.choose_rows([0], [1]) == [0]
    steps = 0
    while policy.choose_rows([0], [1]) == [0] and steps < 300:
        policy.update([0], [0], [0])  # drafting off
        steps += 1
    assert steps < 300 and policy.calibration > 0.7


def test_weighed_rows_draft_where_the_remaining_work_waits():
    """Four rows, the same acceptance, a step cost under which no row's drafts pay for the batch's throughput: with
    the rows weighed by the tokens they have left, the row with the most left drafts (its accepted drafts shorten
    the run) and the rows about to finish do not; `weigh(rows, None)` restores the uniform choice."""
    cost = StepCost(per_row=0.0, points=((1.0, 10.0), (64.0, 10.0 + 63 * 3.0)))  # a token: 16% of a 4-row step
    rows = [0, 1, 2, 3]
    policy = AdaptiveK(4, 3, cost, priors=(0.6,), packed=True)
    for _ in range(20):
        policy.update(rows, [3] * 4, [2] * 4)  # acceptance about 0.67 in every row
    assert policy.choose_rows(rows, [3] * 4) == [0, 0, 0, 0]
    policy.weigh(rows, [150, 6, 4, 2])
    ks = policy.choose_rows(rows, [3] * 4)
    assert ks[0] > 0 and ks[1:] == [0, 0, 0]
    policy.weigh(rows, None)
    assert policy.choose_rows(rows, [3] * 4) == [0, 0, 0, 0]


def test_a_step_cost_built_from_lists_prices_as_one_from_tuples():
    """Points loaded from JSON arrive as lists; the float path (`StepCost.at`) bisects them as tuples."""
    listed, tupled = StepCost(0.5, [[1, 2.0], [4, 2.0], [9, 5.0]]), StepCost(0.5, ((1, 2.0), (4, 2.0), (9, 5.0)))
    tokens = torch.tensor([1.0, 2.5, 7.0], dtype=torch.float64)
    assert torch.equal(listed.relative(3, tokens, 10.0), tupled.relative(3, tokens, 10.0))
    assert listed == tupled and listed.at(3, 2.5, 10.0) == float(tupled(3, torch.tensor(2.5), 10.0))


def test_a_backlog_read_before_drafting_is_priced_only_where_the_policy_prices_reading(monkeypatch):
    """A model speculator that must first read a backlog (an EAGLE head's states of steps without drafts) pays for
    it with its drafts: the serving policy (`price_reading`) declines a resume at 4 rows that reads 1000 target
    tokens' worth, spread over `READ_HORIZON` steps, drafts with a small backlog, and a policy without
    `price_reading` ignores it. The price checked against whole steps (`priced_extra`) carries the whole backlog, as
    tokens fed with the drafts (a step's fixed extra for drafting counted once)."""
    cpu = MEASURED_CPU
    rows, context = list(range(4)), 1200.0

    def policy(price_reading):
        return AdaptiveK(num_rows=4, max_k=4, step_cost=cpu, priors=(0.8,), packed=True, price_reading=price_reading)

    assert policy(True).reads_backlog and not policy(False).reads_backlog  # one call's steps need not count it
    assert policy(True).choose(rows, context=context, unread=10.0) > 0
    assert policy(True).choose(rows, context=context, unread=1000.0) == 0
    assert policy(False).choose(rows, context=context, unread=1000.0) == policy(False).choose(rows, context=context) > 0
    monkeypatch.setattr(AdaptiveK, "READ_HORIZON", 10**6)  # spread over many steps, the same backlog is cheap
    assert policy(True).choose(rows, context=context, unread=1000.0) > 0
    p = policy(True)
    assert p.priced_extra(4, 2.0, 1, context, 1000.0) == pytest.approx(p.priced_extra(4, 2.0 + 1000.0 / 4, 1, context))
    assert p.priced_extra(4, 2.0, 1, context, 1000.0) > p.priced_extra(4, 2.0, 1, context) + 1.0


def test_a_model_speculator_drafts_only_for_the_rows_worth_it():
    """`choose_drafters` prices a model speculator's drafts (its forwards and, with `price_reading`, its backlog) for
    the rows that draft alone: at 16 rows, with nobody waiting and one row holding most of the work left, `choose`
    (every row's k drafts priced) declines, while `choose_drafters` gives that row its drafts and the others none.
    A backlog in the other rows does not enter the price; one in the drafting row does."""
    cost = StepCost(per_row=0.0, points=((1.0, 10.0), (64.0, 10.0 + 63 * 3.0)))  # a token: 3 of a 16-row step's 55
    rows = list(range(16))
    policy = AdaptiveK(16, 3, cost, draft_cost_per_token=0.02, priors=(0.7,), packed=True, price_reading=True,
                       draft_subsets=True)
    remaining = [150] + [20] * 15
    policy.weigh(rows, remaining)
    assert policy.choose(rows) == 0
    counts = policy.choose_drafters(rows)
    assert counts[0] > 0 and counts[1:] == [0] * 15 and policy.chosen[-1] == counts[0]
    assert policy.choose_drafters(rows, unread=[0.0] + [50.0] * 15) == counts
    assert policy.choose_drafters(rows, unread=[500.0] + [0.0] * 15) == [0] * 16
    assert policy.choose_drafters(rows, available=[0] + [3] * 15) == [0] * 16  # it cannot draft for the heavy row
    policy.weigh(rows, [150, 150] + [20] * 14)  # two rows the run waits for, one with a dear backlog
    counts = policy.choose_drafters(rows, unread=[500.0] + [0.0] * 15)
    assert counts[0] == 0 and counts[1] > 0 and counts[2:] == [0] * 14
    policy.weigh(rows, None)  # every row alike: no draft pays for the batch
    assert policy.choose_drafters(rows) == [0] * 16 and policy.num_declined == 4  # with `choose` above
