"""MLP speculators (ibm-fms accelerators) and Medusa heads: reference checkpoints converted and run, losslessly,
batched; the draft logits equal the reference formulas; fitted heads reach real acceptance and lose it when they
read the wrong state; bad checkpoints get clear errors.

Checkpoints are synthetic but in the exact reference layouts (real names and shapes, random values) for a tiny
Llama target: fms-extras / vLLM `mlp_speculator` (untied, tied, `scale_input`, a narrower `inner_dim`), Medusa-1
(`medusa_lm_head.pt`), Medusa-2 (`medusa_head.*` beside the base model) and vLLM's Medusa (`blocks.*`, `lm_heads.*`,
`token_map`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import COMMON, VOCAB, assert_seeded_sampling_is_reproducible, ragged_batch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_specdec import HeadCheckpointError, MedusaSpeculator, MlpSpeculator, convert_head

HIDDEN = COMMON["hidden_size"]


def make_target(num_layers: int = 2, seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": num_layers})).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# --- reference layouts -----------------------------------------------------------------------------------------------
def mlp_reference(n_predict: int = 3, inner_dim: int = 0, tie: bool = False, scale_input: bool = False,
                  seed: int = 0, prefix: str = "speculator.", store_tied_copies: bool = False):
    """fms-extras `MLPSpeculatorPreTrainedModel` layout: config.json and `speculator.{emb,proj,head,ln}.{i}.*`."""
    g = torch.Generator().manual_seed(seed)
    inner = inner_dim or HIDDEN

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    tensors = {}
    for i in range(n_predict):
        tensors[f"emb.{i}.weight"] = rand(VOCAB, inner, scale=1 / math.sqrt(inner))
        tensors[f"proj.{i}.weight"] = rand(inner, HIDDEN if i == 0 else inner, scale=1 / math.sqrt(inner))
        tensors[f"head.{i}.weight"] = rand(VOCAB, inner, scale=1 / math.sqrt(inner))
        tensors[f"ln.{i}.weight"] = 1 + rand(inner, scale=0.1)
        tensors[f"ln.{i}.bias"] = rand(inner, scale=0.1)
    if tie:  # as fms ties them: one emb, head and ln for all stages, proj 1 for every stage after the first
        for i in range(n_predict):
            for group in ("emb", "head"):
                tensors[f"{group}.{i}.weight"] = tensors[f"{group}.0.weight"]
            tensors[f"ln.{i}.weight"], tensors[f"ln.{i}.bias"] = tensors["ln.0.weight"], tensors["ln.0.bias"]
            if i >= 2:
                tensors[f"proj.{i}.weight"] = tensors["proj.1.weight"]
        if not store_tied_copies:  # what safetensors keeps of shared tensors
            tensors = {n: t for n, t in tensors.items()
                       if n.split(".")[1] == "0" or n == "proj.1.weight"}
    config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
              "vocab_size": VOCAB, "emb_dim": HIDDEN, "inner_dim": inner_dim, "n_predict": n_predict,
              "top_k_tokens_per_head": [1] * n_predict, "n_candidates": 1, "tie_weights": tie,
              "scale_input": scale_input}
    return config, {prefix + n: t.clone() for n, t in tensors.items()}


def medusa_reference(num_heads: int = 3, num_layers: int = 1, style: str = "medusa1", seed: int = 0,
                     truncated: torch.Tensor | None = None, shared_lm_head: bool = False):
    """Medusa heads in a reference layout.

    style: "medusa1" (`{i}.{j}.linear.*`, `{i}.{L}.weight`, as `medusa_lm_head.pt`), "medusa2" (the same under
    `medusa_head.`, beside base-model tensors) or "vllm" (`blocks.{i}.layers.{j}.*`, `lm_heads.{i}.weight`,
    `token_map` when `truncated` gives the draft vocabulary's target ids; one LM head, `lm_heads.0`, with
    `shared_lm_head`, as vLLM's `original_lm_head`).
    """
    g = torch.Generator().manual_seed(seed)
    draft_vocab = VOCAB if truncated is None else truncated.shape[0]
    tensors = {}
    for i in range(num_heads):
        for j in range(num_layers):
            weight = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.3
            bias = torch.randn(HIDDEN, generator=g) * 0.1
            if style == "vllm":
                tensors[f"blocks.{i}.layers.{j}.weight"], tensors[f"blocks.{i}.layers.{j}.bias"] = weight, bias
            else:
                tensors[f"{i}.{j}.linear.weight"], tensors[f"{i}.{j}.linear.bias"] = weight, bias
        lm = torch.randn(draft_vocab, HIDDEN, generator=g) * 0.5
        tensors[f"lm_heads.{i}.weight" if style == "vllm" else f"{i}.{num_layers}.weight"] = lm
    if style == "vllm":
        config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": HIDDEN,
                  "vocab_size": VOCAB, "num_heads": num_heads, "num_hidden_layers": num_layers,
                  "medusa_fc_bias": True, "truncated_vocab_size": None if truncated is None else draft_vocab}
        if truncated is not None:
            tensors["token_map"] = truncated.clone()
        if shared_lm_head:
            config["original_lm_head"] = True
            tensors = {n: t for n, t in tensors.items() if not n.startswith("lm_heads.") or n == "lm_heads.0.weight"}
        return config, tensors
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
              "base_model_name_or_path": "tiny-llama"}
    if style == "medusa2":
        tensors = {f"medusa_head.{n}": t for n, t in tensors.items()}
        tensors["model.norm.weight"], tensors["lm_head.weight"] = torch.ones(HIDDEN), torch.zeros(VOCAB, HIDDEN)
    return config, tensors


def write_reference(directory: Path, config: dict, tensors: dict, fmt: str = "safetensors") -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(directory / "model.safetensors"))
    elif fmt == "pt":
        torch.save(tensors, directory / "medusa_lm_head.pt")
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    return directory


def convert_reference(tmp_path: Path, target, config, tensors, fmt: str = "safetensors", name: str = "src") -> Path:
    src = write_reference(tmp_path / name, config, tensors, fmt)
    return convert_head(src, tmp_path / f"{name}-ours", target=target)


def speculate(target, spec, input_ids, attention_mask=None, k: int = 3, max_new_tokens: int = 20, **kwargs):
    return target.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                           speculator=spec, num_speculative_tokens=k, speculative_schedule="constant",
                           return_dict_in_generate=True, **kwargs)


def load(directory: Path):
    config = json.loads((directory / "head_config.json").read_text())
    return (MlpSpeculator if config["kind"] == "mlp_speculator" else MedusaSpeculator).from_pretrained(directory)


VARIANTS = {
    "mlp": lambda: mlp_reference(),
    "mlp-tied-scaled-narrow": lambda: mlp_reference(n_predict=4, inner_dim=24, tie=True, scale_input=True),
    "medusa1": lambda: medusa_reference(style="medusa1"),
    "medusa2-two-layers": lambda: medusa_reference(num_layers=2, style="medusa2"),
    "vllm-medusa-truncated": lambda: medusa_reference(style="vllm", truncated=torch.arange(4, VOCAB, 2)),
    "vllm-medusa-shared-lm-head": lambda: medusa_reference(style="vllm", shared_lm_head=True),
}


# --- conversion: every tensor round-trips ----------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_tensor_round_trips(tmp_path, variant):
    from safetensors.torch import load_file

    target = make_target()
    config, tensors = VARIANTS[variant]()
    fmt = "pt" if variant == "medusa1" else "bin" if variant.startswith("medusa2") else "safetensors"
    dst = convert_reference(tmp_path, target, config, tensors, fmt)
    ours = load_file(str(dst / "model.safetensors"))
    ours_config = json.loads((dst / "head_config.json").read_text())
    assert ours_config["target_hidden_states"]["layers"] == [2]  # the final (normed) state of the 2-layer target
    expected = {}
    for name, tensor in tensors.items():
        if variant.startswith("mlp"):
            expected[name.removeprefix("speculator.")] = tensor
        elif name.startswith(("model.", "lm_head.")):
            continue  # a Medusa-2 checkpoint's base model
        else:
            parts = name.removeprefix("medusa_head.").split(".")
            if name == "token_map":
                expected["draft_to_target"] = tensor
            elif parts[0] == "blocks":
                expected[f"blocks.{parts[1]}.{parts[3]}.{parts[4]}"] = tensor
            elif parts[0] == "lm_heads":
                expected["lm_head.weight" if config.get("original_lm_head") else name] = tensor
            elif parts[2] == "linear":
                expected[f"blocks.{parts[0]}.{parts[1]}.{parts[3]}"] = tensor
            else:
                expected[f"lm_heads.{parts[0]}.weight"] = tensor
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


# --- lossless, batched, ragged ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows", [1, 3])
def test_output_equals_target_greedy(tmp_path, variant, rows):
    target = make_target()
    spec = load(convert_reference(tmp_path, target, *VARIANTS[variant]()))
    input_ids, mask = ragged_batch(rows)
    out = speculate(target, spec, input_ids, mask, k=3)
    expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(out.sequences, expected)
    assert out.speculative_metrics.num_draft_tokens > 0


def test_k_beyond_the_heads_is_capped(tmp_path):
    target = make_target()
    spec = load(convert_reference(tmp_path, target, *mlp_reference(n_predict=2)))
    input_ids, mask = ragged_batch(2)
    out = speculate(target, spec, input_ids, mask, k=6, max_new_tokens=12)
    metrics = out.speculative_metrics
    assert torch.equal(out.sequences, target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=12,
                                                      do_sample=False))
    assert 0 < metrics.num_draft_tokens <= 2 * 2 * metrics.num_steps


def test_drafts_per_step_never_exceed_the_heads(tmp_path, monkeypatch):
    from hf_specdec.speculators.medusa import FinalStateSpeculator

    target = make_target()
    spec = load(convert_reference(tmp_path, target, *mlp_reference(n_predict=2)))
    widths = []
    original = FinalStateSpeculator.propose

    def recording(self, batch, k):
        proposal = original(self, batch, k)
        widths.append((k, proposal.k))
        return proposal

    monkeypatch.setattr(FinalStateSpeculator, "propose", recording)
    input_ids, mask = ragged_batch(2)
    out = speculate(target, spec, input_ids, mask, k=6, max_new_tokens=12)
    assert torch.equal(out.sequences, target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=12,
                                                      do_sample=False))
    assert out.speculative_metrics.num_draft_tokens > 0
    assert max(w for _, w in widths) == 2 and max(k for k, _ in widths) == 6


# --- exact wiring: the engine's draft logits equal the reference formulas, written out here ------------------------
def _tied(tensors: dict, name: str) -> torch.Tensor:
    """A reference tensor, falling back to the stage a tied checkpoint stores it under."""
    if name in tensors:
        return tensors[name]
    group, index, leaf = name.removeprefix("speculator.").split(".")
    return tensors[f"speculator.{group}.{1 if group == 'proj' else 0}.{leaf}"]


def mlp_reference_logits(config, tensors, state, tokens):
    """fms-extras' MLPSpeculator, one row: `state` `[emb_dim]`, `tokens[i]` the token stage i reads (one stage per
    token)."""
    t = {n: v.double() for n, v in tensors.items()}
    n, inner = config["n_predict"], config["inner_dim"] or config["emb_dim"]
    state_weight = 0.5 ** (0.5 / n)
    emb_weight = math.sqrt(1 - state_weight ** 2)
    if config["scale_input"]:
        state = state * torch.rsqrt(state.pow(2).mean() + 1e-6) / math.sqrt(2)
    out = []
    for i in range(len(tokens)):
        z = _tied(t, f"speculator.emb.{i}.weight")[tokens[i]] * (emb_weight * math.sqrt(inner / 2))
        state = _tied(t, f"speculator.proj.{i}.weight") @ state * state_weight + z
        state = state * torch.rsqrt(state.pow(2).mean() + 1e-6)
        state = state * _tied(t, f"speculator.ln.{i}.weight") + _tied(t, f"speculator.ln.{i}.bias")
        state = F.gelu(state)
        out.append(_tied(t, f"speculator.head.{i}.weight") @ state)
    return out


def medusa_reference_logits(config, tensors, state):
    """Medusa's heads, one row: head i = residual blocks x + SiLU(linear(x)), then its LM head."""
    t = {n: v.double() if v.is_floating_point() else v for n, v in tensors.items()}
    vllm = "num_heads" in config
    heads = config["num_heads"] if vllm else config["medusa_num_heads"]
    layers = config["num_hidden_layers"] if vllm else config["medusa_num_layers"]
    out = []
    for i in range(heads):
        x = state
        for j in range(layers):
            pre = f"blocks.{i}.layers.{j}." if vllm else f"{i}.{j}.linear."
            x = x + F.silu(t[pre + "weight"] @ x + t[pre + "bias"])
        lm = f"lm_heads.{0 if config.get('original_lm_head') else i}.weight" if vllm else f"{i}.{layers}.weight"
        logits = t[lm] @ x
        if "token_map" in t:
            full = torch.full((VOCAB,), float("-inf"), dtype=torch.float64)
            full[t["token_map"]] = logits
            logits = full
        out.append(logits)
    return out


@pytest.mark.parametrize("variant", ["mlp", "mlp-tied-scaled-narrow", "medusa1", "vllm-medusa-truncated",
                                     "vllm-medusa-shared-lm-head"])
def test_draft_logits_equal_the_reference_forward(tmp_path, monkeypatch, variant):
    """Stage i of a step at committed length L reads the target's final state at L - 2 and (MLP) the token at
    L - 1, then its own drafts; ragged rows, checked against a plain forward of each row alone."""
    from hf_specdec.speculators.medusa import FinalStateSpeculator

    target = make_target()
    config, tensors = VARIANTS[variant]()
    spec = load(convert_reference(tmp_path, target, config, tensors))
    head_class = type(spec.head)
    calls, stages = [], []
    original_stage, original_propose = head_class.stage, FinalStateSpeculator.propose

    def stage(self, i, carry, token):
        carry, logits = original_stage(self, i, carry, token)
        stages.append(logits.clone())
        return carry, logits

    def propose(self, batch, k):
        before = len(stages)
        proposal = original_propose(self, batch, k)
        calls.append((list(batch.active), [batch.lengths[r] for r in batch.active], proposal.token_ids.clone(),
                      stages[before:]))
        return proposal

    monkeypatch.setattr(head_class, "stage", stage)
    monkeypatch.setattr(FinalStateSpeculator, "propose", propose)
    input_ids, mask = ragged_batch(2)
    out = speculate(target, spec, input_ids, mask, k=3, max_new_tokens=12)
    rows = [torch.cat([input_ids[r][mask[r] == 1], out.sequences[r, input_ids.shape[1]:]]) for r in range(2)]
    with torch.no_grad():
        states = [target(row[None], output_hidden_states=True).hidden_states[-1][0] for row in rows]
    checked = 0
    for active, lengths, drafts, logits in calls:
        for index, (row, length) in enumerate(zip(active, lengths)):
            if not logits:
                continue
            state = states[row][length - 2]
            if variant.startswith("mlp"):
                tokens = [rows[row][length - 1], *drafts[index].tolist()][:len(logits)]
                expected = mlp_reference_logits(config, tensors, state, tokens)
            else:
                expected = medusa_reference_logits(config, tensors, state)
            for i, stage_logits in enumerate(logits):
                finite = torch.isfinite(expected[i])
                assert torch.equal(finite, torch.isfinite(stage_logits[index]))
                torch.testing.assert_close(stage_logits[index][finite], expected[i][finite], rtol=1e-6, atol=1e-6)
                checked += 1
    assert checked >= 6


# --- fitted heads: real acceptance, lost when they read the wrong state ----------------------------------------------
PROMPT_LEN = 6


def fit_reference(directory: Path, target, kind: str, steps: int = 300, num_sequences: int = 32) -> Path:
    """Fits a head to `target` and writes it in its reference layout (MLP: fms-extras; Medusa: Medusa-1 `.pt`).

    Teacher forcing on the target's own greedy continuations of random prompts: from the target's final state at
    p, stage (head) i learns the token at p + 2 + i; MLP stage i also reads the true token at p + 1 + i, as
    fms-extras trains it. Seeded, a few seconds on a CPU.
    """
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(2, VOCAB, (num_sequences, PROMPT_LEN), generator=g)
    seqs = target.generate(prompts, max_new_tokens=24, do_sample=False)
    with torch.no_grad():
        states = target(seqs, output_hidden_states=True).hidden_states[-1].float()
    config, tensors = mlp_reference() if kind == "mlp" else medusa_reference()
    head = load(convert_reference(directory, target, config, tensors, name="init")).head.float().train()
    stages = head.num_stages
    width = seqs.shape[1] - 1 - stages  # positions p whose every stage has a label
    labels = seqs.clone()
    labels[:, :PROMPT_LEN] = -100  # random prompt tokens: nothing to learn
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add contention on a busy machine
    try:
        for _ in range(steps):
            carry, loss = head.start(states[:, :width]), 0.0
            for i in range(stages):
                carry, logits = head.stage(i, carry, seqs[:, 1 + i: 1 + i + width])
                loss = loss + F.cross_entropy(logits.flatten(0, 1), labels[:, 2 + i: 2 + i + width].flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    fitted = {n: t.detach() for n, t in head.state_dict().items()}
    if kind == "mlp":
        reference = {f"speculator.{n}": t for n, t in fitted.items()}
        return write_reference(directory / "fitted", config, reference)
    reference = {}
    for name, tensor in fitted.items():
        parts = name.split(".")
        if parts[0] == "blocks":
            reference[f"{parts[1]}.{parts[2]}.linear.{parts[3]}"] = tensor
        else:
            reference[f"{parts[1]}.1.weight"] = tensor
    return write_reference(directory / "fitted", config, reference, fmt="pt")


def acceptance(target, spec, k: int = 3) -> float:
    """Acceptance rate on held-out prompts; also checks the output is the target's own."""
    g = torch.Generator().manual_seed(99)
    input_ids = torch.randint(2, VOCAB, (4, PROMPT_LEN), generator=g)
    out = speculate(target, spec, input_ids, k=k, max_new_tokens=24)
    assert torch.equal(out.sequences, target.generate(input_ids=input_ids, max_new_tokens=24, do_sample=False))
    return out.speculative_metrics.acceptance_rate


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("fitted")
    target = make_target()
    return target, {kind: fit_reference(root / kind, target, kind) for kind in ("mlp", "medusa")}


@pytest.mark.parametrize("kind", ["mlp", "medusa"])
def test_fitted_head_accepts_and_the_wrong_state_drops_it(fitted, tmp_path, kind):
    target, sources = fitted
    right_dir = convert_head(sources[kind], tmp_path / "ok", target=target)
    right = acceptance(target, load(right_dir), k=3)
    right_first = acceptance(target, load(right_dir), k=1)
    # the wrong hidden state: the input to the last layer (before the final norm) instead of the final normed state
    wrong_dir = convert_head(sources[kind], tmp_path / "layer", target=target)
    config = json.loads((wrong_dir / "head_config.json").read_text())
    config["target_hidden_states"]["layers"] = [1]
    (wrong_dir / "head_config.json").write_text(json.dumps(config))
    wrong_first = acceptance(target, load(wrong_dir), k=1)
    config, tensors = mlp_reference() if kind == "mlp" else medusa_reference()
    baseline = acceptance(target, load(convert_reference(tmp_path, target, config, tensors, name="random")), k=3)
    print(f"{kind} acceptance: fitted {right:.2f} at k = 3, random head {baseline:.2f}; first draft (k = 1) "
          f"{right_first:.2f} reading the right state, {wrong_first:.2f} the wrong one")
    # (measured: MLP 0.51, 0.00; 0.70 against 0.47. Medusa 0.17, 0.01; 0.33 against 0.00. The MLP also reads the
    # newest token, so a wrong state costs it less than it costs Medusa heads, which read nothing else.)
    assert right >= (0.35 if kind == "mlp" else 0.12)
    assert right > 3 * baseline
    assert wrong_first < right_first * (0.75 if kind == "mlp" else 0.5)


def total_variation(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """TV distance between `samples`' histogram and `probs`, and, for scale, the largest of 5 draws of the same size
    from `probs` itself."""
    def tv(draws):
        return 0.5 * (torch.bincount(draws, minlength=VOCAB).double() / draws.numel() - probs).abs().sum().item()

    g = torch.Generator().manual_seed(1)
    return tv(samples), max(tv(torch.multinomial(probs, samples.numel(), True, generator=g)) for _ in range(5))


@pytest.mark.parametrize("kind", ["mlp", "medusa"])
def test_sampling_keeps_the_target_distribution(fitted, tmp_path, monkeypatch, kind):
    """The second token (drafted by a fitted head, then accepted or recovered) follows the target's exact marginal,
    and the drafts follow the draft_probs passed to the verifier."""
    from hf_specdec.speculators.medusa import FinalStateSpeculator

    target, sources = fitted
    # The tiny target's distributions are nearly flat, so a head fitted to its argmax would be all but always
    # rejected. Scaling its LM head keeps its argmax and hidden states (the heads still fit) and peaks its
    # distributions, so that drafts are often accepted and often rejected.
    peaked = make_target()
    peaked.lm_head.weight.data *= 100
    spec = load(convert_head(sources[kind], tmp_path / "ours", target=target))
    proposals = []
    original = FinalStateSpeculator.propose

    def recording(self, batch, k):
        proposal = original(self, batch, k)
        proposals.append(proposal)
        return proposal

    monkeypatch.setattr(FinalStateSpeculator, "propose", recording)
    prompt = torch.randint(2, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(5))
    num_samples = 20000
    torch.manual_seed(0)
    out = speculate(peaked, spec, prompt.expand(num_samples, -1), k=2, max_new_tokens=3, do_sample=True, top_k=0)
    metrics = out.speculative_metrics
    assert metrics.num_draft_tokens > 0 and 0.1 < metrics.acceptance_rate < 0.9
    with torch.no_grad():  # exact: sum over the first token of p(t1) p(t2 | t1)
        first = torch.softmax(peaked(prompt).logits[0, -1], -1)
        both = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
        exact = first @ torch.softmax(peaked(both).logits[:, -1], -1)
    tv, noise = total_variation(out.sequences[:, PROMPT_LEN + 1], exact)
    # Rows that committed the same first token share the head's input (the prompt's last state and, for the MLP,
    # that token), so their first drafts must be samples of one draft distribution: the one passed to the verifier.
    drafted = proposals[1]
    group = out.sequences[:, PROMPT_LEN] == out.sequences[:, PROMPT_LEN].mode().values
    draft_probs = drafted.probs[group, 0]
    assert torch.allclose(draft_probs, draft_probs[0].expand_as(draft_probs))
    draft_tv, draft_noise = total_variation(drafted.token_ids[group, 0], draft_probs[0])
    print(f"{kind}: acceptance {metrics.acceptance_rate:.2f}; second token: total variation {tv:.4f}, largest of 5 "
          f"exact-sample draws {noise:.4f}; first drafts of {int(group.sum())} rows: {draft_tv:.4f} against "
          f"{draft_noise:.4f}")
    assert tv < 1.5 * noise
    assert draft_tv < 1.5 * draft_noise


def test_sampling_is_seeded_deterministic(tmp_path):
    target = make_target()
    spec = load(convert_reference(tmp_path, target, *mlp_reference()))
    input_ids, mask = ragged_batch(3)
    assert_seeded_sampling_is_reproducible(lambda **kwargs: speculate(target, spec, input_ids, mask, **kwargs))


# --- bad checkpoints get clear errors --------------------------------------------------------------------------------
def _edited(make, edit):
    config, tensors = make()
    return edit(config, dict(tensors))


def _drop(name):
    def edit(config, tensors):
        del tensors[name]
        return config, tensors
    return edit


def _set(name, value):
    def edit(config, tensors):
        tensors[name] = value(tensors[name])
        return config, tensors
    return edit


def _config(**changes):
    def edit(config, tensors):
        return {**config, **changes}, tensors
    return edit


@pytest.mark.parametrize(("make", "edit", "message"), [
    (mlp_reference, _drop("speculator.head.1.weight"), r"missing tensor.*'speculator.head.1.weight'"),
    (mlp_reference, _set("speculator.proj.1.weight", lambda t: t[:, :16]),
     r"'speculator.proj.1.weight' has shape \(32, 16\) but \(32, 32\)"),
    (mlp_reference, _set("speculator.ln.0.bias", lambda t: t.long()),
     r"'speculator.ln.0.bias' has dtype torch.int64"),
    (mlp_reference, _set("speculator.emb.2.weight", lambda t: t * float("nan")),
     r"'speculator.emb.2.weight' holds NaN"),
    (mlp_reference, _config(n_predict=2), r"unexpected tensor.*speculator.emb.2.weight"),
    (mlp_reference, _config(emb_dim=48), r"emb_dim is 48 but the target's hidden_size is 32"),
    (mlp_reference, _config(vocab_size=128), r"vocab_size is 128 but the target's vocab_size is 96"),
    (lambda: mlp_reference(tie=True, store_tied_copies=True), _set("speculator.head.2.weight", lambda t: t + 1),
     r"tie_weights but tensor 'speculator.head.2.weight' is not a copy of 'speculator.head.0.weight'"),
    (medusa_reference, _drop("1.0.linear.bias"), r"missing tensor.*'1.0.linear.bias'"),
    (medusa_reference, _set("2.1.weight", lambda t: t[:40]), r"'2.1.weight' has shape \(40, 32\) but \(96, 32\)"),
    (medusa_reference, _config(medusa_num_heads=2), r"unexpected tensor.*'2.0.linear.weight'"),
    (lambda: medusa_reference(style="vllm", truncated=torch.arange(4, VOCAB, 2)), _drop("token_map"),
     r"missing tensor.*'token_map'"),
    (lambda: medusa_reference(style="vllm", truncated=torch.arange(4, VOCAB, 2)),
     _set("token_map", lambda t: t + VOCAB), r"'token_map' maps ids outside the target's vocabulary"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, make, edit, message):
    config, tensors = _edited(make, edit)
    with pytest.raises(HeadCheckpointError, match=message):
        convert_reference(tmp_path, make_target(), config, tensors)


def test_unknown_layout_and_unreadable_files(tmp_path):
    target = make_target()
    src = write_reference(tmp_path / "src", {"model_type": "llama"}, {"model.norm.weight": torch.ones(32)})
    with pytest.raises(HeadCheckpointError, match="unknown layout.*MLP speculator.*Medusa"):
        convert_head(src, tmp_path / "dst", target=target)
    config, tensors = medusa_reference()
    src = write_reference(tmp_path / "pt", config, tensors, fmt="pt")
    file = src / "medusa_lm_head.pt"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(HeadCheckpointError, match="truncated or corrupt"):
        convert_head(src, tmp_path / "dst", target=target)
    src = write_reference(tmp_path / "mlp", *mlp_reference())
    with pytest.raises(ValueError, match="apply to EAGLE-3 heads only"):
        convert_head(src, tmp_path / "dst", target=target, aux_layers=[0, 1, 2])


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_that_runs_code_is_refused(tmp_path):
    config, tensors = medusa_reference()
    src = write_reference(tmp_path / "src", config, tensors, fmt="pt")
    marker = tmp_path / "ran"
    torch.save({**tensors, "payload": _RunsCode(marker)}, src / "medusa_lm_head.pt")
    with pytest.raises(HeadCheckpointError, match="refused to load .*medusa_lm_head.pt"):
        convert_head(src, tmp_path / "dst", target=make_target())
    assert not marker.exists()


def test_converted_head_checks(tmp_path):
    target = make_target()
    dst = convert_reference(tmp_path, target, *mlp_reference())
    with pytest.raises(HeadCheckpointError, match="holds a mlp_speculator head, not a medusa head"):
        MedusaSpeculator.from_pretrained(dst)
    other = make_target(num_layers=3)
    with pytest.raises(ValueError, match="num_hidden_layers=2, but the target has num_hidden_layers=3"):
        other.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4, speculator=load(dst))
    file = dst / "model.safetensors"
    file.write_bytes(file.read_bytes()[:200])
    with pytest.raises(HeadCheckpointError, match="truncated or corrupt"):
        MlpSpeculator.from_pretrained(dst)
    config, tensors = mlp_reference()
    src = write_reference(tmp_path / "unconverted", config, tensors)
    with pytest.raises(HeadCheckpointError, match="convert it first"):
        MlpSpeculator.from_pretrained(src)


# --- the command line and the pipeline --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mlp", "medusa"])
def test_cli_convert_head_then_pipeline_detects_it(tmp_path, capsys, kind):
    from conftest import make_tokenizer, word_prompt
    from transformers import pipeline

    from hf_specdec.cli import main

    target = make_target()
    target.config.save_pretrained(tmp_path / "target")
    config, tensors = mlp_reference() if kind == "mlp" else medusa_reference()
    src = write_reference(tmp_path / "src", config, tensors, "safetensors" if kind == "mlp" else "pt")
    assert main(["convert-head", str(src), str(tmp_path / "dst"), "--target", str(tmp_path / "target")]) == 0
    assert "wrote" in capsys.readouterr().out
    tokenizer = make_tokenizer()
    ours = pipeline("speculative-text-generation", model=target, tokenizer=tokenizer, assistant=str(tmp_path / "dst"))
    assert isinstance(ours.speculator, MlpSpeculator if kind == "mlp" else MedusaSpeculator)
    stock = pipeline("text-generation", model=target, tokenizer=tokenizer)
    prompts = [word_prompt(1, 9), word_prompt(2, 5)]
    greedy = dict(max_new_tokens=10, do_sample=False)
    assert ours(prompts, batch_size=2, **greedy) == stock(prompts, batch_size=1, **greedy)
    with pytest.raises(HeadCheckpointError, match="convert it first: `hf-specdec convert-head"):
        pipeline("speculative-text-generation", model=target, tokenizer=tokenizer, assistant=str(src))


def test_convert_head_also_converts_eagle_heads(tmp_path):
    from test_eagle import eagle1_reference
    from test_eagle import write_reference as write_eagle

    from hf_specdec import EagleSpeculator

    target = make_target()
    src = write_eagle(tmp_path / "src", *eagle1_reference(target))
    dst = convert_head(src, tmp_path / "dst", target=target)
    assert (dst / "eagle_config.json").is_file()
    assert isinstance(EagleSpeculator.from_pretrained(dst), EagleSpeculator)
