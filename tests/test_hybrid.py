"""HybridSpeculator: the n-gram lookup where a row repeats earlier text, an EAGLE head elsewhere. Both proposers are
exercised in the same calls, and the output stays the target's own: greedy-equal, and exact in distribution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB
from test_eagle import convert, make_target

from hf_specdec import EagleSpeculator, HybridSpeculator, NgramSpeculator, StepCost, convert_eagle


def recorded(spec: HybridSpeculator, drafts: list | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Wraps `spec.propose` to keep each step's (num_tokens, confidence class), and in `drafts` the proposals."""
    calls, propose = [], spec.propose

    def wrapper(batch, k):
        draft = propose(batch, k)
        if draft.confidence is not None:
            calls.append((draft.num_tokens.clone(), draft.confidence.clone()))
            if drafts is not None:
                drafts.append(draft)
        return draft

    spec.propose = wrapper
    return calls


def proposers_used(spec: HybridSpeculator, calls) -> tuple[int, int, int]:
    """(row-steps the lookup drafted, row-steps the head drafted, steps in which both drafted for some row)."""
    lookup = [(n > 0) & (c < spec.head_class) for n, c in calls]
    head = [(n > 0) & (c == spec.head_class) for n, c in calls]
    return (sum(int(x.sum()) for x in lookup), sum(int(x.sum()) for x in head),
            sum(bool(a.any() and b.any()) for a, b in zip(lookup, head)))


def repeating_and_random_prompts() -> torch.Tensor:
    """Row 0 repeats a passage (the lookup matches it), rows 1-2 are random (the head drafts)."""
    g = torch.Generator().manual_seed(3)
    passage = torch.randint(2, VOCAB, (6,), generator=g)
    rows = [torch.cat([passage, passage, passage[:3]]), torch.randint(2, VOCAB, (15,), generator=g),
            torch.randint(2, VOCAB, (15,), generator=g)]
    return torch.stack(rows)


@pytest.mark.parametrize("schedule", ["constant", "adaptive"])
def test_greedy_output_is_the_targets_and_both_proposers_draft(tmp_path, schedule):
    target = make_target(num_layers=4)
    spec = HybridSpeculator(EagleSpeculator.from_pretrained(convert(tmp_path, target, 3)))
    calls = recorded(spec)
    input_ids = repeating_and_random_prompts()
    # adaptive: on a host where a verify costs what a plain step does (the static CPU default prices it dearly)
    cost = dict(speculative_step_cost=StepCost(per_row=0.0, points=((1, 10.0), (256, 10.0)))) \
        if schedule == "adaptive" else {}
    out = target.generate(input_ids=input_ids, max_new_tokens=24, speculator=spec, num_speculative_tokens=4,
                          speculative_schedule=schedule, return_dict_in_generate=True, **cost)
    expected = target.generate(input_ids=input_ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(out.sequences, expected)
    lookup, head, mixed = proposers_used(spec, calls)
    assert lookup > 0 and head > 0 and mixed > 0, (lookup, head, mixed)


def test_head_runs_only_when_a_row_needs_it(tmp_path):
    """A batch whose every row copies never calls the head's drafting forward."""
    target = make_target(num_layers=4)
    head = EagleSpeculator.from_pretrained(convert(tmp_path, target, 3))
    spec = HybridSpeculator(head)
    asked, propose = [], head.propose
    head.propose = lambda batch, k: asked.append(k) or propose(batch, k)
    passage = torch.randint(2, VOCAB, (6,), generator=torch.Generator().manual_seed(4))
    input_ids = torch.cat([passage, passage, passage[:3]])[None]
    out = target.generate(input_ids=input_ids, max_new_tokens=3, speculator=spec, num_speculative_tokens=2,
                          speculative_schedule="constant", return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(input_ids=input_ids, max_new_tokens=3, do_sample=False))
    assert asked and asked[0] == 0  # the first step copies: the head was told to draft nothing


def test_sampling_keeps_the_target_distribution(fitted_eagle_heads):
    """Tokens 2 and 3 of sampled continuations follow the target's exact marginals while lookup drafts (point masses)
    and head drafts (a fitted head's distribution) are verified side by side."""
    target, src = fitted_eagle_heads[3]
    # min_match=1: any row whose last token occurred before copies, so every step mixes both kinds of draft.
    spec = HybridSpeculator(EagleSpeculator.from_pretrained(convert_eagle(src, src.parent / "hybrid", target=target)),
                            min_match=1)
    drafts = []
    calls = recorded(spec, drafts)
    g = torch.Generator().manual_seed(5)
    passage = torch.randint(2, VOCAB, (3,), generator=g)
    prompt = torch.cat([passage, torch.randint(2, VOCAB, (1,), generator=g), passage])[None]  # 7 tokens
    num_samples, temperature = 20000, 0.7
    torch.manual_seed(0)
    out = target.generate(input_ids=prompt.expand(num_samples, -1), max_new_tokens=3, speculator=spec,
                          num_speculative_tokens=2, speculative_schedule="constant", do_sample=True,
                          temperature=temperature, top_k=0, return_dict_in_generate=True)
    lookup, head, mixed = proposers_used(spec, calls)
    assert lookup > 0 and head > 0 and mixed > 0, (lookup, head, mixed)
    for draft in drafts:  # verified against: a point mass for each lookup draft, the head's own distribution else
        if draft.probs is None:
            continue
        copying = (draft.confidence < spec.head_class)[:, None]
        used = torch.arange(draft.k)[None, :] < draft.num_tokens[:, None]
        point = F.one_hot(draft.token_ids.clamp(min=0), VOCAB).to(draft.probs.dtype)
        assert torch.equal(draft.probs[copying & used], point[copying & used])
        head_rows = ~copying & used
        assert torch.allclose(draft.probs[head_rows].sum(-1), torch.ones(int(head_rows.sum()), dtype=draft.probs.dtype))
        assert not torch.equal(draft.probs[head_rows], point[head_rows])
    metrics = out.speculative_metrics
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens
    n = prompt.shape[1]
    with torch.no_grad():  # exact marginals of the 2nd and 3rd new tokens
        p1 = torch.softmax(target(prompt).logits[0, -1] / temperature, -1)
        one = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
        p2 = torch.softmax(target(one).logits[:, -1] / temperature, -1)  # [t1, t2]
        two = torch.cat([one.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(VOCAB)[:, None]], dim=1)
        p3 = torch.softmax(target(two).logits[:, -1] / temperature, -1).view(VOCAB, VOCAB, VOCAB)
        exact2 = p1 @ p2
        exact3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    g = torch.Generator().manual_seed(1)
    for column, exact in ((n + 1, exact2), (n + 2, exact3)):
        empirical = torch.bincount(out.sequences[:, column], minlength=VOCAB).double() / num_samples
        tv = 0.5 * (empirical - exact).abs().sum().item()
        noise = max(0.5 * (torch.bincount(torch.multinomial(exact, num_samples, True, generator=g),
                                          minlength=VOCAB).double() / num_samples - exact).abs().sum().item()
                    for _ in range(5))
        print(f"token {column - n + 1}: total variation {tv:.4f}, largest of 5 exact-sample draws {noise:.4f}")
        assert tv < 1.5 * noise


def test_bad_arguments_are_explained(tmp_path):
    target = make_target(num_layers=4)
    head = EagleSpeculator.from_pretrained(convert(tmp_path, target, 3))
    with pytest.raises(TypeError, match="EagleSpeculator"):
        HybridSpeculator(NgramSpeculator())
    for bad in (0, 9, 40):  # the lookup reports match lengths 1-8 (longer ones fall in its top class)
        with pytest.raises(ValueError, match="min_match must lie in 1-8"):
            HybridSpeculator(head, min_match=bad)
    assert HybridSpeculator(head, min_match=8).min_match == 8
    with pytest.raises(ValueError, match="head_tokens"):
        HybridSpeculator(head, head_tokens=0)


def test_cli_combines_the_lookup_with_a_head_directory(fitted_eagle_heads, tmp_path, capsys):
    from conftest import saved_target_and_head

    from hf_specdec.cli import main

    model_dir, head_dir = saved_target_and_head(fitted_eagle_heads[3], tmp_path)
    args = ["run", "--model", str(model_dir), "--max-new-tokens", "12", "--repeats", "1", "-k", "3",
            "--prompt", "one two three one two three one two"]
    assert main([*args, "--speculator", f"ngram+{head_dir}"]) == 0
    out = capsys.readouterr().out
    assert f"speculator ngram+{head_dir}" in out and "output identical to plain greedy generate: True" in out
    with pytest.raises(SystemExit, match="after 'ngram\\+' give 'eagle' or an EAGLE head directory"):
        main([*args, "--speculator", f"ngram+{model_dir}"])  # a draft model does not combine
    with pytest.raises(SystemExit, match="no trained EAGLE head ships for"):
        main([*args, "--speculator", "ngram+eagle"])  # this model ships no head
