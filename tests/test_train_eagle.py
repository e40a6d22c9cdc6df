"""`train_eagle_head` and `hf-specdec train-eagle`: a trained head beats an untrained one and stays lossless, a resumed
run equals an uninterrupted one, bad input is explained."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import COMMON, VOCAB, make_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

import hf_specdec.train_eagle as te
from hf_specdec import EagleSpeculator
from hf_specdec.train_eagle import (
    TrainingSet, build_training_set, default_layers, head_config_for, new_head, save_head, train_eagle_head,
)


def make_target(num_layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": num_layers})).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts(num: int, seed: int, width: int = 6) -> list[list[int]]:
    return torch.randint(2, VOCAB, (num, width), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.fixture(scope="module")
def data1(target) -> TrainingSet:
    return build_training_set(target, prompts(32, 1), default_layers(target, 1), max_new_tokens=24)


def acceptance(target, spec) -> float:
    """Acceptance on held-out prompts at k = 3; also checks the output is the target's own greedy output."""
    input_ids = torch.tensor(prompts(8, 99))
    out = target.generate(input_ids=input_ids, max_new_tokens=24, speculator=spec, num_speculative_tokens=3,
                          speculative_schedule="constant", return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(input_ids=input_ids, max_new_tokens=24, do_sample=False))
    return out.speculative_metrics.acceptance_rate


def test_training_set_holds_the_targets_own_continuations_and_states(target, data1):
    assert data1.token_ids.shape == (32, 30) and data1.lengths.tolist() == [30] * 32
    expected = target.generate(input_ids=torch.tensor(prompts(32, 1)[:2]), max_new_tokens=24, do_sample=False)
    assert torch.equal(data1.token_ids[:2], expected)
    with torch.no_grad():
        out = target(data1.token_ids[:2], output_hidden_states=True)
    torch.testing.assert_close(data1.features[:2], out.hidden_states[2])
    assert torch.equal(data1.labels[:2], out.logits.argmax(-1))
    # greedy continuations: the target's argmax after each generated token is the next token
    assert torch.equal(data1.labels[:, 5:-1], data1.token_ids[:, 6:])


@pytest.mark.parametrize("version,mixed_precision", [(1, "no"), (3, "no"), (3, "bf16")])
def test_training_reduces_loss_and_raises_acceptance(tmp_path, target, data1, version, mixed_precision):
    data = data1 if version == 1 else build_training_set(target, prompts(32, 1), default_layers(target, 3),
                                                         max_new_tokens=24)
    draft_vocab = 64 if version == 3 else None  # an EAGLE-1/2 head drafts over the target's vocabulary
    kwargs = dict(version=version, batch_size=16, lr=1e-2, draft_vocab_size=draft_vocab, progress=False,
                  mixed_precision=mixed_precision)
    config, draft_to_target = head_config_for(target, data, version, draft_vocab_size=draft_vocab)
    untrained = acceptance(target, EagleSpeculator.from_pretrained(
        save_head(new_head(target, config, draft_to_target), tmp_path / "untrained")))
    result = train_eagle_head(target, data, tmp_path / "trained", steps=60, **kwargs)
    trained = acceptance(target, EagleSpeculator.from_pretrained(result.path))
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    print(f"EAGLE-{version}: loss {first:.3f} -> {last:.3f}, acceptance untrained {untrained:.3f} -> {trained:.3f}")
    assert len(result.losses) == 60 and last < 0.9 * first
    assert trained >= 0.1 and trained > 5 * untrained


def test_soft_labels_are_the_targets_distribution_and_top_1_equals_the_argmax_loss(target):
    """`teacher_top_k` gives the target's own next-token probabilities (descending, argmax first, zero past each
    length); the soft-label loss with k = 1 is the argmax loss, and with k > 1 it differs."""
    data = build_training_set(target, ragged_prompts(6, 7), default_layers(target, 3), max_new_tokens=6)
    ids, probs = te.teacher_top_k(target, data.token_ids, data.lengths, 4, max_logits=3 * VOCAB * 20)
    for row, n in enumerate(data.lengths.tolist()):
        expected = torch.softmax(target(data.token_ids[row:row + 1, :n]).logits[0].float(), -1).topk(4)
        assert torch.equal(ids[row, :n].long(), expected.indices)
        torch.testing.assert_close(probs[row, :n].float(), expected.values, atol=1e-3, rtol=1e-3)
        assert ids[row, :n, 0].tolist() == data.labels[row, :n].tolist()
        assert not ids[row, n:].any() and not probs[row, n:].any()
    config, draft_to_target = head_config_for(target, data, 3, draft_vocab_size=64)
    head = new_head(target, config, draft_to_target)
    head.bind(target)
    head.layer.self_attn.config._attn_implementation = "sdpa"
    t2d = torch.full((VOCAB,), -100, dtype=torch.long)
    t2d[draft_to_target] = torch.arange(64)
    args = (data.token_ids, data.lengths, data.features.float(), data.labels, 2, t2d)
    hard = te.eagle_loss(head, *args)
    top1 = te.eagle_loss(head, *args, ids[..., :1], probs[..., :1])
    top4 = te.eagle_loss(head, *args, ids, probs)
    torch.testing.assert_close(top1, hard)
    assert not torch.allclose(top4, hard)
    with pytest.raises(ValueError, match="top-k must be between 1"):
        te.teacher_top_k(target, data.token_ids, data.lengths, 0)


def test_soft_label_training_lowers_the_loss_and_raises_acceptance(tmp_path, target):
    data = te.add_soft_labels(target, build_training_set(target, prompts(32, 1), default_layers(target, 3),
                                                         max_new_tokens=24), 8)
    config, draft_to_target = head_config_for(target, data, 3, draft_vocab_size=64)
    untrained = acceptance(target, EagleSpeculator.from_pretrained(
        save_head(new_head(target, config, draft_to_target), tmp_path / "untrained")))
    result = train_eagle_head(target, data, tmp_path / "trained", steps=60, batch_size=16, lr=1e-2,
                              draft_vocab_size=64, progress=False)
    trained = acceptance(target, EagleSpeculator.from_pretrained(result.path))
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    print(f"soft labels: loss {first:.3f} -> {last:.3f}, acceptance untrained {untrained:.3f} -> {trained:.3f}")
    assert last < 0.9 * first and trained > 5 * untrained  # a random target's distribution is nearly flat
    data.soft_ids, data.soft_probs = None, None
    with pytest.raises(ValueError, match="soft labels top-8.*top-0"):
        train_eagle_head(target, data, tmp_path / "trained", steps=61, batch_size=16, draft_vocab_size=64,
                         progress=False)


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_resumed_run_equals_an_uninterrupted_one(tmp_path, target, data1, monkeypatch, failure):
    """Interrupted (Ctrl-C: checkpoint at the last completed step) or killed (the last periodic checkpoint, step 4)
    during step 7, then resumed to step 10: the same losses and the same weights as a run straight to step 10."""
    kwargs = dict(version=1, steps=10, batch_size=8, lr=1e-2, num_unroll=2, save_every=4, progress=False)
    straight = train_eagle_head(target, data1, tmp_path / "straight", **kwargs)
    loss, calls = te.eagle_loss, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 7:
            raise failure("stopped")
        return loss(*args, **kw)

    monkeypatch.setattr(te.loop, "eagle_loss", failing)
    with pytest.raises(failure):
        train_eagle_head(target, data1, tmp_path / "resumed", **kwargs)
    saved = torch.load(tmp_path / "resumed" / te.CHECKPOINT_NAME, weights_only=True)["step"]
    assert saved == (6 if failure is KeyboardInterrupt else 4)
    monkeypatch.setattr(te.loop, "eagle_loss", loss)
    resumed = train_eagle_head(target, data1, tmp_path / "resumed", **kwargs)
    assert resumed.losses == straight.losses
    a = EagleSpeculator.from_pretrained(straight.path).head.state_dict()
    b = EagleSpeculator.from_pretrained(resumed.path).head.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture(scope="module")
def data3(target) -> TrainingSet:
    return build_training_set(target, prompts(32, 1), default_layers(target, 3), max_new_tokens=24)


def test_fine_tuning_starts_from_the_given_head_and_keeps_its_draft_vocabulary(tmp_path, target, data3,
                                                                               monkeypatch):
    """`init_from`: a head trained for 40 steps and shipped in 8 bits, fine-tuned further on the same data, starts at
    the loss it had reached, not at a new head's; fine-tuned on other data it keeps its draft vocabulary although a
    new head there would draft other tokens, and it stays lossless."""
    kwargs = dict(version=3, batch_size=16, lr=1e-2, progress=False)
    first = train_eagle_head(target, data3, tmp_path / "first", steps=40, weight_bits=8, draft_vocab_size=64,
                             **kwargs)
    fresh = train_eagle_head(target, data3, tmp_path / "fresh", steps=5, draft_vocab_size=64, **kwargs)
    more = train_eagle_head(target, data3, tmp_path / "more", steps=5, init_from=first.path, **kwargs)
    print(f"first run: {first.losses[0]:.3f} -> {first.losses[-1]:.3f}; fine-tune starts at {more.losses[0]:.3f}, "
          f"a new head at {fresh.losses[0]:.3f}")
    assert more.losses[0] < 0.5 * fresh.losses[0] and max(more.losses) < 0.5 * min(fresh.losses)

    other = build_training_set(target, prompts(32, 7), default_layers(target, 3), max_new_tokens=24)
    _, other_vocab = head_config_for(target, other, 3, draft_vocab_size=64)
    shipped = EagleSpeculator.from_pretrained(first.path).head
    assert not torch.equal(other_vocab, shipped.draft_to_target)
    monkeypatch.setattr(target.config, "_name_or_path", "fine-tuned-target")
    tuned = train_eagle_head(target, other, tmp_path / "tuned", steps=20, init_from=first.path, **kwargs)
    spec = EagleSpeculator.from_pretrained(tuned.path)
    assert torch.equal(spec.head.draft_to_target, shipped.draft_to_target)
    assert spec.config["target"]["name_or_path"] == "fine-tuned-target"  # names the target it was tuned for
    acceptance(target, spec)  # asserts the output is the target's own


def test_an_interrupted_fine_tune_resumes_from_its_checkpoint_not_from_the_initial_head(tmp_path, target, data3,
                                                                                       monkeypatch):
    kwargs = dict(version=3, batch_size=16, lr=1e-2, draft_vocab_size=64, progress=False)
    first = train_eagle_head(target, data3, tmp_path / "first", steps=10, **kwargs).path
    tune = dict(kwargs, draft_vocab_size=None, init_from=first, steps=10, save_every=100)
    straight = train_eagle_head(target, data3, tmp_path / "straight", **tune)
    loss, calls = te.eagle_loss, []

    def failing(*args, **kw):
        calls.append(1)
        if len(calls) == 7:
            raise KeyboardInterrupt
        return loss(*args, **kw)

    monkeypatch.setattr(te.loop, "eagle_loss", failing)
    with pytest.raises(KeyboardInterrupt):
        train_eagle_head(target, data3, tmp_path / "resumed", **tune)
    calls.clear()
    monkeypatch.setattr(te.loop, "eagle_loss", lambda *args, **kw: calls.append(1) or loss(*args, **kw))
    resumed = train_eagle_head(target, data3, tmp_path / "resumed", **tune)
    assert len(calls) == 4  # steps 6 to 9: from the checkpoint, not from the initial head
    assert resumed.losses == straight.losses
    a = EagleSpeculator.from_pretrained(straight.path).head.state_dict()
    b = EagleSpeculator.from_pretrained(resumed.path).head.state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_fine_tuning_keeps_a_converted_heads_own_embeddings(tmp_path, target, data3):
    """A head with its own token embeddings (converted from a checkpoint whose width differs from the target's)
    fine-tunes with them frozen; the rest of it trains."""
    from safetensors.torch import load_file, save_file

    v3 = train_eagle_head(target, data3, tmp_path / "v3", version=3, draft_vocab_size=64, steps=1,
                          progress=False).path
    config = json.loads((v3 / "eagle_config.json").read_text())
    config["own_embeddings"] = True
    (v3 / "eagle_config.json").write_text(json.dumps(config))
    tensors = load_file(v3 / "model.safetensors")
    tensors["embed_tokens.weight"] = torch.randn(VOCAB, config["head_config"]["hidden_size"])
    save_file(tensors, v3 / "model.safetensors")
    tuned = train_eagle_head(target, data3, tmp_path / "tuned", version=3, steps=3, lr=1e-2, init_from=v3,
                             progress=False).path
    after = load_file(tuned / "model.safetensors")
    assert torch.equal(after["embed_tokens.weight"], tensors["embed_tokens.weight"])
    assert not torch.equal(after["fc.weight"], tensors["fc.weight"])


def test_fine_tuning_refuses_a_head_that_does_not_fit(tmp_path, target, data1, data3):
    kwargs = dict(steps=1, progress=False)
    v3 = train_eagle_head(target, data3, tmp_path / "v3", version=3, draft_vocab_size=64, **kwargs).path
    v1 = train_eagle_head(target, data1, tmp_path / "v1", version=1, **kwargs).path
    with pytest.raises(ValueError, match="EAGLE-1 head, not EAGLE-3; leave --version out"):
        train_eagle_head(target, data3, tmp_path / "a", version=3, init_from=v1, **kwargs)
    with pytest.raises(ValueError, match="EAGLE-1/2 head, .*--draft-vocab applies to EAGLE-3 heads only"):
        train_eagle_head(target, data1, tmp_path / "a", draft_vocab_size=64, init_from=v1, **kwargs)
    with pytest.raises(ValueError, match="--draft-vocab .* applies to EAGLE-3 heads only"):
        train_eagle_head(target, data1, tmp_path / "a", version=1, draft_vocab_size=64, **kwargs)
    # the version defaults to the head's own
    assert EagleSpeculator.from_pretrained(train_eagle_head(target, data1, tmp_path / "v1-tuned", init_from=v1,
                                                            **kwargs).path).head.version == 1
    with pytest.raises(ValueError, match=r"reads target layers .* training set holds layers"):
        train_eagle_head(target, data1, tmp_path / "b", version=3, init_from=v3, **kwargs)
    with pytest.raises(ValueError, match="keeps its draft vocabulary"):
        train_eagle_head(target, data3, tmp_path / "c", version=3, draft_vocab_size=32, init_from=v3, **kwargs)
    with pytest.raises(ValueError, match="keeps its architecture"):
        train_eagle_head(target, data3, tmp_path / "d", version=3, intermediate_size=16, init_from=v3, **kwargs)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        train_eagle_head(make_target(num_layers=3), data3, tmp_path / "e", version=3, init_from=v3, **kwargs)
    with pytest.raises(Exception, match="eagle_config.json"):
        train_eagle_head(target, data3, tmp_path / "f", version=3, init_from=tmp_path / "missing", **kwargs)
    with pytest.raises(ValueError, match="also --out"):
        train_eagle_head(target, data3, v3, version=3, init_from=v3, **kwargs)
    with pytest.raises(ValueError, match="at least 1"):
        train_eagle_head(target, data3, tmp_path / "g", version=3, draft_vocab_size=0, **kwargs)
    with pytest.raises(ValueError, match="made for a target with num_hidden_layers=2.*fine-tune a head made for "
                       "this target"):
        train_eagle_head(make_target(num_layers=3), data3, tmp_path / "e", init_from=v3, **kwargs)
    config = json.loads((v3 / "eagle_config.json").read_text())
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes((v3 / "model.safetensors").read_bytes())
    (broken / "eagle_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "head_config"}))
    with pytest.raises(ValueError, match=r"--init-from .*broken: its eagle_config.json has no 'head_config' entry"):
        train_eagle_head(target, data3, tmp_path / "i", init_from=broken, **kwargs)
    (broken / "eagle_config.json").write_text(json.dumps(config))
    (broken / "model.safetensors").write_bytes((v3 / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"--init-from .*broken: could not read .*truncated"):
        train_eagle_head(target, data3, tmp_path / "i", init_from=broken, **kwargs)
    (broken / "eagle_config.json").unlink()
    (broken / "head_config.json").write_text("{}")
    with pytest.raises(ValueError, match="MLP speculator or Medusa head .* EAGLE heads only"):
        train_eagle_head(target, data3, tmp_path / "i", init_from=broken, **kwargs)
    # the head's own size, or any larger than the target's vocabulary, is its draft vocabulary: accepted
    same = train_eagle_head(target, data3, tmp_path / "h", version=3, draft_vocab_size=64, init_from=v3, **kwargs)
    assert EagleSpeculator.from_pretrained(same.path).config["draft_vocab_size"] == 64


def ragged_prompts(num: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (int(w),), generator=g).tolist() for w in torch.randint(2, 9, (num,), generator=g)]


def by_prompt(data: TrainingSet) -> dict[int, tuple]:
    """Each sequence by the prompt it continues: tokens, features and labels without padding."""
    return {int(i): (data.token_ids[s, :n].tolist(), data.features[s, :n], data.labels[s, :n].tolist())
            for s, (i, n) in enumerate(zip(data.prompt_index, data.lengths))}


def assert_same_sequences(a: TrainingSet, b: TrainingSet) -> None:
    a, b = by_prompt(a), by_prompt(b)
    assert a.keys() == b.keys()
    for i in a:
        assert a[i][0] == b[i][0] and a[i][2] == b[i][2]
        torch.testing.assert_close(a[i][1], b[i][1])


def test_training_set_built_in_parts_resumes_extends_and_checks_its_recipe(tmp_path, target, monkeypatch):
    """Parts of 3 prompts: an interrupted build resumes at its first unfinished part, a larger prompt list adds
    only its new prompts, a shorter one takes the stored subset; the result holds the same sequences as one build
    of all prompts. Other settings or other prompts are refused."""
    ids, layers = ragged_prompts(10, 3), default_layers(target, 3)
    recipe, kwargs = {"max_new_tokens": 5}, dict(max_new_tokens=5, batch_size=4)
    whole = build_training_set(target, ids, layers, **kwargs)
    assert sorted(whole.prompt_index.tolist()) == list(range(10))
    assert [len(ids[i]) for i in whole.prompt_index] == sorted(len(p) for p in ids)  # built shortest first
    built, build = [], te.build_training_set

    def counting(target, prompt_ids, *args, **kw):
        built.append(len(prompt_ids))
        if len(built) == 2:
            raise KeyboardInterrupt
        return build(target, prompt_ids, *args, **kw)

    monkeypatch.setattr(te.data, "build_training_set", counting)
    with pytest.raises(KeyboardInterrupt):
        te.build_in_parts(target, ids[:7], layers, tmp_path, recipe, part_size=3, **kwargs)
    first = te.build_in_parts(target, ids[:7], layers, tmp_path, recipe, part_size=3, **kwargs)
    assert built == [3, 3, 3, 1]  # the first part was kept
    assert sorted(first.prompt_index.tolist()) == list(range(7))
    extended = te.build_in_parts(target, ids, layers, tmp_path, recipe, part_size=3, **kwargs)
    assert built == [3, 3, 3, 1, 3]
    assert_same_sequences(extended, whole)
    subset = te.build_in_parts(target, ids[:5], layers, tmp_path, recipe, part_size=3, **kwargs)
    assert built[-1] == 3 and sorted(subset.prompt_index.tolist()) == list(range(5))
    assert int(subset.lengths.max()) == subset.token_ids.shape[1]
    with pytest.raises(ValueError, match=r"other settings \(max_new_tokens: \[5\] there, \[6\] now\).*--rebuild-data"):
        te.build_in_parts(target, ids, layers, tmp_path, {"max_new_tokens": 6}, part_size=3, **kwargs)
    with pytest.raises(ValueError, match="other prompts \\(prompt 4 differs\\)"):
        te.build_in_parts(target, ids[:4] + ids[5:], layers, tmp_path, recipe, part_size=3, **kwargs)
    (tmp_path / "part-00001.pt").unlink()
    with pytest.raises(ValueError, match=r"lacks \['part-00001.pt'\].*--rebuild-data"):
        te.build_in_parts(target, ids, layers, tmp_path, recipe, part_size=3, **kwargs)
    with pytest.raises(ValueError, match="--data-part-size"):
        te.build_in_parts(target, ids, layers, tmp_path, recipe, part_size=0, **kwargs)


def test_data_order_is_seeded_and_covers_every_sequence():
    batch_indices = te.loop._batch_indices
    epoch = torch.cat([batch_indices(20, 5, seed=3, step=s) for s in range(4)])
    assert sorted(epoch.tolist()) == list(range(20))
    assert torch.equal(batch_indices(20, 5, 3, 2), batch_indices(20, 5, 3, 2))
    assert not torch.equal(batch_indices(20, 5, 3, 4), batch_indices(20, 5, 3, 0))  # a new epoch, reshuffled


def test_a_checkpoint_from_another_training_set_or_start_head_is_refused(tmp_path, target, data3):
    """Resuming needs the checkpoint's own training set (its batches and draft vocabulary come from it) and its
    own start head, even where the head's config would match."""
    kwargs = dict(batch_size=16, draft_vocab_size=64, progress=False)
    a = train_eagle_head(target, data3, tmp_path / "a", steps=2, **kwargs).path
    b = train_eagle_head(target, data3, tmp_path / "b", steps=3, **kwargs).path
    other = build_training_set(target, prompts(24, 7), default_layers(target, 3), max_new_tokens=24)
    with pytest.raises(ValueError, match=r"another training set \(32 sequences, 960 tokens; this one has 24 and "
                       r"720\); .*--no-resume"):
        train_eagle_head(target, other, a, steps=4, **kwargs)
    tune = dict(kwargs, draft_vocab_size=None, steps=4, save_every=1)
    train_eagle_head(target, data3, tmp_path / "tuned", init_from=a, **dict(tune, steps=1))
    with pytest.raises(ValueError, match="started from another --init-from head, not from this --init-from head"):
        train_eagle_head(target, data3, tmp_path / "tuned", init_from=b, **tune)
    with pytest.raises(ValueError, match="started from another --init-from head, not from a new head"):
        train_eagle_head(target, data3, tmp_path / "tuned", **dict(kwargs, steps=4))
    with pytest.raises(ValueError, match="started from a new head, not from this --init-from head"):
        train_eagle_head(target, data3, b, init_from=a, **tune)
    assert train_eagle_head(target, data3, tmp_path / "tuned", init_from=a, **tune).losses.__len__() == 4


def test_bad_input_is_explained(tmp_path, target, data1):
    with pytest.raises(ValueError, match="EAGLE-1/2 head reads the final hidden state"):
        train_eagle_head(target, TrainingSet(**{**vars(data1), "layers": [1]}), tmp_path / "a", version=1, steps=1)
    with pytest.raises(ValueError, match="version must be 1"):
        train_eagle_head(target, data1, tmp_path / "a", version=2, steps=1)
    with pytest.raises(ValueError, match="mixed_precision must be 'no' or 'bf16'"):
        train_eagle_head(target, data1, tmp_path / "a", version=1, steps=1, mixed_precision="fp8")
    train_eagle_head(target, data1, tmp_path / "b", version=1, steps=2, progress=False)
    with pytest.raises(ValueError, match="another head or training set.*--no-resume"):
        train_eagle_head(target, data1, tmp_path / "b", version=1, steps=2, intermediate_size=16, progress=False)
    with pytest.raises(ValueError, match="no empty prompt"):
        build_training_set(target, [[5, 6], []], [2])
    with pytest.raises(ValueError, match="no such file"):
        te.read_prompts(tmp_path / "missing.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match='"prompt" field'):
        te.read_prompts(tmp_path / "bad.jsonl")


def test_cli_trains_resumes_and_writes_a_loadable_head(tmp_path, capsys):
    from hf_specdec.cli import main

    target = make_target()
    target.save_pretrained(tmp_path / "target")
    make_tokenizer().save_pretrained(tmp_path / "target")
    (tmp_path / "prompts.txt").write_text("\n".join(" ".join(f"w{i}" for i in p) for p in prompts(8, 5)) + "\n")
    args = ["train-eagle", "--target", str(tmp_path / "target"), "--out", str(tmp_path / "head"), "--data",
            str(tmp_path / "prompts.txt"), "--steps", "4", "--batch-size", "4", "--max-new-tokens", "8",
            "--draft-vocab", "50", "--save-every", "2"]
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    assert main([*args, "--steps", "6"]) == 0  # more steps: reuses the training set, resumes from step 4
    out = capsys.readouterr().out
    assert "reusing the training set" in out and "over 6 steps" in out
    assert main([*args, "--no-resume"]) == 0  # trains from scratch on the stored set
    out = capsys.readouterr().out
    assert "reusing the training set" in out and "over 4 steps" in out
    assert main([*args, "--rebuild-data", "--no-resume"]) == 0
    assert "generating 16 training sequences" in capsys.readouterr().out
    spec = EagleSpeculator.from_pretrained(tmp_path / "head")
    assert spec.head.version == 3 and spec.config["draft_vocab_size"] == 50
    # A finished run given --soft-labels: refused (its checkpoint learnt argmax only); with --weight-bits 4 on the
    # same run: no step is trained, the head is re-written packed, and it drafts as before.
    with pytest.raises(SystemExit, match="soft labels top-0.*top-4"):
        main([*args, "--soft-labels", "4"])
    assert main([*args, "--weight-bits", "4"]) == 0
    packed = EagleSpeculator.from_pretrained(tmp_path / "head")
    assert packed.config["weight_storage"]["bits"] == 4 and "over 4 steps" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--soft-labels -1"):
        main([*args, "--soft-labels", "-1"])
    input_ids = torch.tensor(prompts(2, 7))
    out = target.generate(input_ids=input_ids, max_new_tokens=10, speculator=spec, num_speculative_tokens=2)
    assert torch.equal(out, target.generate(input_ids=input_ids, max_new_tokens=10, do_sample=False))
    with pytest.raises(SystemExit, match="choose 1 to"):
        main(["train-eagle", "--target", str(tmp_path / "target"), "--out", str(tmp_path / "x"),
              "--self-distill", "99999"])
    # --init-from: fine-tunes the packed head in a new directory (its draft vocabulary kept, --draft-vocab left out)
    tune = [a for a in args if a not in ("--draft-vocab", "50")]
    tune[tune.index("--out") + 1] = str(tmp_path / "tuned")
    assert main([*tune, "--init-from", str(tmp_path / "head")]) == 0
    assert "over 4 steps" in capsys.readouterr().out
    assert EagleSpeculator.from_pretrained(tmp_path / "tuned").config["draft_vocab_size"] == 50
    with pytest.raises(SystemExit, match="keeps its draft vocabulary"):
        main([*tune, "--init-from", str(tmp_path / "head"), "--draft-vocab", "40", "--no-resume"])
    # refused before any training data is built: a head for another target, another version, the output itself,
    # and 'eagle' where no head ships for the target
    other = make_target(num_layers=3)
    other.save_pretrained(tmp_path / "other")
    make_tokenizer().save_pretrained(tmp_path / "other")
    fresh = [a for a in tune]
    fresh[fresh.index("--out") + 1] = str(tmp_path / "fresh")
    fresh[fresh.index("--target") + 1] = str(tmp_path / "other")
    with pytest.raises(SystemExit, match=r"--init-from .*head: .*num_hidden_layers"):
        main([*fresh, "--init-from", str(tmp_path / "head")])
    with pytest.raises(SystemExit, match="EAGLE-3 head, not EAGLE-1; leave --version out"):
        main([*tune, "--init-from", str(tmp_path / "head"), "--version", "1"])
    with pytest.raises(SystemExit, match="also --out"):
        main([*tune, "--init-from", str(tmp_path / "tuned")])
    with pytest.raises(SystemExit, match="keeps its draft vocabulary"):
        main([*fresh, "--target", str(tmp_path / "target"), "--init-from", str(tmp_path / "head"), "--draft-vocab",
              "40"])
    with pytest.raises(SystemExit, match="--draft-vocab .* applies to EAGLE-3 heads only"):
        main([*fresh, "--version", "1", "--draft-vocab", "40"])
    with pytest.raises(SystemExit, match="--init-from eagle: no trained EAGLE head ships"):
        main([*fresh, "--init-from", "eagle"])
    assert "generating" not in capsys.readouterr().out and not (tmp_path / "fresh").exists()


def test_built_in_prompt_set_is_large_varied_and_leaves_the_benchmark_out():
    from hf_specdec.train_eagle.prompts import HAND_WRITTEN, built_in_prompts, max_prompts
    from hf_specdec.workloads import GROUNDED, OPEN_CHAT

    assert built_in_prompts() == HAND_WRITTEN
    prompts = built_in_prompts(max_prompts())
    assert len(prompts) == len(set(prompts)) > 5000  # no repeats
    assert prompts[:len(HAND_WRITTEN)] == HAND_WRITTEN  # the hand-written ones first, then composed requests
    assert built_in_prompts(100) == prompts[:100] and built_in_prompts(100, seed=1) != built_in_prompts(100)
    benchmark = [p.lower() for p in [*GROUNDED.values(), *OPEN_CHAT.values()]]
    for word in ("lighthouse", "rainbow", "studying", "calder bay"):
        assert any(word in b for b in benchmark) and not any(word in p.lower() for p in prompts)
    with pytest.raises(ValueError, match="--data FILE"):
        built_in_prompts(max_prompts() + 1)


def test_built_in_prompt_set_grows_only_at_its_end():
    """A training set built from the first N built-in prompts stays a prefix of a larger one (`--self-distill` then
    builds only the new prompts), so the first 5872 and the first 10914, the whole set of earlier versions (the
    latter the shipped head's), never change."""
    import hashlib

    from hf_specdec.train_eagle.prompts import built_in_prompts, max_prompts

    first = built_in_prompts(5872)
    assert hashlib.sha1("\n".join(first).encode()).hexdigest() == "aaa3c94db6badfc9aff2583c1be0256b39601a90"
    assert max_prompts() > 16000 and built_in_prompts(max_prompts())[:5872] == first
    second = built_in_prompts(10914)
    assert hashlib.sha1("\n".join(second).encode()).hexdigest() == "2ebbaf806d3eafc49dacd96d18ced3d2563fe20e"
    assert built_in_prompts(max_prompts())[:10914] == second
    later = built_in_prompts(max_prompts())[5872:10914]
    assert any(p.startswith("Write a short story about a") and " who " in p for p in later)  # story prompts
    assert any(p.startswith("What are some good habits for") for p in later)  # advice requests
    third = built_in_prompts(max_prompts())[10914:]
    for start in ("Write a short email to", "What is the difference between", "How does", "Explain to a child why",
                  "Suggest five"):
        assert any(p.startswith(start) for p in third), start  # the kinds of request the third group adds


@pytest.mark.parametrize("bits", [8, 4])
def test_packed_weights_round_trip_within_half_a_step_and_keep_a_trained_heads_acceptance(tmp_path, target, bits):
    """`save_head(weight_bits=)` stores matrices as integers with a float16 scale per group: loading gives each
    weight back within half a quantization step, the file shrinks, and a trained head drafts about as well."""
    from hf_specdec.speculators.heads import EagleCheckpointError, pack_weights, unpack_weights

    data = build_training_set(target, prompts(32, 1), default_layers(target, 3), max_new_tokens=24)
    result = train_eagle_head(target, data, tmp_path / "float", steps=60, batch_size=16, lr=1e-2,
                              draft_vocab_size=64, progress=False)
    head = EagleSpeculator.from_pretrained(result.path).head
    tensors = {n: t.detach() for n, t in head.state_dict().items()}
    packed, config = pack_weights(tensors, head.config, bits, group_size=16)
    assert config["weight_storage"]["bits"] == bits and "lm_head.weight" in config["weight_storage"]["packed"]
    restored = unpack_weights(packed, config, "test")
    qmax = 2 ** (bits - 1) - 1
    for name in config["weight_storage"]["packed"]:
        w = tensors[name].float()
        step = w.reshape(w.shape[0], -1, 16).abs().amax(-1) / qmax  # the group's quantization step
        error = (restored[name] - w).abs().reshape(w.shape[0], -1, 16).amax(-1)
        assert bool((error <= step * 0.5 * 1.01 + 1e-6).all()), name
    out = save_head(head, tmp_path / f"int{bits}", weight_bits=bits)
    size = (out / "model.safetensors").stat().st_size
    assert size < (result.path / "model.safetensors").stat().st_size / (3 if bits == 8 else 5)
    float_acceptance = acceptance(target, EagleSpeculator.from_pretrained(result.path))
    packed_acceptance = acceptance(target, EagleSpeculator.from_pretrained(out))  # also checks greedy equality
    print(f"int{bits}: acceptance {packed_acceptance:.3f} against float {float_acceptance:.3f}")
    assert packed_acceptance >= float_acceptance - (0.03 if bits == 8 else 0.08)
    del packed["lm_head.weight.scales"]
    with pytest.raises(EagleCheckpointError, match="'lm_head.weight' or its scales are missing"):
        unpack_weights(packed, config, "test")
    with pytest.raises(ValueError, match="bits must be one of"):
        pack_weights(tensors, head.config, 3)


def test_the_shipped_head_loads_for_the_default_model_and_others_are_explained():
    from hf_specdec import trained_head
    from hf_specdec.models import DEFAULT_MODEL

    path = trained_head(DEFAULT_MODEL)
    spec = EagleSpeculator.from_pretrained(path)
    target = spec.config["target"]
    assert (target["hidden_size"], target["vocab_size"], target["num_hidden_layers"]) == (576, 49152, 30)
    assert spec.config["weight_storage"]["bits"] in (4, 8)
    assert (path / "model.safetensors").stat().st_size < 12_000_000  # small enough to ship in the package
    with pytest.raises(ValueError, match=r"no trained EAGLE head ships for 'gemma-3-270m'.*train-eagle"):
        trained_head("gemma-3-270m")
