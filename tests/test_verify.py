"""The verifier: greedy cases spelled out as data, and sampling that reproduces the target distribution."""

import pytest
import torch

from hf_specdec import DraftProposal
from hf_specdec.decode.verify import verify
from hf_specdec.types import PAD_ID

VOCAB = 6


def one_hot_logits(argmax_ids):
    """`[rows, k + 1, VOCAB]` logits whose argmax at each position is the given id."""
    ids = torch.tensor(argmax_ids)
    return torch.nn.functional.one_hot(ids, VOCAB).float() * 10


GREEDY_CASES = [
    # name, drafts, num_drafts, target argmax per position, expected output, expected accepted
    ("full match + bonus", [[1, 2, 3]], [3], [[1, 2, 3, 4]], [[1, 2, 3, 4]], [3]),
    ("reject at first", [[5, 2, 3]], [3], [[1, 2, 3, 4]], [[1, PAD_ID, PAD_ID, PAD_ID]], [0]),
    ("reject in middle", [[1, 5, 3]], [3], [[1, 2, 3, 4]], [[1, 2, PAD_ID, PAD_ID]], [1]),
    ("empty draft", [[PAD_ID, PAD_ID, PAD_ID]], [0], [[4, 2, 3, 4]], [[4, PAD_ID, PAD_ID, PAD_ID]], [0]),
    ("k = 1 match", [[2]], [1], [[2, 0]], [[2, 0]], [1]),
    ("mixed ragged batch", [[1, 2, PAD_ID], [3, 3, 3], [0, PAD_ID, PAD_ID]], [2, 3, 1],
     [[1, 2, 5, 0], [3, 1, 3, 3], [0, 4, 4, 4]],
     [[1, 2, 5, PAD_ID], [3, 1, PAD_ID, PAD_ID], [0, 4, PAD_ID, PAD_ID]], [2, 1, 1]),
    # A padded draft position that happens to equal the argmax must not be accepted.
    ("padding never accepted", [[1, 2, 3]], [1], [[1, 2, 3, 4]], [[1, 2, PAD_ID, PAD_ID]], [1]),
]


@pytest.mark.parametrize("name,drafts,num,argmax,expected,accepted", GREEDY_CASES, ids=[c[0] for c in GREEDY_CASES])
def test_greedy_cases(name, drafts, num, argmax, expected, accepted):
    draft = DraftProposal(torch.tensor(drafts), torch.tensor(num))
    result = verify(one_hot_logits(argmax), draft, do_sample=False)
    assert result.output_token_ids.tolist() == expected
    assert result.num_accepted.tolist() == accepted


def tv_distance(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


def far_apart(seed=0):
    """Target and draft distributions over VOCAB tokens that differ a lot (TV > 0.4), for 3 positions."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(3, VOCAB, generator=g) * 2
    draft_probs = torch.softmax(-target_logits + torch.randn(3, VOCAB, generator=g), -1)
    assert 0.5 * (torch.softmax(target_logits, -1) - draft_probs).abs().sum(-1).min() > 0.4
    return target_logits, draft_probs


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_sampling_reproduces_target_distribution(with_draft_probs):
    """First output token ~ target at position 0; given the first draft accepted, the second ~ target at position 1."""
    torch.manual_seed(0)
    n = 400_000
    target_logits, draft_probs = far_apart()
    drafts = torch.stack([torch.multinomial(draft_probs[j], n, replacement=True) for j in range(2)], dim=1)
    proposal = DraftProposal(drafts, torch.full((n,), 2), draft_probs[:2].expand(n, 2, VOCAB) if with_draft_probs
                             else None)
    result = verify(target_logits.expand(n, 3, VOCAB), proposal, do_sample=True)
    target_probs = torch.softmax(target_logits, -1)
    out = result.output_token_ids
    assert tv_distance(out[:, 0], target_probs[0]) < 0.01
    first_accepted = result.num_accepted >= 1
    assert first_accepted.sum() > 5_000 and (~first_accepted).sum() > 5_000  # both branches exercised
    # Expected TV noise over 6 outcomes from >= 5000 samples is below 0.015; 0.03 leaves a margin.
    assert tv_distance(out[first_accepted, 1], target_probs[1]) < 0.03
    # The naive rule "emit the draft" would be far off: the test has power.
    assert tv_distance(drafts[:, 0], target_probs[0]) > 0.3


def test_sampling_bonus_and_empty_drafts_sample_the_target():
    torch.manual_seed(1)
    n = 100_000
    target_logits, _ = far_apart(1)
    proposal = DraftProposal(torch.full((n, 0), PAD_ID), torch.zeros(n, dtype=torch.long))
    result = verify(target_logits[:1].expand(n, 1, VOCAB), proposal, do_sample=True)
    assert tv_distance(result.output_token_ids[:, 0], torch.softmax(target_logits[0], -1)) < 0.01


def test_sampling_is_reproducible_with_a_seed():
    target_logits, draft_probs = far_apart()
    drafts = torch.tensor([[1, 2]] * 50)
    proposal = DraftProposal(drafts, torch.full((50,), 2), draft_probs[:2].expand(50, 2, VOCAB))
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        outs.append(verify(target_logits.expand(50, 3, VOCAB), proposal, do_sample=True).output_token_ids)
    assert torch.equal(outs[0], outs[1])


def test_draft_with_zero_probability_token_is_rejected():
    target_logits = torch.zeros(1, 2, VOCAB)
    draft_probs = torch.zeros(1, 1, VOCAB)
    draft_probs[0, 0, 3] = 1.0
    proposal = DraftProposal(torch.tensor([[2]]), torch.tensor([1]), draft_probs)  # token 2 has draft_prob 0
    assert verify(target_logits, proposal, do_sample=True).num_accepted.item() == 0
