"""EAGLE heads: reference checkpoints converted and run, losslessly, batched; fitted heads reach real acceptance
and lose it when miswired; bad checkpoints get clear errors.

Checkpoints are synthetic but in the exact reference layouts (real names and shapes, random values) for tiny Llama
targets: EAGLE-1/2 with and without `fc` bias, EAGLE-3 with a reduced draft vocabulary, as `.bin` and safetensors.
"""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import COMMON, VOCAB, ragged_batch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_specdec
from hf_specdec import EagleCheckpointError, EagleSpeculator, convert_eagle
from hf_specdec.paged_cache import ATTENTION_NAME


def make_target(num_layers: int = 2, seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": num_layers})).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _layer_tensors(prefix: str, config, attn_in: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    return {
        f"{prefix}self_attn.q_proj.weight": rand(q_out, attn_in),
        f"{prefix}self_attn.k_proj.weight": rand(kv_out, attn_in),
        f"{prefix}self_attn.v_proj.weight": rand(kv_out, attn_in),
        f"{prefix}self_attn.o_proj.weight": rand(hidden, q_out),
        f"{prefix}mlp.gate_proj.weight": rand(inter, hidden),
        f"{prefix}mlp.up_proj.weight": rand(inter, hidden),
        f"{prefix}mlp.down_proj.weight": rand(hidden, inter),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(hidden),
    }


def head_config(target_config, **extra) -> dict:
    """A reference head's config.json: the target's Llama config with one layer."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "max_position_embeddings", "rms_norm_eps", "hidden_act")
    config = {k: getattr(target_config, k) for k in keys}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
            "rope_theta": 10000.0, "tie_word_embeddings": False, **config, **extra}


def eagle1_reference(target, bias: bool | None = True, seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    """EAGLE-1/2 layout (yuhuili/EAGLE-*): embed_tokens, fc [H, 2H] (+ bias), layers.0.* without input norm.

    `bias=None` leaves the config's "bias" key out (the reference then defaults to a bias)."""
    config = target.config
    g = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    tensors = {"embed_tokens.weight": target.get_input_embeddings().weight.detach().float().clone(),
               "fc.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.2,
               **_layer_tensors("layers.0.", config, hidden, g)}
    if bias is not False:
        tensors["fc.bias"] = torch.randn(hidden, generator=g) * 0.1
    extra = {} if bias is None else {"bias": bias}
    return head_config(config, **extra), tensors


def eagle3_reference(target, draft_vocab: int = 40, seed: int = 0,
                     used: torch.Tensor | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """EAGLE-3 layout (yuhuili/EAGLE3-*): fc [H, 3H], midlayer.* with 2H-wide q/k/v, norms, reduced lm_head, d2t/t2d.

    `used`: the target ids of the draft vocabulary (default: random)."""
    config = target.config
    g = torch.Generator().manual_seed(seed)
    hidden, vocab = config.hidden_size, config.vocab_size
    if used is None:
        used = torch.randperm(vocab, generator=g)[:draft_vocab]
    used = used.sort().values  # the draft vocabulary, ascending
    draft_vocab = used.shape[0]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    tensors = {
        "fc.weight": torch.randn(hidden, 3 * hidden, generator=g) * 0.2,
        **_layer_tensors("midlayer.", config, 2 * hidden, g),
        "midlayer.hidden_norm.weight": 1 + torch.randn(hidden, generator=g) * 0.1,
        "midlayer.input_layernorm.weight": 1 + torch.randn(hidden, generator=g) * 0.1,
        "norm.weight": 1 + torch.randn(hidden, generator=g) * 0.1,
        "lm_head.weight": torch.randn(draft_vocab, hidden, generator=g) * 0.5,
        "d2t": used - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    cfg = head_config(config, draft_vocab_size=draft_vocab)
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    return cfg, tensors


def write_reference(directory: Path, config: dict, tensors: dict[str, torch.Tensor], fmt: str = "safetensors") -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(directory / "model.safetensors"))
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    return directory


def convert(tmp_path: Path, target, version: int, fmt: str = "safetensors", **kwargs) -> Path:
    config, tensors = eagle1_reference(target) if version == 1 else eagle3_reference(target)
    write_reference(tmp_path / "src", config, tensors, fmt)
    if version == 3:
        kwargs.setdefault("aux_layers", [1, 2, 3])
    return convert_eagle(tmp_path / "src", tmp_path / "dst", target=target, **kwargs)


def speculate(target, spec, input_ids, attention_mask=None, k: int = 3, max_new_tokens: int = 20, **kwargs):
    return target.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                           speculator=spec, num_speculative_tokens=k, speculative_schedule="constant",
                           return_dict_in_generate=True, **kwargs)


# --- conversion: every tensor round-trips -----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("bias", [True, False, None])
def test_eagle1_converts_every_tensor(tmp_path, fmt, bias):
    from safetensors.torch import load_file

    target = make_target()
    config, tensors = eagle1_reference(target, bias=bias)
    write_reference(tmp_path / "src", config, tensors, fmt)
    dst = convert_eagle(tmp_path / "src", tmp_path / "dst", target=target)
    ours = load_file(str(dst / "model.safetensors"))
    ours_config = json.loads((dst / "eagle_config.json").read_text())
    assert ours_config["eagle_version"] == 1
    assert ours_config["fc_bias"] is (bias is not False)  # an absent "bias" key means a bias, as in the reference
    assert ours_config["target_hidden_states"]["layers"] == [2]  # the final (normed) state of the 2-layer target
    expected = {("layer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): t
                for n, t in tensors.items() if n != "embed_tokens.weight"}  # the embedding is the target's
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


def test_eagle3_converts_every_tensor_and_maps_the_draft_vocabulary(tmp_path):
    from safetensors.torch import load_file

    target = make_target(num_layers=8)
    config, tensors = eagle3_reference(target, draft_vocab=40)
    write_reference(tmp_path / "src", config, tensors, "bin")
    dst = convert_eagle(tmp_path / "src", tmp_path / "dst", target=target)
    ours = load_file(str(dst / "model.safetensors"))
    ours_config = json.loads((dst / "eagle_config.json").read_text())
    assert ours_config["eagle_version"] == 3 and ours_config["draft_vocab_size"] == 40
    assert ours_config["target_hidden_states"]["layers"] == [2, 4, 5]  # the reference's default (2, L // 2, L - 3)
    assert torch.equal(ours["draft_to_target"], tensors["d2t"] + torch.arange(40))
    assert torch.equal(tensors["t2d"].nonzero().flatten(), ours["draft_to_target"])
    expected = {("layer." + n[len("midlayer."):] if n.startswith("midlayer.") else n): t
                for n, t in tensors.items() if n not in ("d2t", "t2d")}
    assert set(ours) - {"draft_to_target"} == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize(("ids", "convention", "layers"), [
    ([1, 4, 5], "input", [1, 4, 5]),
    ([1, 3, 4], "output", [2, 4, 5]),  # SGLang counts the output of layer i: transformers' hidden_states[i + 1]
])
def test_eagle3_hidden_state_layers_are_explicit(tmp_path, ids, convention, layers):
    target = make_target(num_layers=8)
    config, tensors = eagle3_reference(target)
    write_reference(tmp_path / "src", {**config, "eagle_aux_hidden_state_layer_ids": ids}, tensors)
    dst = convert_eagle(tmp_path / "src", tmp_path / "dst", target=target, aux_layer_convention=convention)
    written = json.loads((dst / "eagle_config.json").read_text())["target_hidden_states"]
    assert written["layers"] == layers
    assert written["convention"] == "transformers-output_hidden_states-index"


# --- lossless, batched, ragged ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize("rows", [1, 3])
def test_random_head_output_equals_target_greedy(tmp_path, version, rows):
    target = make_target(num_layers=2 if version == 1 else 4)
    spec = EagleSpeculator.from_pretrained(convert(tmp_path, target, version))
    input_ids, mask = ragged_batch(rows)
    out = speculate(target, spec, input_ids, mask)
    expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(out.sequences, expected)
    assert out.speculative_metrics.num_draft_tokens > 0


def test_sampling_is_seeded_deterministic(tmp_path):
    target = make_target(num_layers=4)
    spec = EagleSpeculator.from_pretrained(convert(tmp_path, target, 3))
    input_ids, mask = ragged_batch(3)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(speculate(target, spec, input_ids, mask, do_sample=True, temperature=0.8, top_k=20))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].speculative_metrics.num_draft_tokens > 0
    torch.manual_seed(8)
    assert not torch.equal(speculate(target, spec, input_ids, mask, do_sample=True).sequences, runs[0].sequences)


# --- a fitted head: real acceptance, lost when miswired --------------------------------------------------------------
def fit_reference(directory: Path, target, version: int, layers: list[int], steps: int = 250,
                  num_sequences: int = 48) -> Path:
    """Fits an EAGLE head to `target` and writes it in the reference layout; returns the directory.

    Teacher forcing on the target's own greedy continuations of random prompts: entry p reads the target's features
    at p and the token at p + 1 and learns the target's next argmax (cross-entropy), and, for EAGLE-1, to reproduce
    the target's feature at p + 1, as EAGLE's training does. Seeded, a few seconds on a CPU.
    """
    torch.manual_seed(0)
    teacher = copy.deepcopy(target).float()
    for p in teacher.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    seqs = target.generate(torch.randint(2, VOCAB, (num_sequences, 6), generator=g), max_new_tokens=24, do_sample=False)
    with torch.no_grad():
        out = teacher(seqs, output_hidden_states=True)
    states, labels = out.hidden_states, out.logits.argmax(-1)[:, 1:]
    if version == 1:
        config, tensors = eagle1_reference(target)
    else:  # the draft vocabulary: the most frequent targets, as EAGLE-3's training picks it
        used = labels.flatten().bincount(minlength=VOCAB).argsort(descending=True)[:VOCAB // 2]
        config, tensors = eagle3_reference(target, used=used)
        labels = torch.where(tensors["t2d"][labels], labels, -100)  # ignored: the head cannot draft them
    kwargs = {} if version == 1 else {"aux_layers": layers}
    write_reference(directory / "init", config, tensors)
    head = EagleSpeculator.from_pretrained(convert_eagle(directory / "init", directory / "init-ours",
                                                         target=target, **kwargs)).head
    head.bind(teacher)
    if version == 3:  # start the head's norm and LM head from the target's (kept fixed), as a known output space
        head.norm.weight.data.copy_(teacher.model.norm.weight)
        head.lm_head.weight.data.copy_(teacher.lm_head.weight[head.draft_to_target])
        head.norm.weight.requires_grad_(False)
        head.lm_head.weight.requires_grad_(False)
    features = torch.cat([states[i] for i in layers], dim=-1)[:, :-1]
    positions = torch.arange(seqs.shape[1] - 1).expand(seqs.shape[0], -1)
    head.layer.self_attn.config._attn_implementation = "sdpa"  # plain causal attention for training
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        hidden = head(seqs[:, 1:], positions, None, features)
        loss = F.cross_entropy(head.logits(hidden, VOCAB).flatten(0, 1), labels.flatten())
        # and the target's next feature (EAGLE-3's after its norm, which starts as the target's)
        loss = loss + F.mse_loss(hidden if version == 1 else head.norm(hidden), states[-1][:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    head.layer.self_attn.config._attn_implementation = ATTENTION_NAME
    fitted = {n: t.detach() for n, t in head.state_dict().items()}
    prefix = "layers.0." if version == 1 else "midlayer."
    reference = {(prefix + n[len("layer."):] if n.startswith("layer.") else n): t for n, t in fitted.items()}
    if version == 3:
        reference["d2t"], reference["t2d"] = tensors["d2t"], tensors["t2d"]
        del reference["draft_to_target"]
    else:
        reference["embed_tokens.weight"] = tensors["embed_tokens.weight"]
    return write_reference(directory / "fitted", config, reference)


def acceptance(target, spec) -> float:
    """Acceptance rate on held-out prompts; also checks the output is the target's own."""
    g = torch.Generator().manual_seed(99)
    input_ids = torch.randint(2, VOCAB, (4, 6), generator=g)
    out = speculate(target, spec, input_ids, max_new_tokens=24)
    assert torch.equal(out.sequences, target.generate(input_ids=input_ids, max_new_tokens=24, do_sample=False))
    return out.speculative_metrics.acceptance_rate


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    root = tmp_path_factory.mktemp("fitted")
    target1, target3 = make_target(num_layers=2), make_target(num_layers=4, seed=1)
    return {1: (target1, fit_reference(root / "v1", target1, 1, [2])),
            3: (target3, fit_reference(root / "v3", target3, 3, [1, 2, 3]))}


def test_fitted_eagle1_head_accepts_and_miswiring_drops_it(fitted, tmp_path):
    target, src = fitted[1]
    right = acceptance(target, EagleSpeculator.from_pretrained(convert_eagle(src, tmp_path / "ok", target=target)))
    # fc over [feature, embedding] instead of [embedding, feature]: a converter that swapped the input order
    from safetensors.torch import load_file

    tensors = load_file(str(src / "model.safetensors"))
    hidden = target.config.hidden_size
    tensors["fc.weight"] = torch.cat([tensors["fc.weight"][:, hidden:], tensors["fc.weight"][:, :hidden]], dim=1)
    config = json.loads((src / "config.json").read_text())
    swapped = write_reference(tmp_path / "swapped", config, tensors)
    swapped_rate = acceptance(target, EagleSpeculator.from_pretrained(
        convert_eagle(swapped, tmp_path / "swapped-ours", target=target)))
    # the wrong hidden state: the input to the last layer (before the final norm) instead of the final normed state
    wrong_layer = convert_eagle(src, tmp_path / "layer", target=target)
    ours_config = json.loads((wrong_layer / "eagle_config.json").read_text())
    ours_config["target_hidden_states"]["layers"] = [1]
    (wrong_layer / "eagle_config.json").write_text(json.dumps(ours_config))
    layer_rate = acceptance(target, EagleSpeculator.from_pretrained(wrong_layer))
    print(f"EAGLE-1 acceptance: right {right:.2f}, swapped fc inputs {swapped_rate:.2f}, wrong layer {layer_rate:.2f}")
    assert right >= 0.4
    assert swapped_rate < right / 2
    assert layer_rate < right * 0.75


def test_fitted_eagle3_head_accepts_well_above_a_random_head(fitted, tmp_path):
    target, src = fitted[3]
    right = acceptance(target, EagleSpeculator.from_pretrained(
        convert_eagle(src, tmp_path / "ok", target=target, aux_layers=[1, 2, 3])))
    # the same ids read as "output of layer i" (SGLang's convention) are the same wiring
    shifted = acceptance(target, EagleSpeculator.from_pretrained(convert_eagle(
        src, tmp_path / "shifted", target=target, aux_layers=[0, 1, 2], aux_layer_convention="output")))
    config, tensors = eagle3_reference(target, draft_vocab=VOCAB // 2)
    random_head = convert_eagle(write_reference(tmp_path / "random", config, tensors), tmp_path / "random-ours",
                                target=target, aux_layers=[1, 2, 3])
    baseline = acceptance(target, EagleSpeculator.from_pretrained(random_head))
    print(f"EAGLE-3 acceptance: fitted {right:.2f}, random head {baseline:.2f}")
    assert right == shifted
    assert right >= 0.1 and right > 3 * baseline
