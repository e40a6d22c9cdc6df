"""Each Triton kernel against its PyTorch reference: run for real on a GPU, under TRITON_INTERPRET=1 on a CPU.

The references are the spec (the engine's CPU path uses them, and the end-to-end tests check them against
transformers); here the kernels must reproduce them exactly (tokens) or to the dtype's tolerance (attention).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from hf_specdec.kernels._backend import ENV_VAR, interpreting, resolve_backend
from hf_specdec.kernels.paged_attention import TreeMask, paged_attention, paged_attention_reference, reference
from hf_specdec.kernels.paged_attention.triton_kernel import paged_attention_triton
from hf_specdec.kernels.rejection_sample import (
    greedy_accept,
    rejection_sample,
    rejection_sample_reference,
    sample_with_uniforms,
)
from hf_specdec.kernels.rejection_sample.triton_kernel import rejection_sample_triton
from hf_specdec.kernels.sampling import apply_sampling_params, apply_sampling_params_reference
from hf_specdec.kernels.sampling.triton_kernel import apply_sampling_params_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# --- backend selection ----------------------------------------------------------------------------------------------
def test_auto_backend_is_torch_on_cpu_and_env_var_forces_triton(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("torch", "cpu") == "torch"
    monkeypatch.setenv(ENV_VAR, "triton")
    if interpreting():  # conftest sets TRITON_INTERPRET=1 where there is no GPU
        assert resolve_backend("auto", "cpu") == "triton"
    else:  # on a GPU machine the kernels compile, so CPU tensors cannot take them
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            resolve_backend("auto", "cpu")
        assert resolve_backend("auto", "cuda") == "triton"
    monkeypatch.setenv(ENV_VAR, "cuda-graphs")
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_backend("auto", "cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("fast", "cpu")


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu")


# --- rejection sampling: hand-written cases ---------------------------------------------------------------------------
def one_hot_scores(argmax: list[list[int]], vocab: int) -> torch.Tensor:
    """`[batch, k + 1, vocab]` scores whose argmax at each position is given."""
    return torch.nn.functional.one_hot(torch.tensor(argmax), vocab).float() * 5.0


# (target argmax per position, drafts (-1 = none), expected output, expected accepted)
GREEDY_CASES = {
    "full_match_then_bonus": ([[3, 1, 4, 2]], [[3, 1, 4]], [[3, 1, 4, 2]], [3]),
    "reject_at_first": ([[3, 1, 4, 2]], [[0, 1, 4]], [[3, -1, -1, -1]], [0]),
    "reject_in_middle": ([[3, 1, 4, 2]], [[3, 0, 4]], [[3, 1, -1, -1]], [1]),
    "empty_draft": ([[3, 1, 4, 2]], [[-1, -1, -1]], [[3, -1, -1, -1]], [0]),
    "k_one": ([[2, 0]], [[2]], [[2, 0]], [1]),
    "k_zero": ([[4]], [[]], [[4]], [0]),
    "ragged_batch": ([[3, 1, 4, 2], [0, 0, 0, 0], [1, 2, 3, 4]], [[3, 1, -1], [0, 1, 0], [1, 2, 3]],
                     [[3, 1, 4, -1], [0, 0, -1, -1], [1, 2, 3, 4]], [2, 1, 3]),
}


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", list(GREEDY_CASES))
def test_greedy_cases(case, backend, per_row):
    """`is_greedy=True` (the whole batch, known on the host) takes the PyTorch argmax on every backend; a per-row
    tensor, as in a batch that also samples, takes the backend's own path (the kernel's greedy scan with triton)."""
    argmax, drafts, expected, accepted = GREEDY_CASES[case]
    drafts = torch.tensor(drafts, dtype=torch.long).reshape(len(argmax), -1)
    num_drafts = (drafts >= 0).sum(-1)
    is_greedy = torch.ones(len(argmax), dtype=torch.bool, device=DEVICE) if per_row else True
    out, num_accepted = rejection_sample(drafts.to(DEVICE), num_drafts.to(DEVICE), one_hot_scores(argmax, 5).to(DEVICE),
                                         is_greedy=is_greedy, backend=backend)
    assert out.tolist() == expected
    assert num_accepted.tolist() == accepted


def test_an_all_greedy_batch_takes_the_argmax_path_on_the_triton_backend(monkeypatch):
    from hf_specdec.kernels.rejection_sample import triton_kernel

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel ran for an all-greedy batch")

    monkeypatch.setattr(triton_kernel, "rejection_sample_triton", refuse)
    argmax, drafts, expected, _ = GREEDY_CASES["ragged_batch"]
    drafts = torch.tensor(drafts, dtype=torch.long)
    out, _ = rejection_sample(drafts.to(DEVICE), (drafts >= 0).sum(-1).to(DEVICE),
                              one_hot_scores(argmax, 5).to(DEVICE), is_greedy=True, backend="triton")
    assert out.tolist() == expected
    with pytest.raises(AssertionError, match="the kernel ran"):  # a per-row flag still reaches the kernel
        rejection_sample(drafts.to(DEVICE), (drafts >= 0).sum(-1).to(DEVICE), one_hot_scores(argmax, 5).to(DEVICE),
                         is_greedy=torch.ones(3, dtype=torch.bool, device=DEVICE), backend="triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sampled_cases(backend):
    """Row 0: the target is certain of the draft, so it is kept whatever u is. Row 1: the draft had probability 0 under
    its own distribution, so it is rejected, and the residual leaves one token. Row 2: target_prob 0.25 < u 0.5 for a
    deterministic draft, rejected; the recovered token comes from the target without it (all mass on token 1)."""
    vocab = 4
    target = torch.zeros(3, 2, vocab)
    target[0, 0, 2] = 1.0
    target[0, 1, 3] = 1.0  # bonus position of row 0
    target[1, 0] = torch.tensor([0.0, 0.0, 0.5, 0.5])
    target[2, 0] = torch.tensor([0.0, 0.75, 0.0, 0.25])
    target[1:, 1] = 0.25
    draft_probs = torch.zeros(3, 1, vocab)
    draft_probs[0, 0, 2] = 1.0
    draft_probs[1, 0] = torch.tensor([0.0, 0.0, 0.0, 1.0])  # the draft token 2 had probability 0
    draft_probs[2, 0, 3] = 1.0
    drafts = torch.tensor([[2], [2], [3]])
    uniforms = torch.tensor([[0.999], [0.0], [0.5]], dtype=torch.float64)
    for probs in (draft_probs, None):
        out, num_accepted = rejection_sample(
            drafts.to(DEVICE), torch.ones(3, dtype=torch.long, device=DEVICE), target.to(DEVICE),
            None if probs is None else probs.to(DEVICE), is_greedy=False, uniforms=uniforms.to(DEVICE),
            backend=backend)
        assert num_accepted.tolist() == ([1, 0, 0] if probs is not None else [1, 1, 0])
        if probs is not None:  # row 1's residual max(target - draft, 0) is all on token 2
            assert out.tolist() == [[2, 3], [2, -1], [1, -1]]
        else:  # a deterministic draft 2 on row 1: target_prob 0.5 >= u 0.0, kept; bonus uniform over 4 tokens
            assert out[0].tolist() == [2, 3] and out[1, 0] == 2 and out[2].tolist() == [1, -1]


# --- rejection sampling: kernel against reference -----------------------------------------------------------------
@st.composite
def rejection_inputs(draw):
    batch = draw(st.integers(1, 4))
    k = draw(st.integers(0, 4))
    vocab = draw(st.sampled_from([1, 3, 7, 50, 97, 300]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    with_draft_probs = draw(st.booleans())
    draft_vocab = draw(st.sampled_from([vocab, max(1, vocab - 2)]))
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g) * 3, -1).to(dtype)
    # Drafts agree with the target's argmax with probability 0.7, so acceptance lengths vary.
    agree = torch.rand(batch, k, generator=g) < 0.7
    drafts = torch.where(agree, target[:, :k].float().argmax(-1), torch.randint(0, vocab, (batch, k), generator=g))
    num_drafts = torch.randint(0, k + 1, (batch,), generator=g)
    drafts = torch.where(torch.arange(k)[None, :] < num_drafts[:, None], drafts, -1)
    draft_probs = None
    if with_draft_probs:
        draft_probs = torch.softmax(torch.randn(batch, k, draft_vocab, generator=g), -1).to(dtype)
        drafts = torch.where((drafts >= draft_vocab), draft_vocab - 1, drafts)
    is_greedy = torch.rand(batch, generator=g) < 0.5
    uniforms = torch.rand(batch, k, generator=g, dtype=torch.float64)
    noise = torch.empty(batch, vocab).exponential_(generator=g)
    return drafts, num_drafts, target, draft_probs, is_greedy, uniforms, noise


@FEW
@given(rejection_inputs())
def test_rejection_kernel_matches_reference(inputs):
    """Exact token equality under fixed uniforms and Exp(1) noise: greedy, sampled and mixed rows, ragged counts."""
    inputs = [None if t is None else t.to(DEVICE) for t in inputs]
    drafts, num_drafts, target, draft_probs, is_greedy, uniforms, noise = inputs
    expected = rejection_sample_reference(drafts, num_drafts, target, draft_probs, is_greedy, uniforms, noise)
    got = rejection_sample_triton(drafts, num_drafts, target, draft_probs, is_greedy, uniforms, noise=noise)
    assert got[0].tolist() == expected[0].tolist()
    assert got[1].tolist() == expected[1].tolist()


@FEW
@given(rejection_inputs(), st.booleans())
def test_packed_target_probabilities_give_what_rows_laid_out_give(inputs, final_by_uniform):
    """A packed verify's probabilities, `[n, vocab]` at the positions rows fed with `target_index` saying which entry
    each `[batch, k + 1]` position is (past a row's drafts, its last again): the same tokens and counts as laid out
    per row, under the same random inputs (Exp(1) noise, or one uniform per row for the final draw)."""
    drafts, num_drafts, target, draft_probs, is_greedy, uniforms, noise = inputs
    batch, width, vocab = target.shape
    counts = num_drafts + 1  # entries a packed verify keeps per row
    first = counts.cumsum(0) - counts
    index = first[:, None] + torch.minimum(torch.arange(width)[None, :], num_drafts[:, None])
    packed = torch.cat([target[i, :int(c)] for i, c in enumerate(counts)])
    final = torch.rand(batch, generator=torch.Generator().manual_seed(batch), dtype=torch.float64)
    noise, final = (None, final) if final_by_uniform else (noise, None)
    expected = rejection_sample_reference(drafts, num_drafts, target, draft_probs, is_greedy, uniforms, noise, final)
    got = rejection_sample_reference(drafts, num_drafts, packed, draft_probs, is_greedy, uniforms, noise, final,
                                     target_index=index)
    assert got[0].tolist() == expected[0].tolist() and got[1].tolist() == expected[1].tolist()
    greedy = rejection_sample(drafts, num_drafts, packed, is_greedy=True, target_index=index)
    assert greedy[0].tolist() == rejection_sample(drafts, num_drafts, target, is_greedy=True)[0].tolist()


@FEW
@given(rejection_inputs(), st.sampled_from(["pad", "argmax", "random"]))
def test_greedy_rule_matches_the_reference(inputs, past_count):
    """`greedy_accept`, the rule an all-greedy batch takes, against the reference's greedy rows: with drafts past a
    row's count left as -1, set to the target's argmax (which only the count keeps out) or to any ids (past the
    vocabulary too), and drafts past the vocabulary within it."""
    drafts, num_drafts, target, *_ = inputs
    batch, k = drafts.shape
    vocab = target.shape[-1]
    g = torch.Generator().manual_seed(batch * 31 + k)
    fill = {"pad": drafts, "argmax": target[:, :k].float().argmax(-1),
            "random": torch.randint(0, vocab + 3, (batch, k), generator=g)}[past_count]
    drafts = torch.where(drafts < 0, fill, drafts)
    drafts = torch.where(torch.rand(batch, k, generator=g) < 0.1, vocab + 1, drafts)  # never the target's
    drafts, num_drafts, target = drafts.to(DEVICE), num_drafts.to(DEVICE), target.to(DEVICE)
    expected = rejection_sample_reference(drafts, num_drafts, target, None, True, None, None)
    got = greedy_accept(drafts, num_drafts, target)
    assert got[0].tolist() == expected[0].tolist()
    assert got[1].tolist() == expected[1].tolist()


def tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples.cpu(), minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


@pytest.mark.slow  # many interpreted draws
def test_kernel_philox_draws_follow_the_recovered_and_bonus_distributions():
    """The kernel's own Exp(1) noise (Philox, per-row seeds): recovered tokens follow the residual, bonus tokens the
    target. 600 rows per case; the expected TV noise for 5 outcomes is about 0.03, the bound 0.08, and the wrong
    distribution (the target itself instead of the residual) is 0.3 away."""
    n = 600
    target_row = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    draft_row = torch.tensor([0.0, 0.1, 0.6, 0.1, 0.2])
    target = target_row.expand(3 * n, 2, 5).clone()
    drafts = torch.full((3 * n, 1), 2)
    num_drafts = torch.tensor([1] * (2 * n) + [0] * n)
    draft_probs = draft_row.expand(3 * n, 1, 5).clone()
    draft_probs[:n] = torch.nn.functional.one_hot(torch.tensor(2), 5).float()  # point mass: a deterministic draft
    uniforms = torch.full((3 * n, 1), 0.9999, dtype=torch.float64)  # target_prob 0.3 < u * draft_prob: rejected
    seeds = torch.arange(3 * n) + 12345
    out, num_accepted = rejection_sample_triton(drafts.to(DEVICE), num_drafts.to(DEVICE), target.to(DEVICE),
                                                draft_probs.to(DEVICE), torch.zeros(3 * n, dtype=torch.bool,
                                                                                    device=DEVICE),
                                                uniforms.to(DEVICE), seeds=seeds.to(DEVICE))
    assert num_accepted.sum() == 0
    without_draft = torch.tensor([0.1, 0.2, 0.0, 0.25, 0.15]) / 0.7
    residual = (target_row - draft_row).clamp(min=0)
    residual /= residual.sum()
    assert tv(out[:n, 0], without_draft) < 0.08
    assert tv(out[n:2 * n, 0], residual) < 0.08
    assert tv(out[2 * n:, 0], target_row) < 0.08
    assert 0.5 * (without_draft - target_row).abs().sum() > 0.25  # the test can tell the distributions apart


def test_inverse_cdf_draws_take_each_index_by_its_weight_and_never_a_zero_weight():
    """`sample_with_uniforms`, the CPU's draw for recovered and bonus tokens: uniforms evenly spread over [0, 1)
    pick each index as often as its share of the weight (to one draw), never an index of weight 0 (not even at the
    ends of [0, 1)), and a row of zeros gives 0."""
    weights = torch.tensor([[0.0, 3.0, 0.0, 1.0, 4.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    n = 8000
    uniforms = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for row in weights:
        picks = sample_with_uniforms(row.expand(n, -1), uniforms)
        counts = torch.bincount(picks, minlength=len(row)).double()
        assert (counts - n * row.double() / row.sum()).abs().max() <= 1
    ends = torch.tensor([0.0, 1.0 - 2.0 ** -53], dtype=torch.float64)
    assert sample_with_uniforms(weights[:1].expand(2, -1), ends).tolist() == [1, 4]
    assert sample_with_uniforms(torch.zeros(2, 6), ends).tolist() == [0, 0]


def test_the_torch_backend_draws_recovered_and_bonus_tokens_by_their_distributions():
    """The CPU's rejection sampling (one uniform per row for the recovered or bonus token, not a vocabulary of
    Exp(1) noise): recovered tokens follow the target without the rejected draft, bonus tokens the target."""
    n = 4000
    target_row = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15])
    target = target_row.expand(2 * n, 2, 5).clone()
    drafts = torch.full((2 * n, 1), 2)
    num_drafts = torch.tensor([1] * n + [0] * n)
    uniforms = torch.full((2 * n, 1), 0.9999, dtype=torch.float64)  # target_prob 0.3 < u * 1: rejected
    out, num_accepted = rejection_sample(drafts, num_drafts, target, is_greedy=False, uniforms=uniforms,
                                         generator=torch.Generator().manual_seed(0), backend="torch")
    assert num_accepted.sum() == 0
    without_draft = torch.tensor([0.1, 0.2, 0.0, 0.25, 0.15]) / 0.7
    assert tv(out[:n, 0], without_draft) < 0.04  # expected noise for 5 outcomes and 4000 draws: about 0.015
    assert tv(out[n:, 0], target_row) < 0.04
    assert 0.5 * (without_draft - target_row).abs().sum() > 0.25  # the test can tell the distributions apart


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_per_row_seeds_are_reproducible_whatever_the_batch(backend):
    vocab = 11
    target = torch.softmax(torch.randn(1, 1, vocab), -1)

    def draw(seeds):
        batch = len(seeds)
        out, _ = rejection_sample(torch.empty(batch, 0, dtype=torch.long, device=DEVICE),
                                  torch.zeros(batch, dtype=torch.long, device=DEVICE),
                                  target.expand(batch, 1, vocab).contiguous().to(DEVICE), is_greedy=False,
                                  seeds=torch.tensor(seeds, device=DEVICE), backend=backend)
        return out[:, 0].tolist()

    first = draw([7, 8, 9, 10, 11, 12])
    again = draw([12, 7, 3, 7])
    assert again[1] == again[3] == first[0]
    assert again[0] == first[5]
    assert len(set(draw(list(range(100, 140))))) > 3  # different seeds really give different draws


# --- temperature, top-k, top-p ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, None, None), (None, 5, None), (None, None, 0.8),
                                                     (1.3, 20, 0.9), (0.5, 1, None), (None, None, 0.01)])
def test_sampling_reference_equals_transformers_warpers(temperature, top_k, top_p):
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 203) * 3
    warpers = LogitsProcessorList(
        ([TemperatureLogitsWarper(temperature)] if temperature else []) + ([TopKLogitsWarper(top_k)] if top_k else [])
        + ([TopPLogitsWarper(top_p)] if top_p else []))
    n = len(logits)
    got = apply_sampling_params_reference(
        logits, None if temperature is None else torch.full((n,), temperature),
        None if top_k is None else torch.full((n,), top_k), None if top_p is None else torch.full((n,), top_p))
    assert torch.equal(got, warpers(None, logits))


def test_sampling_reference_top_k_per_row_with_ties_and_masked_tokens():
    """Per-row k (off, 1, ties at the k-th score, k past the vocabulary) over scores with -inf entries: each row keeps
    exactly the tokens transformers' `TopKLogitsWarper` keeps for its own k."""
    from transformers.generation.logits_process import TopKLogitsWarper

    g = torch.Generator().manual_seed(5)
    logits = torch.randint(-4, 5, (6, 301), generator=g).float()  # many ties
    logits[2, :290] = float("-inf")
    top_k = torch.tensor([0, 1, 7, 50, 301, 400])
    got = apply_sampling_params_reference(logits, None, top_k, None)
    for row, k in enumerate(top_k.tolist()):
        expected = logits[row:row + 1] if k <= 0 or k >= 301 else TopKLogitsWarper(k)(None, logits[row:row + 1])
        assert torch.equal(got[row:row + 1], expected), row


def test_sampling_reference_top_p_from_candidates_equals_transformers_warper(monkeypatch):
    """The CPU's top-p, which looks for the cut among each row's highest scores before sorting: peaked rows (the cut
    among the candidates), flat rows (sorted instead), top_p = 1, a tiny top_p, 0, tokens top-k removed, per-row top_p:
    each row keeps exactly what `TopPLogitsWarper` keeps for its own top_p, and only the flat rows were sorted."""
    from transformers.generation.logits_process import TopPLogitsWarper

    import hf_specdec.kernels.sampling.reference as reference

    g = torch.Generator().manual_seed(11)
    vocab = 5000
    peaked = torch.randn(8, vocab, generator=g) * 5  # most of the mass in a few dozen tokens
    flat = torch.randn(3, vocab, generator=g) * 0.2  # the mass spread over thousands
    logits = torch.cat([peaked, flat])
    logits[1, 2500:] = float("-inf")  # as top-k leaves them
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.01, 0.95, 0.7, 0.99, 0.0, 0.9, 1.0, 0.5])
    sorted_rows = []
    sort = reference._top_p_remove
    monkeypatch.setattr(reference, "_top_p_remove", lambda x, p: sorted_rows.append(len(x)) or sort(x, p))
    got = reference.apply_sampling_params_reference(logits, top_p=top_p)
    assert sorted_rows == [2]  # the two flat rows with top_p < 1
    for row, p in enumerate(top_p.tolist()):
        expected = logits[row:row + 1] if p >= 1 else TopPLogitsWarper(p)(None, logits[row:row + 1])
        assert torch.equal(got[row:row + 1], expected), row
    assert 1 <= int((~torch.isinf(got[3])).sum()) < int((~torch.isinf(got[0])).sum())  # the cut did move
    assert int((~torch.isinf(got[7])).sum()) == 1  # top_p = 0 keeps the highest-scored token only


@st.composite
def sampling_inputs(draw):
    n = draw(st.integers(1, 5))
    vocab = draw(st.sampled_from([1, 2, 37, 203, 1000]))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    logits = (torch.randn(n, vocab, generator=g) * draw(st.sampled_from([0.5, 3.0, 20.0]))).to(dtype)
    temperature = torch.rand(n, generator=g) * 1.5 + 0.1 if draw(st.booleans()) else None
    top_k = torch.randint(0, vocab + 3, (n,), generator=g) if draw(st.booleans()) else None
    top_p = None
    if dtype == torch.float32 and draw(st.booleans()):  # low-precision logits tie often; see the tie note below
        top_p = torch.where(torch.rand(n, generator=g) < 0.2, 1.0, torch.rand(n, generator=g) * 0.95 + 0.04)
    return logits, temperature, top_k, top_p


@FEW
@given(sampling_inputs())
def test_sampling_kernel_matches_reference(inputs):
    """Same kept set and same scores. Ties: top-k keeps every token tied with the k-th (as transformers); top-p keeps
    a tie at its boundary together, where transformers keeps whichever its sort put last, so top-p is compared on
    float32 logits, where ties do not occur."""
    logits, temperature, top_k, top_p = (None if t is None else t.to(DEVICE) for t in inputs)
    expected = apply_sampling_params_reference(logits, temperature, top_k, top_p)
    got = apply_sampling_params_triton(logits, temperature, top_k, top_p, block_v=128)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got[~torch.isinf(got)], expected[~torch.isinf(expected)])


def test_top_p_one_keeps_tokens_whose_probability_underflows():
    """top_p = 1 is off: a token far below the top (its softmax underflows to exactly 0) is kept by both backends,
    as it is when no top-p is asked for."""
    logits = torch.tensor([[100.0, 99.0, -10.0, 0.0], [100.0, 99.0, -10.0, 0.0]], device=DEVICE)
    top_p = torch.tensor([1.0, 0.5], device=DEVICE)
    for got in (apply_sampling_params_reference(logits, top_p=top_p),
                apply_sampling_params_triton(logits, top_p=top_p)):
        assert torch.equal(got[0], logits[0])
        assert torch.isinf(got[1]).tolist() == [False, True, True, True]


def test_sampling_entry_point_dispatches(monkeypatch):
    logits = torch.randn(3, 50, device=DEVICE)
    top_k = torch.full((3,), 4, device=DEVICE)
    expected = apply_sampling_params(logits, top_k=top_k, backend="torch")
    assert torch.equal(apply_sampling_params(logits, top_k=top_k, backend="triton"), expected)
    assert (~torch.isinf(expected)).sum(-1).tolist() == [4, 4, 4]


# --- paged verify attention -------------------------------------------------------------------------------------------
@st.composite
def attention_inputs(draw):
    rows = draw(st.integers(1, 3))
    kv_heads = draw(st.integers(1, 2))
    groups = draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([8, 24, 40]))
    block_size = draw(st.sampled_from([4, 16]))
    dtype = draw(st.sampled_from(DTYPES))
    window = draw(st.sampled_from([None, 1, 5]))
    softcap = draw(st.sampled_from([None, 5.0]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    num_queries = [int(x) for x in torch.randint(1, 7, (rows,), generator=g)]
    lengths = [n + int(torch.randint(0, 30, (1,), generator=g)) for n in num_queries]
    q = max(num_queries)
    max_blocks = max(-(-n // block_size) for n in lengths)
    num_blocks = 1 + rows * max_blocks
    # Scattered blocks: every row's table is a random subset of the pool (block 0 is the scratch block).
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = order[: rows * max_blocks].view(rows, max_blocks)
    # Right-aligned rows, as the engine lays them out: padding columns repeat the row's first real position.
    positions = torch.stack([(torch.arange(q) - (q - n)).clamp(min=0) + length - n
                             for n, length in zip(num_queries, lengths)])
    query = torch.randn(rows, kv_heads * groups, q, head_dim, generator=g).to(dtype)
    key_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    value_pool = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=g).to(dtype)
    return query, key_pool, value_pool, tables, positions, block_size, window, softcap


@FEW
@given(attention_inputs())
def test_paged_attention_kernel_matches_reference(inputs):
    """Grouped-query heads, head sizes that are not powers of two, scattered blocks, sliding windows, soft-capping,
    ragged query counts, fp32/bf16/fp16."""
    query, key_pool, value_pool, tables, positions, block_size, window, softcap = inputs
    query, key_pool, value_pool, tables, positions = (t.to(DEVICE) for t in (query, key_pool, value_pool, tables,
                                                                             positions))
    expected = paged_attention_reference(query.float(), key_pool.float(), value_pool.float(), tables, positions,
                                         block_size, window, None, softcap)
    got = paged_attention_triton(query, key_pool, value_pool, tables, positions, block_size, window, None, softcap,
                                 block_m=16, block_n=16)
    tolerance = 1e-5 if query.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)



def _pack(query, positions, num_queries):
    """The padded right-aligned step as one stream: `[1, heads, T, dim]`, `[1, T]` and `cu_query` `[rows + 1]`."""
    q = query.shape[2]
    keep = torch.arange(q, device=query.device)[None, :] >= q - torch.tensor(num_queries, device=query.device)[:, None]
    cu_query = torch.tensor([0] + num_queries, device=query.device).cumsum(0)
    return query.transpose(1, 2)[keep].transpose(0, 1)[None], positions[keep][None], cu_query, keep


@FEW
@given(attention_inputs(), st.integers(0, 2**16))
def test_packed_queries_attend_as_their_padded_rows(inputs, seed):
    """The packed (varlen) layout: each row's real queries in one stream, no padding. The reference and the kernel
    give each query what the padded layout gives it, with windows, soft-capping, sinks and fp32/bf16/fp16."""
    query, key_pool, value_pool, tables, positions, block_size, window, softcap = inputs
    q = query.shape[2]
    # The padded layout's real queries: padding columns repeat the row's first position.
    num_queries = [int(n) for n in q - (positions == positions[:, :1]).sum(1) + 1]
    sinks = None
    if seed % 2:
        sinks = (torch.randn(query.shape[1], generator=torch.Generator().manual_seed(seed)) * 4).to(query.dtype)
        sinks = sinks.to(DEVICE)
    query, key_pool, value_pool, tables, positions = (t.to(DEVICE) for t in (query, key_pool, value_pool, tables,
                                                                             positions))
    packed, packed_positions, cu_query, keep = _pack(query, positions, num_queries)
    padded = paged_attention_reference(query, key_pool, value_pool, tables, positions, block_size, window, None,
                                       softcap, None, sinks)
    expected = padded[keep][None]  # [1, T, heads, dim]
    got = paged_attention_reference(packed, key_pool, value_pool, tables, packed_positions, block_size, window,
                                    None, softcap, None, sinks, cu_query)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    kernel = paged_attention_triton(packed.contiguous(), key_pool, value_pool, tables, packed_positions, block_size,
                                    window, None, softcap, block_m=16, block_n=16, sinks=sinks, cu_query=cu_query,
                                    max_query_len=max(num_queries))
    tolerance = 1e-5 if query.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel.float(), expected.float(), atol=tolerance, rtol=tolerance)
    assert kernel.shape == (1, sum(num_queries), *query.shape[1:2], query.shape[-1])


@st.composite
def tree_attention_inputs(draw):
    """A draft-tree step as the engine lays it out: per row, `pending` committed tokens fed this step, then `nodes`
    tree nodes stored after the committed context, positioned by depth, each seeing its own ancestors."""
    query, key_pool, value_pool, tables, _, block_size, window, softcap = draw(attention_inputs())
    rows, heads, _, head_dim = query.shape
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    pending, nodes = draw(st.integers(1, 2)), draw(st.integers(1, 7))
    capacity = tables.shape[1] * block_size
    committed = torch.randint(pending, max(capacity - nodes, pending) + 1, (rows,), generator=g).clamp(
        max=capacity - nodes)
    parents = torch.stack([torch.tensor([int(torch.randint(-1, i, (1,), generator=g)) for i in range(nodes)])
                           for _ in range(rows)])
    depths = torch.ones(rows, nodes, dtype=torch.long)
    ancestors = torch.eye(nodes, dtype=torch.bool).repeat(rows, 1, 1)
    for i in range(nodes):  # parents come first: copy the parent's row, then mark itself
        has = parents[:, i] >= 0
        parent = parents[:, i].clamp(min=0)
        depths[:, i] = torch.where(has, depths[torch.arange(rows), parent] + 1, 1)
        ancestors[:, i] |= has[:, None] & ancestors[torch.arange(rows), parent]
    steps = torch.arange(pending) - pending
    query_slots = torch.cat([committed[:, None] + steps, committed[:, None] + torch.arange(nodes)], dim=1)
    positions = torch.cat([committed[:, None] + steps, committed[:, None] + depths - 1], dim=1)
    region_mask = torch.cat([torch.zeros(rows, pending, nodes, dtype=torch.bool), ancestors], dim=1)
    tree = TreeMask(query_slots, committed, region_mask, committed[:, None] + depths - 1)
    query = torch.randn(rows, heads, pending + nodes, head_dim, generator=g).to(query.dtype)
    return query, key_pool, value_pool, tables, positions, block_size, window, softcap, tree


@FEW
@given(tree_attention_inputs())
def test_paged_attention_kernel_matches_reference_on_draft_trees(inputs):
    """Tree steps: pending tokens see the committed context causally, nodes their ancestors, windows compare
    positions (not storage indices); grouped-query heads, scattered blocks, soft-capping, fp32/bf16/fp16."""
    query, key_pool, value_pool, tables, positions, block_size, window, softcap, tree = inputs
    query, key_pool, value_pool, tables, positions = (t.to(DEVICE) for t in (query, key_pool, value_pool, tables,
                                                                             positions))
    tree = TreeMask(*(t.to(DEVICE) for t in tree))
    expected = paged_attention_reference(query.float(), key_pool.float(), value_pool.float(), tables, positions,
                                         block_size, window, None, softcap, tree)
    got = paged_attention_triton(query, key_pool, value_pool, tables, positions, block_size, window, None, softcap,
                                 block_m=16, block_n=16, tree=tree)
    tolerance = 1e-5 if query.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(paged_attention(query, key_pool, value_pool, tables, positions, block_size, window, None,
                                       softcap, backend="torch", tree=tree),
                       paged_attention_reference(query, key_pool, value_pool, tables, positions, block_size, window,
                                                 None, softcap, tree))


def test_attention_sinks_in_the_reference_follow_gpt_oss():
    """The reference's sinks are gpt-oss's: its own eager attention (transformers' spec of `s_aux`) on one context."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    rows, kv_heads, groups, num_context, head_dim = 2, 2, 2, 9, 8
    query = torch.randn(rows, kv_heads * groups, 3, head_dim, generator=g, dtype=torch.float64)
    keys = torch.randn(rows, kv_heads, num_context, head_dim, generator=g, dtype=torch.float64)
    values = torch.randn(rows, kv_heads, num_context, head_dim, generator=g, dtype=torch.float64)
    sinks = torch.tensor([-1.0, 0.0, 2.0, 8.0], dtype=torch.float64)
    positions = torch.tensor([[6, 7, 8], [4, 5, 6]])
    mask = reference.attention_mask(positions, num_context, None)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, groups, False
    additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    expected, _ = eager_attention_forward(module, query, keys, values, additive, scaling=0.3)
    got = reference.attend(query, keys, values, mask, 0.3, None, sinks)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got, reference.attend(query, keys, values, mask, 0.3, None))  # sinks change it


@FEW
@given(st.one_of(attention_inputs().map(lambda inputs: (*inputs, None)), tree_attention_inputs()),
       st.integers(0, 2**16))
def test_paged_attention_kernel_matches_reference_with_attention_sinks(inputs, seed):
    """Attention sinks (one logit per head, gpt-oss's `s_aux`), large and small against the scores, with windows,
    soft-capping, grouped-query heads, chains and draft trees, fp32/bf16/fp16."""
    query, key_pool, value_pool, tables, positions, block_size, window, softcap, tree = inputs
    sinks = (torch.randn(query.shape[1], generator=torch.Generator().manual_seed(seed)) * 4).to(query.dtype)
    query, key_pool, value_pool, tables, positions, sinks = (t.to(DEVICE) for t in (query, key_pool, value_pool,
                                                                                    tables, positions, sinks))
    if tree is not None:
        tree = TreeMask(*(t.to(DEVICE) for t in tree))
    expected = paged_attention_reference(query.float(), key_pool.float(), value_pool.float(), tables, positions,
                                         block_size, window, None, softcap, tree, sinks.float())
    got = paged_attention_triton(query, key_pool, value_pool, tables, positions, block_size, window, None, softcap,
                                 block_m=16, block_n=16, tree=tree, sinks=sinks)
    tolerance = 1e-5 if query.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(paged_attention(query, key_pool, value_pool, tables, positions, block_size, window, None,
                                       softcap, backend="torch", tree=tree, sinks=sinks),
                       paged_attention_reference(query, key_pool, value_pool, tables, positions, block_size, window,
                                                 None, softcap, tree, sinks))


def test_paged_attention_launcher_refuses_bad_input():
    query = torch.randn(2, 4, 3, 8, device=DEVICE)
    pool = torch.randn(32, 2, 8, device=DEVICE)
    tables = torch.ones(2, 2, dtype=torch.long, device=DEVICE)
    positions = torch.zeros(2, 3, dtype=torch.long, device=DEVICE)
    with pytest.raises(TypeError, match="key_pool must have dtype"):
        paged_attention_triton(query, pool.half(), pool.half(), tables, positions, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention_triton(query[:, :3], pool, pool, tables, positions, 16)
    with pytest.raises(ValueError, match=r"query_positions must have shape \[2, 3\]"):
        paged_attention_triton(query, pool, pool, tables, positions[:, :2], 16)
    out = paged_attention(query, pool, pool, tables, positions, 16, backend="triton")
    assert out.shape == (2, 3, 4, 8)


def test_rejection_launcher_refuses_bad_input():
    drafts = torch.zeros(2, 4, dtype=torch.long, device=DEVICE)
    counts = torch.zeros(2, dtype=torch.long, device=DEVICE)
    greedy = torch.ones(2, dtype=torch.bool, device=DEVICE)
    target = torch.rand(2, 3, 5, device=DEVICE)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        rejection_sample_triton(drafts[:, ::2], counts, target, None, greedy, None)
    with pytest.raises(ValueError, match=r"target_probs must have shape \[2, 5, 5\]"):
        rejection_sample_triton(drafts, counts, target, None, greedy, None)
    with pytest.raises(TypeError, match="num_draft_tokens must have dtype"):
        rejection_sample_triton(drafts[:, :2], counts.int(), target, None, greedy, None)


def test_kernel_benchmark_script_runs_at_tiny_shapes():
    """The GPU benchmark script itself (shapes shrunk to run anywhere): every op reports both backends."""
    from hf_specdec.kernels.bench import run, table

    rows = run(smoke=True)
    assert {row["op"] for row in rows} == {"rejection_sample", "sampling_params", "paged_attention"}
    assert all(row["triton_ms"] > 0 for row in rows)
    assert "rejection_sample" in table(rows)
