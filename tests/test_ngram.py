"""N-gram lookup: the longest matching context wins (the latest among equals), batched rows stay independent, and
the match length comes back as the proposal's confidence class."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_specdec import NgramSpeculator
from hf_specdec.types import PAD_ID, SequenceBatch


def make_batch(rows: list[list[int]], extra: int = 3) -> SequenceBatch:
    """Left-aligned like the engine's buffer: padding (-7, never a real id here) before each row, spare columns after."""
    width = max(map(len, rows))
    buffer = torch.full((len(rows), width + extra), -7, dtype=torch.long)
    first = []
    for i, r in enumerate(rows):
        buffer[i, width - len(r): width] = torch.tensor(r)
        first.append(width - len(r))
    return SequenceBatch(buffer, torch.tensor(first), [len(r) for r in rows], list(range(len(rows))), width, False,
                         None, 100)


def brute_force(row: list[int], k: int, min_ngram: int, max_ngram: int) -> tuple[list[int], int]:
    """Per-row spec in plain Python: the earlier position whose preceding context matches the row's end the longest
    (latest among equals), its continuation, and the match length."""
    best, best_len = None, 0
    for e in range(len(row) - 1):  # e aligned with the last token; something must follow it
        m = 0
        while m < max_ngram and e - m >= 0 and row[e - m] == row[len(row) - 1 - m]:
            m += 1
        if m >= best_len and m > 0:
            best, best_len = e, m
    if best is None or best_len < min_ngram:
        return [], 0
    follows = row[best + 1:]  # copied on past the end: the proposal repeats with the match's distance as period
    return [follows[i % len(follows)] for i in range(k)], best_len


def proposals(spec, rows, k, path="propose"):
    """Each row's drafts and confidence class. `path="_propose_device"`: through the tensor-op lookup an accelerator
    runs, instead of `propose`'s choice for the batch's device (numpy for a CPU's)."""
    draft = getattr(spec, path)(make_batch(rows), k)
    out = []
    for i in range(len(rows)):
        n = int(draft.num_tokens[i])
        assert (draft.token_ids[i, n:] == PAD_ID).all()
        out.append((draft.token_ids[i, :n].tolist(), int(draft.confidence[i]) if n else 0))
    return out


def test_longest_context_beats_a_later_shorter_match():
    # "1 2 3" appears early followed by 7 8; "2 3" appears later followed by 5. The row ends in "1 2 3".
    row = [1, 2, 3, 7, 8, 9, 2, 3, 5, 6, 1, 2, 3]
    (tokens, confidence), = proposals(NgramSpeculator(1, 8), [row], 4)
    assert tokens == [7, 8, 9, 2]
    assert confidence == 3


def test_latest_wins_among_equal_matches():
    row = [4, 1, 2, 9, 4, 1, 2, 8, 5, 1, 2]
    (tokens, _), = proposals(NgramSpeculator(2, 8), [row], 2)
    assert tokens == [8, 5]


def test_short_matches_below_min_ngram_propose_nothing():
    row = [1, 2, 3, 4, 9, 8, 7, 4]
    assert proposals(NgramSpeculator(2, 8), [row], 4) == [([], 0)]
    assert proposals(NgramSpeculator(1, 8), [row], 4) == [([9, 8, 7, 4], 1)]


def test_padding_never_matches_and_rows_are_independent():
    rows = [[5, 6, 5, 6], [1, 2, 3, 1, 2, 3, 4, 1, 2], [9]]
    batched = proposals(NgramSpeculator(1, 8), rows, 3)
    assert batched == [proposals(NgramSpeculator(1, 8), [r], 3)[0] for r in rows]
    assert batched[2] == ([], 0)


def test_confidence_is_capped_at_the_last_class():
    row = list(range(20)) + list(range(15))
    spec = NgramSpeculator(2, 16)
    (tokens, confidence), = proposals(spec, [row], 3)
    assert tokens == [15, 16, 17]
    assert confidence == len(spec.confidence_priors) - 1
    assert spec.drafts_are_free


def test_priors_rise_with_the_match_and_doubt_one_or_two_tokens():
    """Acceptance assumed before any evidence: none without a match, rising with the matched length; a match of one
    or two tokens (mostly common words meeting again in free text) well below an even chance."""
    priors = NgramSpeculator(1, 16).confidence_priors
    assert priors[0] == 0.0
    assert all(a < b for a, b in itertools.pairwise(priors))
    assert priors[1] == pytest.approx(0.25) and priors[2] == pytest.approx(0.4)
    assert priors[3] == pytest.approx(2 / 3)
    assert len(NgramSpeculator(1, 3).confidence_priors) == 4  # a class per length the lookup can report


PATHS = pytest.mark.parametrize("path", ["propose", "_propose_device"])


@PATHS
@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=4),
       st.integers(1, 5), st.integers(1, 3), st.integers(0, 4))
def test_matches_the_per_row_spec(path, rows, k, min_ngram, extra):
    """Both lookups: numpy over the columns holding the last token (a CPU's), tensor ops over every column (an
    accelerator's)."""
    max_ngram = min_ngram + extra
    spec = NgramSpeculator(min_ngram, max_ngram)
    got = proposals(spec, rows, k, path)
    for row, (tokens, confidence) in zip(rows, got):
        want, length = brute_force(row, k, min_ngram, max_ngram)
        assert tokens == want
        if want:
            assert confidence == min(length, len(spec.confidence_priors) - 1)


@PATHS
def test_a_match_late_in_a_long_row_is_found(path):
    """Columns are ranked by match length times the row's width plus the column: in rows of thousands of tokens that
    rank must not overflow (a 16-bit rank wrapped past 32767 and picked a column with a shorter match)."""
    g = torch.Generator().manual_seed(0)
    filler = torch.randint(10, 1000, (6000,), generator=g).tolist()
    phrase = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # The phrase's first six tokens early (a shorter match), the whole phrase near the end, then its start again.
    row = phrase[:5] + [99] + filler[:3000] + phrase + filler[3000:] + phrase[:8]
    (tokens, confidence), = proposals(NgramSpeculator(1, 16), [row], 3, path)
    assert tokens == [9] + filler[3000:3002]
    assert confidence == 8


@PATHS
def test_lookup_reads_only_the_columns_rows_use(path):
    """A server's buffer is as wide as the model's context; the lookup reads up to the rows' longest end only, and
    proposes the same as over a buffer cut there. Stale tokens past a row's end (an earlier, longer request's) are
    never matched."""
    rows = [[5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8, 9], [4, 4]]
    narrow = make_batch(rows, extra=0)
    wide = make_batch(rows, extra=500)
    wide.token_ids[:, narrow.token_ids.shape[1]:] = 5  # stale tokens past every row's end
    assert narrow.token_ids.shape[1] <= wide.used_width(wide.active) <= 2 * narrow.token_ids.shape[1] < 500
    ngram = NgramSpeculator()
    a, b = getattr(ngram, path)(narrow, 3), getattr(ngram, path)(wide, 3)
    assert torch.equal(a.num_tokens, b.num_tokens) and torch.equal(a.confidence, b.confidence)
    assert torch.equal(torch.where(a.token_ids == PAD_ID, -1, a.token_ids), torch.where(b.token_ids == PAD_ID, -1, b.token_ids))
    assert b.num_tokens.tolist()[:2] == [3, 3]
    assert b.token_ids[1].tolist() == [8, 9, 8]  # the match 2 back, copied on with period 2


def test_text_repeating_itself_gets_k_drafts():
    """The latest match in a run of one token lies just before the row's end; its continuation is copied on past
    the end (period 1), so the row gets all k drafts, not the one token that followed the match."""
    (tokens, confidence), = proposals(NgramSpeculator(1, 16), [[3, 7] + [5] * 12], 6)
    assert tokens == [5] * 6
    assert confidence == 8
    (tokens, _), = proposals(NgramSpeculator(1, 16), [[1, 2, 3, 1, 2, 3, 1]], 5)
    assert tokens == [2, 3, 1, 2, 3]


def test_free_drafts_default_to_ten_a_step_and_model_drafts_to_five():
    """Without `num_speculative_tokens`, a speculator whose drafts cost nothing (the lookup) may verify up to 10 a
    step, a model speculator 5 (`speculative_schedule="constant"` drafts the ceiling every step); output stays the
    target's own."""
    from conftest import make_model

    target = make_model("llama", dtype=torch.float32)
    draft = make_model("llama", dtype=torch.float32)
    ids = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5]])
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    for speculator, ceiling in (("ngram", 10), (draft, 5)):
        out = target.generate(ids, max_new_tokens=24, do_sample=False, speculator=speculator,
                              speculative_schedule="constant", return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        assert max(out.speculative_metrics.k_per_step) == ceiling
