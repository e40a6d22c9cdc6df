"""Hybrid and recurrent models (Mamba2, Qwen3-Next, Falcon-H1): each row's conv and recurrent state rolls back to its
last accepted token (`cache/recurrent.py`), so speculative output equals plain greedy `generate` token for token on a
ragged left-padded batch, with n-gram drafts, an identical draft and a disagreeing (hybrid) draft; rows joining and
leaving a running batch equal their solo runs; the cache's rollback is checked against never drafting."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    FalconH1Config, FalconH1ForCausalLM, LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM,
    MiniMaxConfig, MiniMaxForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM,
)

from hf_specdec import UnsupportedModelError
from hf_specdec.runners.support import check_model_supported
from hf_specdec.runners.model_runner import ModelRunner, paged_attention
from hf_specdec.cache.recurrent import RecurrentPagedCache, recurrent_mixers

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=None,
              tie_word_embeddings=False)
ATTENTION = dict(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 max_position_embeddings=256)
ARCHITECTURES = {
    # Two Mamba2 layers: nothing but recurrent state.
    "mamba2": lambda: Mamba2ForCausalLM(Mamba2Config(**COMMON, num_heads=4, head_dim=16, n_groups=1, state_size=8,
                                                     expand=2, conv_kernel=4)),
    # Gated DeltaNet then full attention.
    "qwen3_next": lambda: Qwen3NextForCausalLM(Qwen3NextConfig(
        **COMMON, **ATTENTION, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, mlp_only_layers=[0, 1])),
    # Attention and Mamba2 side by side in every layer.
    "falcon_h1": lambda: FalconH1ForCausalLM(FalconH1Config(
        **COMMON, **ATTENTION, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1,
        mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16)),
}


def make(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch]().to(torch.float64).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def ragged_batch():
    """Three left-padded rows of lengths 13, 6 and 9; the first repeats a phrase (n-gram lookup finds matches)."""
    g = torch.Generator().manual_seed(1)
    phrase = torch.randint(3, VOCAB, (4,), generator=g)
    rows = [phrase.repeat(4)[:13], torch.randint(3, VOCAB, (6,), generator=g),
            torch.randint(3, VOCAB, (9,), generator=g)]
    input_ids = torch.zeros((3, 13), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, 13 - len(row):] = row
        attention_mask[i, 13 - len(row):] = 1
    return input_ids, attention_mask


def greedy_pair(target, speculator, schedule="constant", k=3):
    input_ids, attention_mask = ragged_batch()
    args = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=16, do_sample=False)
    with torch.no_grad():
        expected = target.generate(**args)
        out = target.generate(**args, speculator=speculator, num_speculative_tokens=k, speculative_schedule=schedule,
                              return_dict_in_generate=True)
    return out, expected


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_equals_generate_with_ngram_and_disagreeing_draft(arch):
    """Rejections happen (acceptance < 1), so rows really roll their recurrent state back, and output is unchanged."""
    target = make(arch)
    for speculator in ("ngram", make(arch, seed=7)):
        out, expected = greedy_pair(target, speculator)
        assert torch.equal(out.sequences, expected), speculator
        metrics = out.speculative_metrics
        assert metrics.num_draft_tokens > 0
        assert metrics.num_accepted_tokens < metrics.num_draft_tokens, speculator


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_identical_draft_is_fully_accepted(arch):
    target = make(arch)
    out, expected = greedy_pair(target, make(arch))
    assert torch.equal(out.sequences, expected)
    metrics = out.speculative_metrics
    assert metrics.num_draft_tokens > 0 and metrics.num_accepted_tokens == metrics.num_draft_tokens


def test_hybrid_draft_for_an_attention_target():
    """A Llama target drafted by a hybrid (Qwen3-Next) model of the same vocabulary."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**COMMON, **ATTENTION)).to(torch.float64).eval()
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    out, expected = greedy_pair(target, make("qwen3_next", seed=3), k=4)
    assert torch.equal(out.sequences, expected)
    assert out.speculative_metrics.num_draft_tokens > 0


def test_rows_joining_and_leaving_a_running_batch_equal_their_solo_runs():
    """Continuous batching: five requests through two slots, so rows join a batch whose other row holds state, and a
    slot's next request must start from a fresh state."""
    target = make("qwen3_next")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 4, 11, 5, 9)]
    lengths = [10, 6, 8, 12, 7]
    with torch.no_grad():
        expected = [target.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
                    for p, n in zip(prompts, lengths)]
    for speculator in ("ngram", make("qwen3_next", seed=5)):
        outputs = _batched(target, prompts, lengths, speculator)
        assert outputs == expected, speculator


def _batched(target, prompts, lengths, speculator):
    from hf_specdec.serving import ServingEngine

    engine = ServingEngine(target, None, speculator, num_speculative_tokens=3, max_batch_size=2,
                           schedule="constant").start()
    try:
        streams = [engine.submit(p, n) for p, n in zip(prompts, lengths)]
        for stream in streams:
            for _ in stream:
                pass
        return [list(s.request.output_ids) for s in streams]
    finally:
        engine.shutdown()


def test_draft_trees_are_refused():
    from hf_specdec.cache.layout import TreeAttention

    cache = RecurrentPagedCache()
    cache.add_sequence(0)
    starts = cache.reserve([0], [3])
    tree = TreeAttention(torch.zeros(1, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long),
                         torch.ones(1, 3, 3, dtype=torch.bool), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="draft trees are not supported with recurrent"):
        cache.plan_step([0], starts, [3], torch.device("cpu"), tree)


def test_models_whose_state_is_out_of_reach_are_refused_up_front():
    """MiniMax insists on a cache class of its own; a recurrent layer the mixer search misses reaches the cache
    outside a split call. Both are refused by the up-front checks, with the reason."""
    minimax = MiniMaxForCausalLM(MiniMaxConfig(**COMMON, **ATTENTION, layer_types=["linear_attention",
                                                                                 "full_attention"],
                                               num_local_experts=2, num_experts_per_tok=1)).eval()
    with pytest.raises(UnsupportedModelError, match="MiniMax"):
        check_model_supported(minimax, role="target model")
    model = make("mamba2")
    recurrent_mixers(model)
    model._hf_specdec_recurrent_mixers = model._hf_specdec_recurrent_mixers[:1]  # pretend one was missed
    with pytest.raises(UnsupportedModelError, match="outside the recurrent layers"):
        check_model_supported(model, role="target model")


# --- the cache's rollback ----------------------------------------------------------------------------------------

def _feed(runner, rows, tokens, num_logits):
    """Feeds `tokens[i]` to row `rows[i]` (right-aligned) and returns the last `num_logits` logits of each row."""
    q = max(len(t) for t in tokens)
    input_ids = torch.tensor([[0] * (q - len(t)) + t for t in tokens])
    return runner.forward(rows, input_ids, [len(t) for t in tokens], num_logits=num_logits).logits


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_rollback_then_regenerate_equals_never_drafting(arch):
    """Random drafts fed, rolled back to a random accepted length per row, then the true continuation: every logit
    equals that of a runner that only ever saw the true tokens, one step at a time."""
    model = make(arch)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9)]
    truth = [torch.randint(3, VOCAB, (12,), generator=g).tolist() for _ in prompts]
    with torch.no_grad(), paged_attention(model):
        reference, drafted = ModelRunner(model), ModelRunner(model)
        assert isinstance(drafted.cache, RecurrentPagedCache)
        for runner in (reference, drafted):
            for row in (0, 1):
                runner.add_sequence(row)
        expected = [_feed(reference, [0, 1], prompts, 1)]
        for j in range(12):
            expected.append(_feed(reference, [0, 1], [[t[j]] for t in truth], 1))
        got = [_feed(drafted, [0, 1], prompts, 1)]
        done = 0
        while done < 12:  # each step: the next true token, then k guesses that are right up to a random point
            k = int(torch.randint(1, 6, (1,), generator=g))
            accepted = [int(torch.randint(0, k + 1, (1,), generator=g)) for _ in (0, 1)]
            accepted = [min(a, 11 - done) for a in accepted]
            step = []
            for row, a in enumerate(accepted):
                right = truth[row][done + 1: done + 1 + a]
                wrong = [(t + 1) % VOCAB or 3 for t in truth[row][done + 1 + a: done + 1 + k]]
                wrong += [3] * (k - a - len(wrong))
                step.append([truth[row][done]] + right + wrong)
            lengths = [drafted.length(r) for r in (0, 1)]
            logits = _feed(drafted, [0, 1], step, k + 1)
            n = min(accepted)  # both rows keep their first n + 1 positions' logits
            for j in range(n + 1):
                got.append(logits[:, j:j + 1])
            for row in (0, 1):
                drafted.rollback(row, lengths[row] + 1 + n)
            done += n + 1
        for want, have in zip(expected, got):
            torch.testing.assert_close(have, want, rtol=1e-9, atol=1e-9)


def test_rollback_below_the_last_commit_is_refused():
    model = make("mamba2")
    with torch.no_grad(), paged_attention(model):
        runner = ModelRunner(model)
        runner.add_sequence(0)
        _feed(runner, [0], [[3, 4, 5, 6]], 2)
        runner.rollback(0, 3)
        _feed(runner, [0], [[7, 8]], 2)
        with pytest.raises(RuntimeError, match="no longer kept"):
            runner.rollback(0, 2)


def test_history_grows_past_its_ring_and_keeps_the_live_states():
    """A step longer than the ring re-indexes the live states; rolling back into it still equals never drafting."""
    model = make("mamba2")
    tokens = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad(), paged_attention(model):
        long_step, reference = ModelRunner(model), ModelRunner(model)
        for runner in (long_step, reference):
            runner.add_sequence(0)
        _feed(long_step, [0], [tokens[:5]], 1)
        history = long_step.cache.history
        _feed(long_step, [0], [tokens[5:5 + 2 * history]], 2 * history)  # states after each of these positions
        assert long_step.cache.history > history
        long_step.rollback(0, 9)
        # The same split as the long step (transformers' Mamba2 chunked path rounds through float32).
        _feed(reference, [0], [tokens[:5]], 1)
        _feed(reference, [0], [tokens[5:9]], 4)
        want = _feed(reference, [0], [[tokens[9]]], 1)
        have = _feed(long_step, [0], [[tokens[9]]], 1)
        torch.testing.assert_close(have, want, rtol=1e-9, atol=1e-9)


def test_a_long_step_of_one_row_keeps_the_other_rows_states():
    """A newcomer's long prompt grows the ring while the running row sits the step out: the running row's live
    states are re-indexed too, so its next token equals a run where the ring never grew."""
    model = make("mamba2")
    g = torch.Generator().manual_seed(6)
    running, newcomer = torch.randint(3, VOCAB, (8,), generator=g).tolist(), None
    with torch.no_grad(), paged_attention(model):
        grown, reference = ModelRunner(model), ModelRunner(model)
        for runner in (grown, reference):
            runner.add_sequence(1)
            _feed(runner, [1], [running[:6]], 1)
            _feed(runner, [1], [running[6:8]], 2)  # a verify: states after both positions kept
        history = grown.cache.history
        newcomer = torch.randint(3, VOCAB, (2 * history,), generator=g).tolist()
        grown.add_sequence(0)
        grown.add_sequence(grown.cache.num_slots + 2)  # admitted, not stepped yet: past the states' slots
        _feed(grown, [0], [newcomer], 1)
        assert grown.cache.history > history
        want = _feed(reference, [1], [[running[0]]], 1)
        have = _feed(grown, [1], [[running[0]]], 1)
    torch.testing.assert_close(have, want, rtol=1e-9, atol=1e-9)
