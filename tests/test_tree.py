"""Draft trees: the tree attention mask, the tree walk, EAGLE-2 dynamic trees in the engine (greedy equality,
exact sampling distribution) and the errors around them."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, assert_seeded_sampling_is_reproducible, ragged_batch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_eagle import convert, make_target
from test_generate_sampling import SAMPLES, SETTINGS, exact_joint, peaky_model, tv
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from hf_specdec import EagleSpeculator, convert_eagle
from hf_specdec.kernels.paged_attention.reference import tree_attention_mask
from hf_specdec.types import PAD_ID, DraftTree
from hf_specdec.decode.verify import verify_tree


def random_tree(rows: int, n: int, seed: int, vocab: int = VOCAB, invalid: float = 0.0) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.randint(-1, i, (rows,), generator=g) if i else torch.full((rows,), -1)
                           for i in range(n)], dim=1) if n else torch.zeros(rows, 0, dtype=torch.long)
    tokens = torch.randint(0, vocab, (rows, n), generator=g)
    valid = torch.rand(rows, n, generator=g) >= invalid
    return DraftTree(tokens, parents, valid)


def spec_depths_and_ancestors(tree: DraftTree, row: int):
    parents = tree.parents[row].tolist()
    chains = []
    for i in range(len(parents)):
        chain, node = [], i
        while node >= 0:
            chain.append(node)
            node = parents[node]
        chains.append(chain)
    return [len(c) for c in chains], chains


@given(rows=st.integers(1, 3), n=st.integers(0, 9), seed=st.integers(0, 10_000))
@settings(max_examples=40, deadline=None)
def test_depths_and_ancestors_follow_parent_links(rows, n, seed):
    tree = random_tree(rows, n, seed)
    depths, ancestors = tree.depths(), tree.ancestors()
    for r in range(rows):
        spec_depths, chains = spec_depths_and_ancestors(tree, r)
        assert depths[r].tolist() == spec_depths
        for i, chain in enumerate(chains):
            assert sorted(ancestors[r, i].nonzero().flatten().tolist()) == sorted(chain)


@pytest.mark.parametrize("window", [None, 3])
def test_tree_attention_mask_sees_committed_context_and_own_ancestors(window):
    tree = random_tree(2, 6, seed=3)
    depths, ancestors = tree.depths(), tree.ancestors()
    committed = torch.tensor([5, 3])  # storage 0 .. L - 1 committed, the last one fed this step (pending)
    pending = 1
    q = pending + 6
    query_slots = torch.cat([(committed - 1)[:, None], committed[:, None] + torch.arange(6)], dim=1)
    positions = torch.cat([(committed - 1)[:, None], committed[:, None] + depths - 1], dim=1)
    region_mask = torch.cat([torch.zeros(2, pending, 6, dtype=torch.bool), ancestors], dim=1)
    num_context = int((committed + 6).max())
    mask = tree_attention_mask(query_slots, positions, num_context, committed, region_mask,
                               committed[:, None] + depths - 1, window)[:, 0]
    for r in range(2):
        length = int(committed[r])
        key_positions = list(range(length)) + [length + int(d) - 1 for d in depths[r]]
        for j in range(q):
            for c in range(num_context):
                if c < length:
                    allowed = c <= int(query_slots[r, j])
                elif c < length + 6:
                    allowed = j >= pending and bool(ancestors[r, j - pending, c - length])
                else:
                    allowed = False
                if window and allowed:
                    allowed = key_positions[c] > int(positions[r, j]) - window
                assert bool(mask[r, j, c]) == allowed, (r, j, c)


def walk_spec(picks: list[int], tree: DraftTree, row: int, max_depth: int) -> list[int]:
    """The tree walk in plain Python: follow the first valid child holding the target's pick."""
    out, node = [], -1
    for _ in range(max_depth + 1):
        pick = picks[node + 1]
        out.append(pick)
        children = [i for i in range(tree.num_nodes) if int(tree.parents[row, i]) == node
                    and bool(tree.valid[row, i]) and int(tree.token_ids[row, i]) == pick]
        if not children or len(out) > max_depth:
            break
        node = children[0]
    return out


@given(rows=st.integers(1, 4), n=st.integers(0, 12), seed=st.integers(0, 10_000), invalid=st.sampled_from([0, 0.3]))
@settings(max_examples=60, deadline=None)
def test_greedy_tree_walk_follows_the_target_argmax(rows, n, seed, invalid):
    vocab = 4  # a small vocabulary, so the argmax often matches a node
    tree = random_tree(rows, n, seed, vocab, invalid)
    logits = torch.randn(rows, n + 1, vocab, generator=torch.Generator().manual_seed(seed + 1))
    max_depth = int(tree.depths().max()) if n else 0
    result, path = verify_tree(logits, tree, do_sample=False, max_depth=max_depth)
    for r in range(rows):
        expected = walk_spec(logits[r].argmax(-1).tolist(), tree, r, max_depth)
        got = result.output_token_ids[r].tolist()
        assert got[:len(expected)] == expected and all(t == PAD_ID for t in got[len(expected):])
        assert int(result.num_accepted[r]) == len(expected) - 1
        for d in range(len(expected) - 1):  # the accepted nodes carry the emitted tokens, each a child of the last
            node = int(path[r, d])
            assert int(tree.token_ids[r, node]) == expected[d]
            assert int(tree.parents[r, node]) == (int(path[r, d - 1]) if d else -1)


def test_sampled_tree_walk_emits_the_target_distribution():
    """Root with three children (two of them carry likely tokens), one of which has two children of its own: the
    first two emitted tokens follow p_root x p_(first token's node) exactly."""
    vocab = 5
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 6, vocab, generator=g)
    logits[0, 0, 1] += 1.5  # the root likes node 0 (token 1), node 0 likes its child node 3 (token 2)
    logits[0, 1, 2] += 1.5
    tree = DraftTree(torch.tensor([[1, 3, 0, 2, 4]]), torch.tensor([[-1, -1, -1, 0, 0]]),
                     torch.ones(1, 5, dtype=torch.bool))
    n_samples = 40_000
    torch.manual_seed(1)
    result, _ = verify_tree(logits.expand(n_samples, -1, -1), DraftTree(
        tree.token_ids.expand(n_samples, -1), tree.parents.expand(n_samples, -1),
        tree.valid.expand(n_samples, -1)), do_sample=True, max_depth=2)
    probs = torch.softmax(logits[0].double(), -1)
    first = result.output_token_ids[:, 0]
    assert tv(first, probs[0]) < 0.015
    for token, entry in ((1, 1), (3, 2)):  # after an accepted node, the next token follows that node's distribution
        rows = first == token
        assert tv(result.output_token_ids[rows, 1], probs[entry]) < 0.03
    on_leaf = (first == 1) & (result.output_token_ids[:, 1] == 2)  # node 3 (token 2) is a leaf: a bonus follows
    assert tv(result.output_token_ids[on_leaf, 2], probs[4]) < 0.05


# --- the engine ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fitted_heads(fitted_eagle_heads, tmp_path_factory):
    root = tmp_path_factory.mktemp("tree-heads")
    (target1, src1), (target3, src3) = fitted_eagle_heads[1], fitted_eagle_heads[3]
    return {1: (target1, EagleSpeculator.from_pretrained(convert_eagle(src1, root / "v1", target=target1))),
            3: (target3, EagleSpeculator.from_pretrained(convert_eagle(src3, root / "v3", target=target3,
                                                                       aux_layers=[1, 2, 3])))}


def tree_generate(target, spec, input_ids, attention_mask=None, nodes=8, branching=3, k=4, max_new_tokens=24,
                  **kwargs):
    return target.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                           speculator=spec, num_speculative_tokens=k, speculative_tree_nodes=nodes,
                           speculative_tree_branching=branching, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("nodes,branching,k", [(1, 1, 1), (6, 2, 3), (12, 4, 4), (20, 3, 6)])
def test_tree_output_equals_target_greedy_on_ragged_batches(fitted_heads, version, nodes, branching, k):
    target, spec = fitted_heads[version]
    input_ids, mask = ragged_batch(rows=4, width=12, seed=version)
    expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = tree_generate(target, spec, input_ids, mask, nodes, branching, k, max_new_tokens=30)
    assert torch.equal(out.sequences, expected)
    metrics = out.speculative_metrics
    assert metrics.num_accepted_tokens > 0
    if nodes > 1:  # deeper than one level: some step accepted two or more nodes
        assert len(metrics.accepted_per_position) >= 2


@pytest.mark.parametrize("version", [1, 3])
def test_random_head_trees_stay_lossless(tmp_path, version):
    target = make_target(num_layers=2 if version == 1 else 4, seed=2)
    spec = EagleSpeculator.from_pretrained(convert(tmp_path, target, version))
    input_ids, mask = ragged_batch(rows=3, width=10, seed=7)
    expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = tree_generate(target, spec, input_ids, mask, nodes=10, branching=4, k=3, max_new_tokens=20)
    assert torch.equal(out.sequences, expected)
    assert out.speculative_metrics.num_draft_tokens > 0


def test_trees_accept_more_per_forward_than_the_chain(fitted_heads):
    """The point of a tree: the same head, the same depth, more tokens per target forward."""
    target, spec = fitted_heads[1]
    g = torch.Generator().manual_seed(99)
    input_ids = torch.randint(2, VOCAB, (4, 6), generator=g)
    chain = target.generate(input_ids=input_ids, max_new_tokens=40, speculator=spec, num_speculative_tokens=4,
                            speculative_schedule="constant", return_dict_in_generate=True)
    tree = tree_generate(target, spec, input_ids, nodes=16, branching=4, k=4, max_new_tokens=40)
    assert torch.equal(chain.sequences, tree.sequences)
    assert tree.speculative_metrics.num_steps < chain.speculative_metrics.num_steps
    assert tree.speculative_metrics.mean_acceptance_length > chain.speculative_metrics.mean_acceptance_length


def test_history_dependent_processors_see_each_nodes_own_path(fitted_heads):
    target, spec = fitted_heads[1]
    input_ids, mask = ragged_batch(rows=3, width=10, seed=4)
    for kwargs in ({"repetition_penalty": 1.8}, {"no_repeat_ngram_size": 2}):
        expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                   **kwargs)
        out = tree_generate(target, spec, input_ids, mask, nodes=12, branching=4, k=4, **kwargs)
        assert torch.equal(out.sequences, expected), kwargs
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0)])
    expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                               logits_processor=processors)
    out = tree_generate(target, spec, input_ids, mask, nodes=12, branching=4, k=4, logits_processor=processors)
    assert torch.equal(out.sequences, expected)


def test_eos_and_length_budget_inside_a_tree(fitted_heads):
    target, spec = fitted_heads[1]
    input_ids, mask = ragged_batch(rows=3, width=10, seed=5)
    plain = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    eos = int(plain[0, -9])  # a token row 0 emits mid-way, so rows stop at different steps
    for max_new in (1, 2, 7, 16):
        expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new,
                                   do_sample=False, eos_token_id=eos)
        out = tree_generate(target, spec, input_ids, mask, nodes=12, branching=4, k=5, max_new_tokens=max_new,
                            eos_token_id=eos)
        assert torch.equal(out.sequences, expected), max_new


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_tree_sampling_matches_target_joint_distribution(tmp_path, setting):
    """The first four sampled tokens follow the target exactly. The second step verifies a two-level tree (three
    siblings under the root, children under them), so sibling order, deeper levels and the packing of an accepted
    path all take part."""
    kwargs, warpers = SETTINGS[setting]
    target = peaky_model(0, sharpness=4.0)
    spec = EagleSpeculator.from_pretrained(convert(tmp_path, target, 1))
    prompt = torch.tensor([[1, 3, 4, 3, 4, 3]])
    expected = exact_joint(target, prompt, warpers).view(8, 8)
    with torch.no_grad():  # extend the exact joint one token at a time: p(t3 | t1 t2), then p(t4 | t1 t2 t3)
        for length in (2, 3):
            prefixes = torch.cartesian_prod(*[torch.arange(8)] * length)
            ids = torch.cat([prompt.expand(len(prefixes), -1), prefixes], dim=1)
            step = torch.softmax(warpers(ids, target(ids).logits[:, -1].float()), -1).double()
            expected = expected[..., None] * step.view(*[8] * length, 8)
    torch.manual_seed(0)
    out = target.generate(prompt.expand(SAMPLES, -1), max_new_tokens=4, do_sample=True, speculator=spec,
                          num_speculative_tokens=3, speculative_tree_nodes=6, speculative_tree_branching=3,
                          return_dict_in_generate=True, **kwargs)
    metrics = out.speculative_metrics
    assert len(metrics.accepted_per_position) >= 2  # some rows accepted a path two nodes deep
    seq = out.sequences[:, -4:]
    # Pair marginals (64 outcomes each; the 4096-outcome joint is too flat for 20k samples): expected TV noise about
    # 0.02 at worst, as in test_generate_sampling.
    for a, b in ((0, 1), (1, 2), (2, 3), (1, 3), (0, 3)):
        others = tuple(d for d in range(4) if d not in (a, b))
        assert tv(seq[:, a] * 8 + seq[:, b], expected.sum(others).flatten()) < 0.045, (a, b)


def test_tree_sampling_is_seeded_deterministic(fitted_heads):
    target, spec = fitted_heads[1]
    input_ids, mask = ragged_batch(rows=3, width=10, seed=6)
    assert_seeded_sampling_is_reproducible(lambda **kwargs: tree_generate(target, spec, input_ids, mask, **kwargs))


def test_tree_options_are_checked(fitted_heads):
    target, spec = fitted_heads[1]
    input_ids = torch.tensor([[2, 3, 4]])
    with pytest.raises(ValueError, match="drafts chains only"):
        target.generate(input_ids, max_new_tokens=4, speculator="ngram", speculative_tree_nodes=4)
    with pytest.raises(ValueError, match="fixed shape"):
        target.generate(input_ids, max_new_tokens=4, speculator=spec, speculative_tree_nodes=4,
                        speculative_schedule="adaptive")
    with pytest.raises(ValueError, match="speculative_tree_nodes must be an int"):
        target.generate(input_ids, max_new_tokens=4, speculator=spec, speculative_tree_nodes=0)
    with pytest.raises(ValueError, match="more children than the tree's speculative_tree_nodes=3"):
        target.generate(input_ids, max_new_tokens=4, speculator=spec, speculative_tree_nodes=3,
                        speculative_tree_branching=5)
    with pytest.raises(ValueError, match="only applies together with speculative_tree_nodes"):
        target.generate(input_ids, max_new_tokens=4, speculator=spec, speculative_tree_branching=2)
    with pytest.raises(ValueError, match="only applies together with speculator"):
        target.generate(input_ids, max_new_tokens=4, speculative_tree_nodes=4)


def test_pipeline_passes_tree_options(fitted_heads):
    from conftest import make_tokenizer, word_prompt
    from transformers import pipeline

    target, spec = fitted_heads[1]
    tokenizer = make_tokenizer()
    stock = pipeline("text-generation", model=target, tokenizer=tokenizer)
    ours = pipeline("speculative-text-generation", model=target, tokenizer=tokenizer, assistant=spec)
    greedy = dict(max_new_tokens=12, do_sample=False)
    for seed, length in ((1, 9), (2, 5)):
        prompt = word_prompt(seed, length)
        assert ours(prompt, num_speculative_tokens=3, speculative_tree_nodes=6, speculative_tree_branching=2,
                    **greedy) == stock(prompt, **greedy)
    with pytest.raises(ValueError, match="fixed shape"):
        ours(word_prompt(1, 9), speculative_tree_nodes=6, speculative_schedule="adaptive", **greedy)


def test_nan_logits_in_a_tree_step_are_refused(fitted_heads):
    """The NaN appears in the second forward, the first that verifies a tree (the first has no states to draft from)."""
    target, spec = fitted_heads[1]
    calls = []

    def poison(module, args, output):
        calls.append(1)
        return output.masked_fill(torch.ones_like(output, dtype=torch.bool), float("nan")) if len(calls) > 1 else output

    handle = target.model.layers[0].mlp.register_forward_hook(poison)
    try:
        with pytest.raises(FloatingPointError, match="the target model produced NaN or inf logits for batch rows"):
            tree_generate(target, spec, torch.tensor([[2, 3, 4, 5]]), nodes=4, branching=2, k=2)
    finally:
        handle.remove()
    assert len(calls) == 2


def test_sliding_window_target(tmp_path):
    """A Mistral target whose window (8) is shorter than the sequence: tree nodes attend by position, not storage."""
    from conftest import COMMON
    from test_eagle import fit_reference
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(3)
    target = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=8)).double().eval()
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    spec = EagleSpeculator.from_pretrained(convert_eagle(fit_reference(tmp_path / "src", target, 1, [2], steps=100),
                                                         tmp_path / "ours", target=target))
    input_ids, mask = ragged_batch(rows=3, width=12, seed=8)
    expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = tree_generate(target, spec, input_ids, mask, nodes=12, branching=4, k=4, max_new_tokens=30)
    assert torch.equal(out.sequences, expected)
    assert len(out.speculative_metrics.accepted_per_position) >= 2


def test_cli_runs_trees_and_explains_bad_shapes(fitted_eagle_heads, tmp_path, capsys):
    from conftest import saved_target_and_head

    from hf_specdec.cli import main
    from hf_specdec.tools.speculator_args import tree_shapes

    assert tree_shapes("16x4, 6x2") == ((16, 4), (6, 2)) and tree_shapes("") == ()
    for bad in ("16", "16x", "0x4", "4x2x1"):
        with pytest.raises(SystemExit, match="NODESxBRANCHING"):
            tree_shapes(bad)
    model_dir, head_dir = saved_target_and_head(fitted_eagle_heads[1], tmp_path)
    args = ["run", "--model", str(model_dir), "--max-new-tokens", "12", "--repeats", "1", "-k", "3",
            "--prompt", "one two three"]
    assert main([*args, "--speculator", str(head_dir), "--tree", "6x2"]) == 0
    out = capsys.readouterr().out
    assert "tree 6x2" in out and "output identical to plain greedy generate: True" in out
    with pytest.raises(SystemExit, match="drafts chains only"):
        main([*args, "--speculator", "ngram", "--tree", "6x2"])
