"""Prefix caching: requests whose prompts start with a stored prefix copy its keys and values (and, for EAGLE heads,
the target's hidden states there) instead of feeding it, and still equal their solo runs.
"""

from __future__ import annotations

import time

import pytest
import torch

from hf_specdec.runners.model_runner import ModelRunner
from hf_specdec.runners.model_runner import paged_attention
from hf_specdec.cache.prefix import PrefixCache
from hf_specdec.serving import ServingEngine

from conftest import VOCAB, make_model
from test_serving import no_blocks_held, repeating, served_model, solo, word_tokenizer

BS = 16


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(7, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefilled(model, runner: ModelRunner, row: int, ids: list[int]) -> None:
    runner.add_sequence(row)
    with torch.no_grad(), paged_attention(model):
        runner.forward([row], torch.tensor([ids]), [len(ids)], 1)


def slots(cache, row: int, length: int) -> torch.Tensor:
    table = cache.manager.block_table(row)
    return torch.tensor([table[p // BS] * BS + p % BS for p in range(length)])


def test_stored_blocks_load_into_another_row_and_never_cover_the_last_token():
    model = make_model("llama")
    runner = ModelRunner(model, block_size=BS)
    ids = prompt(50, seed=1)  # 3 whole blocks, then 2 tokens
    prefilled(model, runner, 0, ids)
    cache = runner.cache
    store = PrefixCache(10 * BS, BS)
    assert store.store(cache, 0, ids) == 3
    assert store.store(cache, 0, ids) == 0  # already there
    assert store.match(ids) == 48 and store.match(ids[:49]) == 48 and store.match(ids[:48]) == 32
    changed = list(ids)
    changed[20] = 7 if ids[20] != 7 else 8  # the second block differs: only the first matches
    assert store.match(changed) == 16
    assert store.match(prompt(50, seed=2)) == 0
    runner.add_sequence(1)
    length, features = store.load(cache, 1, ids[:40] + prompt(5, seed=3))
    assert (length, features) == (32, None) and cache.length(1) == 32
    for pools in (cache.key_pools, cache.value_pools):
        for pool in pools.values():
            assert torch.equal(pool[slots(cache, 1, 32)], pool[slots(cache, 0, 32)])
    assert store.num_hit_tokens == 32 and store.num_queried_tokens == 45


def test_least_recently_used_blocks_go_first_and_a_chain_never_evicts_itself():
    model = make_model("llama")
    runner = ModelRunner(model, block_size=BS)
    a, c, d, long = prompt(33, seed=1), prompt(17, seed=2), prompt(17, seed=3), prompt(49, seed=4)
    for row, ids in enumerate((a, c, d, long)):
        prefilled(model, runner, row, ids)
    store = PrefixCache(3 * BS, BS)
    assert store.store(runner.cache, 0, a) == 2 and store.store(runner.cache, 1, c) == 1  # full
    runner.add_sequence(4)
    store.load(runner.cache, 4, a)  # a's blocks are now the most recently used
    assert store.store(runner.cache, 2, d) == 1  # takes c's block, the least recently used
    assert store.match(c) == 0 and store.match(a) == 32 and store.match(d) == 16
    small = PrefixCache(2 * BS, BS)
    assert small.store(runner.cache, 3, long) == 2  # its third block would evict its own first: it stops there
    assert small.match(long) == 32


def test_features_are_kept_beside_their_blocks():
    model = make_model("llama")
    runner = ModelRunner(model, block_size=BS)
    ids = prompt(40, seed=1)
    prefilled(model, runner, 0, ids)
    store = PrefixCache(8 * BS, BS, features=True)
    states = torch.randn(39, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs them"):
        store.store(runner.cache, 0, ids)
    assert store.store(runner.cache, 0, ids, states, 0) == 2
    runner.add_sequence(1)
    length, features = store.load(runner.cache, 1, ids)
    assert length == 32 and torch.equal(features, states[:32])
    # States that begin past a block the store lacks cannot fill it: nothing is stored from there on.
    other = PrefixCache(8 * BS, BS, features=True)
    assert other.store(runner.cache, 0, ids, states[20:], 20) == 0


@pytest.mark.parametrize("speculator", ["ngram", "none"])
def test_requests_sharing_a_prefix_equal_their_solo_runs(tokenizer, speculator):
    model = served_model()
    engine = ServingEngine(model, tokenizer, "ngram", num_speculative_tokens=0 if speculator == "none" else 4,
                           max_batch_size=3, schedule="constant").start()
    try:
        shared = repeating(40, seed=1)
        plan = [(shared + repeating(3 + i, seed=20 + i), 10 + 3 * i) for i in range(6)]
        plan.append((shared[:20] + repeating(9, seed=9), 12))  # one whole block in common
        streams = []
        for p, n in plan:
            streams.append(engine.submit(p, n))
            time.sleep(0.01)
        for (p, n), stream in zip(plan, streams):
            for _ in stream:
                pass
            assert stream.request.output_ids == solo(model, p, n), (p, n)
        cache = engine.prefix_cache
        # The first request stores the shared prompt's 2 whole blocks; those arriving after it finds them (requests
        # admitted in the same step as the first find nothing yet).
        assert cache.num_hit_tokens >= 2 * BS and cache.num_hit_tokens % BS == 0
        assert cache.num_queried_tokens == sum(len(p) for p, _ in plan)
        time.sleep(0.05)
        assert no_blocks_held(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("version", [1, 3])
def test_an_eagle_head_drafts_the_same_from_stored_states(tokenizer, tmp_path, version):
    """The head gets the stored prefix's states ahead of the first step's: with and without the prefix cache it
    drafts exactly the same tokens, step by step (the requests queue before the engine starts, so the steps are the
    same in both runs)."""
    from hf_specdec import EagleSpeculator
    from test_eagle import convert

    runs = []
    for tokens in (0, None):
        model = served_model()
        head = EagleSpeculator.from_pretrained(convert(tmp_path / str(tokens), model, version, **(
            {"aux_layers": [0, 1, 1]} if version == 3 else {})))
        drafts = []
        propose = head.propose

        def recording(batch, k, propose=propose, drafts=drafts):
            draft = propose(batch, k)
            drafts.append((list(batch.active), draft.token_ids.tolist(), draft.num_tokens.tolist()))
            return draft

        head.propose = recording
        engine = ServingEngine(model, tokenizer, head, num_speculative_tokens=3, max_batch_size=2,
                               schedule="constant", prefix_cache_tokens=tokens)
        shared = repeating(37, seed=1)
        plan = [(shared + repeating(3 + i, seed=20 + i), 8 + 3 * i) for i in range(5)]
        streams = [engine.submit(p, n) for p, n in plan]
        engine.start()
        try:
            for (p, n), stream in zip(plan, streams):
                for _ in stream:
                    pass
                assert stream.request.output_ids == solo(model, p, n)
        finally:
            engine.shutdown()
        runs.append((drafts, engine.prefix_cache.num_hit_tokens if engine.prefix_cache else 0))
    (without, _), (with_cache, hits) = runs
    assert hits == 3 * 2 * BS  # the three requests that join later each copy 2 blocks
    assert sum(n for _, _, counts in with_cache for n in counts) > 0
    assert with_cache == without


def test_prefix_cache_is_refused_where_it_cannot_apply(tokenizer):
    with pytest.raises(ValueError, match="prefix_cache_tokens must be >= 0"):
        ServingEngine(served_model(), tokenizer, "ngram", prefix_cache_tokens=-1)
    with pytest.raises(ValueError, match="at least one block"):
        ServingEngine(served_model(), tokenizer, "ngram", prefix_cache_tokens=8)
    assert ServingEngine(served_model(), tokenizer, "ngram", prefix_cache_tokens=0).prefix_cache is None
