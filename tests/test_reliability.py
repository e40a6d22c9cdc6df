"""Reliability: broken logits refused, verifier and n-gram properties on random inputs, and a soak test."""

import os
import random

import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_specdec import DraftProposal, NgramSpeculator
from hf_specdec.decode.verify import verify
from hf_specdec.types import PAD_ID, SequenceBatch
from conftest import make_model, ragged_batch, repetitive_prompt


def test_nan_logits_are_refused_with_a_clear_error():
    model = make_model()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN or inf logits"):
        model.generate(repetitive_prompt(width=10), max_new_tokens=4, speculator="ngram")


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(0, 6), st.integers(2, 9), st.data())
def test_greedy_verify_properties(rows, k, vocab, data):
    """Accepted drafts are a prefix equal to the target argmax; then exactly one target token; then padding."""
    seed = data.draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, k + 1, vocab, generator=g)
    num = torch.randint(0, k + 1, (rows,), generator=g)
    argmax = logits.argmax(-1)
    drafts = torch.where(torch.rand(rows, k, generator=g) < 0.6, argmax[:, :k], torch.randint(0, vocab, (rows, k), generator=g))
    drafts = torch.where(torch.arange(k)[None] < num[:, None], drafts, PAD_ID)
    result = verify(logits, DraftProposal(drafts, num), do_sample=False)
    for i in range(rows):
        a, out = int(result.num_accepted[i]), result.output_token_ids[i].tolist()
        assert 0 <= a <= int(num[i])
        assert out[:a] == drafts[i, :a].tolist() == argmax[i, :a].tolist()
        assert out[a] == int(argmax[i, a])
        assert a == int(num[i]) or drafts[i, a] != argmax[i, a]  # stopped at the first mismatch
        assert all(t == PAD_ID for t in out[a + 1:])


def brute_force_ngram(seq, k, lo, hi):
    for n in range(hi, lo - 1, -1):
        if len(seq) < n + 1:
            continue
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):  # latest earlier occurrence first
            if seq[start:start + n] == suffix:
                follows = seq[start + n:]  # copied on past the end: it repeats with the match's distance as period
                return [follows[i % len(follows)] for i in range(k)]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(3, 6), min_size=1, max_size=25), min_size=1, max_size=4),
       st.integers(1, 6), st.integers(1, 3), st.integers(0, 2))
def test_ngram_matches_brute_force(rows, k, lo, extra):
    hi = lo + extra
    width = max(len(r) for r in rows)
    buffer = torch.full((len(rows), width + k + 2), 0, dtype=torch.long)
    for i, r in enumerate(rows):  # left-padded, as the engine lays rows out
        buffer[i, width - len(r):width] = torch.tensor(r)
    first = torch.tensor([width - len(r) for r in rows])
    batch = SequenceBatch(buffer, first, [len(r) for r in rows], list(range(len(rows))), width, False, None, 10)
    draft = NgramSpeculator(lo, hi).propose(batch, k)
    for i, r in enumerate(rows):
        n = int(draft.num_tokens[i])
        assert draft.token_ids[i, :n].tolist() == brute_force_ngram(r, k, lo, hi)
        assert (draft.token_ids[i, n:] == PAD_ID).all()


def _runners_spy(monkeypatch):
    from hf_specdec.runners import model_runner

    runners, original = [], model_runner.ModelRunner.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        runners.append(self)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", spy)
    return runners


@pytest.mark.slow  # a soak
def test_soak_random_calls_stay_lossless_and_return_every_block(monkeypatch):
    """Random batch sizes, k, speculators and sampling settings; HF_SPECDEC_SOAK=N runs N calls (default 150)."""
    calls = int(os.environ.get("HF_SPECDEC_SOAK", "150"))
    rng = random.Random(0)
    targets = {arch: make_model(arch) for arch in ("llama", "mistral", "gemma3")}
    drafts = {arch: make_model(arch, seed=1) for arch in targets}
    runners = _runners_spy(monkeypatch)
    process = psutil.Process()
    rss_after_warmup = None
    for call in range(calls):
        arch = rng.choice(list(targets))
        input_ids, mask = ragged_batch(rows=rng.randint(1, 4), width=rng.randint(3, 20), seed=call)
        kwargs = dict(max_new_tokens=rng.randint(1, 16), num_speculative_tokens=rng.randint(1, 8),
                      speculative_schedule=rng.choice(["adaptive", "constant"]),
                      eos_token_id=rng.choice([None, rng.randint(2, 95)]))
        speculator = rng.choice(["ngram", drafts[arch]])
        if rng.random() < 0.3:
            out = targets[arch].generate(input_ids, attention_mask=mask, do_sample=True, temperature=rng.uniform(0.5, 1.5),
                                         top_k=rng.choice([0, 5]), speculator=speculator, **kwargs)
            assert out.shape[0] == input_ids.shape[0] and int(out.max()) < 96 and int(out.min()) >= 0
        else:
            plain_kwargs = {k: v for k, v in kwargs.items() if k not in ("num_speculative_tokens", "speculative_schedule")}
            expected = targets[arch].generate(input_ids, attention_mask=mask, do_sample=False, **plain_kwargs)
            out = targets[arch].generate(input_ids, attention_mask=mask, do_sample=False, speculator=speculator, **kwargs)
            assert torch.equal(out, expected), f"call {call}: {arch} {kwargs} {speculator if speculator == 'ngram' else 'draft'}"
        for runner in runners:
            assert runner.cache.manager.sequences() == []
            manager = runner.cache.manager  # all free, but for the rows' regions (they stay with the rows)
            assert manager.num_free_blocks == manager.num_blocks - 1 - manager.num_region_blocks
        runners.clear()
        if call == 20:
            rss_after_warmup = process.memory_info().rss
    if rss_after_warmup is not None:
        growth = process.memory_info().rss - rss_after_warmup
        assert growth < 64 * 2**20, f"resident memory grew by {growth / 2**20:.0f} MiB over {calls} calls"
