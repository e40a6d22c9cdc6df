"""EAGLE heads: reference checkpoints converted and run, losslessly, batched; fitted heads reach real acceptance
and lose it when miswired; bad checkpoints get clear errors.

Checkpoints are synthetic but in the exact reference layouts (real names and shapes, random values) for tiny Llama
targets: EAGLE-1/2 with and without `fc` bias, EAGLE-3 with a reduced draft vocabulary, as `.bin` and safetensors.
"""

from __future__ import annotations

import copy
import functools
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import COMMON, VOCAB, assert_seeded_sampling_is_reproducible, ragged_batch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_specdec
from hf_specdec import EagleCheckpointError, EagleSpeculator, convert_eagle
from hf_specdec.cache.attention import ATTENTION_NAME


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
    assert_seeded_sampling_is_reproducible(lambda **kwargs: speculate(target, spec, input_ids, mask, **kwargs))


# --- a fitted head: real acceptance, lost when miswired --------------------------------------------------------------
def fit_reference(directory: Path, target, version: int, layers: list[int], steps: int = 200,
                  num_sequences: int = 32) -> Path:
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


@pytest.fixture
def fitted(fitted_eagle_heads):
    return fitted_eagle_heads  # session-scoped in conftest.py: fitted once, shared with test_tree.py


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
    assert right >= 0.2
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


# --- exact wiring: the engine's draft logits equal the reference formulas, written out here ------------------------
def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_head_logits(target, tensors, version, layers, seq):
    """EAGLE's forward from the reference tensors, in plain torch: entry p reads the target's hidden state(s) at p
    and the token at p + 1, at position p. Returns `[entries, vocab]` logits over the target's vocabulary."""
    config = target.config
    eps, hidden = config.rms_norm_eps, config.hidden_size
    t = {n: v.double() if v.is_floating_point() else v for n, v in tensors.items()}
    pre = "layers.0." if version == 1 else "midlayer."
    with torch.no_grad():
        states = target(seq, output_hidden_states=True).hidden_states
        features = torch.cat([states[i] for i in layers], dim=-1)[0, :-1]
        embeds = target.get_input_embeddings()(seq[0, 1:])
        if version == 1:  # fc over [embedding, feature]; no input norm
            h = torch.cat([embeds, features], -1) @ t["fc.weight"].T + t.get("fc.bias", 0)
            attn_in = h
        else:  # fc over the three states; attention over [input_layernorm(embed), hidden_norm(h)]
            h = features @ t["fc.weight"].T
            attn_in = torch.cat([rms(embeds, t[pre + "input_layernorm.weight"], eps),
                                 rms(h, t[pre + "hidden_norm.weight"], eps)], -1)
        n = h.shape[0]
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        dim = hidden // heads
        q = (attn_in @ t[pre + "self_attn.q_proj.weight"].T).view(n, heads, dim).transpose(0, 1)
        k = (attn_in @ t[pre + "self_attn.k_proj.weight"].T).view(n, kv_heads, dim).transpose(0, 1)
        v = (attn_in @ t[pre + "self_attn.v_proj.weight"].T).view(n, kv_heads, dim).transpose(0, 1)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

        def rotate(x):
            return x * cos + torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1) * sin

        q, k = rotate(q), rotate(k)
        k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(n, -1)
        h = h + attn @ t[pre + "self_attn.o_proj.weight"].T
        x = rms(h, t[pre + "post_attention_layernorm.weight"], eps)
        mlp = (F.silu(x @ t[pre + "mlp.gate_proj.weight"].T) * (x @ t[pre + "mlp.up_proj.weight"].T))
        h = h + mlp @ t[pre + "mlp.down_proj.weight"].T
        if version == 1:  # the target's LM head on the un-normed output
            return target.lm_head(h)
        draft_logits = rms(h, t["norm.weight"], eps) @ t["lm_head.weight"].T
        logits = torch.full((n, config.vocab_size), float("-inf"), dtype=torch.float64)
        logits[:, torch.arange(draft_logits.shape[1]) + t["d2t"]] = draft_logits
        return logits


@pytest.mark.parametrize("version", [1, 3])
def test_draft_logits_equal_the_reference_forward(tmp_path, version, monkeypatch):
    from hf_specdec.speculators.heads import EagleHead

    target = make_target(num_layers=2 if version == 1 else 4)
    config, tensors = eagle1_reference(target) if version == 1 else eagle3_reference(target)
    layers = [2] if version == 1 else [1, 2, 3]
    src = write_reference(tmp_path / "src", config, tensors)
    spec = EagleSpeculator.from_pretrained(convert_eagle(src, tmp_path / "dst", target=target, aux_layers=layers))
    seen = []
    original = EagleHead.logits

    def recording(self, hidden, vocab_size):
        logits = original(self, hidden, vocab_size)
        seen.append(logits[0].clone())
        return logits

    monkeypatch.setattr(EagleHead, "logits", recording)
    input_ids = torch.randint(2, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    out = speculate(target, spec, input_ids, k=1, max_new_tokens=12)
    expected = reference_head_logits(target, tensors, version, layers, out.sequences)
    # A random head's drafts are rejected, so each step commits one token; step 0 has no target states yet and the
    # last step may not draft (length budget). Drafting step s (committed length 8 + s) reads entry 6 + s.
    assert out.speculative_metrics.num_accepted_tokens == 0 and len(seen) == 10
    for step, logits in enumerate(seen):
        reference = expected[input_ids.shape[1] - 1 + step]
        finite = torch.isfinite(reference)
        assert torch.equal(finite, torch.isfinite(logits))
        # (transformers computes rotary angles in float32, hence not float64-exact)
        torch.testing.assert_close(logits[finite], reference[finite], rtol=1e-5, atol=1e-5)


# --- bad checkpoints get clear errors --------------------------------------------------------------------------------
class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickle_that_runs_code_is_refused(tmp_path):
    target = make_target()
    config, tensors = eagle1_reference(target)
    write_reference(tmp_path / "src", config, tensors, "bin")
    marker = tmp_path / "ran"
    torch.save({**tensors, "payload": _RunsCode(marker)}, tmp_path / "src" / "pytorch_model.bin")
    with pytest.raises(EagleCheckpointError, match="refused to load .*pytorch_model.bin"):
        convert_eagle(tmp_path / "src", tmp_path / "dst", target=target)
    assert not marker.exists()


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_truncated_checkpoint(tmp_path, fmt):
    target = make_target()
    config, tensors = eagle1_reference(target)
    src = write_reference(tmp_path / "src", config, tensors, fmt)
    file = src / ("model.safetensors" if fmt == "safetensors" else "pytorch_model.bin")
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(EagleCheckpointError, match="truncated or corrupt"):
        convert_eagle(src, tmp_path / "dst", target=target)


def test_truncated_converted_head(tmp_path):
    dst = convert(tmp_path, make_target(), 1)
    file = dst / "model.safetensors"
    file.write_bytes(file.read_bytes()[:200])
    with pytest.raises(EagleCheckpointError, match="truncated or corrupt"):
        EagleSpeculator.from_pretrained(dst)


def _broken(tensors, name, value=None):
    out = dict(tensors)
    if value is None:
        del out[name]
    else:
        out[name] = value
    return out


@pytest.mark.parametrize(("version", "edit", "message"), [
    (1, lambda t: _broken(t, "layers.0.mlp.down_proj.weight"), r"missing tensor.*layer.mlp.down_proj.weight"),
    (1, lambda t: _broken(t, "fc.bias"), r"missing tensor.*fc.bias"),  # config says bias (the default)
    (1, lambda t: _broken(t, "fc.weight", t["fc.weight"][:, :40]), r"'fc.weight' has shape \(32, 40\)"),
    (1, lambda t: _broken(t, "layers.0.self_attn.q_proj.weight", t["layers.0.self_attn.q_proj.weight"].long()),
     r"'layers.0.self_attn.q_proj.weight' has dtype torch.int64"),
    (1, lambda t: _broken(t, "layers.0.input_layernorm.weight", torch.ones(32)),
     r"unexpected tensor.*layers.0.input_layernorm.weight"),
    (1, lambda t: _broken(t, "fc.weight", torch.full_like(t["fc.weight"], float("nan"))), r"'fc.weight' holds NaN"),
    (3, lambda t: _broken(t, "midlayer.hidden_norm.weight"), r"missing tensor.*hidden_norm"),
    (3, lambda t: _broken(t, "d2t", t["d2t"].float()), r"'d2t' must be a 1-D integer tensor"),
    (3, lambda t: _broken(t, "t2d", ~t["t2d"]), r"'d2t' and 't2d' disagree"),
    (3, lambda t: _broken(t, "midlayer.self_attn.k_proj.weight", torch.zeros(16, 32)),
     r"'midlayer.self_attn.k_proj.weight' has shape \(16, 32\) but \(16, 64\)"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, version, edit, message):
    target = make_target(num_layers=2 if version == 1 else 4)
    config, tensors = eagle1_reference(target) if version == 1 else eagle3_reference(target)
    write_reference(tmp_path / "src", config, edit(tensors))
    with pytest.raises(EagleCheckpointError, match=message):
        convert_eagle(tmp_path / "src", tmp_path / "dst", target=target, aux_layers=None if version == 1 else [1, 2, 3])


def test_head_for_another_target_size(tmp_path):
    config, tensors = eagle1_reference(make_target())
    write_reference(tmp_path / "src", config, tensors)
    bigger = LlamaConfig(**{**COMMON, "hidden_size": 64})
    with pytest.raises(EagleCheckpointError, match=r"'embed_tokens.weight' has shape \(96, 32\).*another target"):
        convert_eagle(tmp_path / "src", tmp_path / "dst", target=bigger)
    del tensors["embed_tokens.weight"]
    write_reference(tmp_path / "src2", config, tensors)
    with pytest.raises(EagleCheckpointError, match=r"'fc.weight' has shape \(32, 64\).*hidden size 64"):
        convert_eagle(tmp_path / "src2", tmp_path / "dst", target=bigger)


def test_unknown_layout_and_missing_target(tmp_path):
    target = make_target()
    src = write_reference(tmp_path / "src", {"model_type": "llama"}, {"model.norm.weight": torch.ones(32)})
    with pytest.raises(EagleCheckpointError, match="unknown layout"):
        convert_eagle(src, tmp_path / "dst", target=target)
    with pytest.raises(ValueError, match="needs target="):
        convert_eagle(src, tmp_path / "dst")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EagleCheckpointError, match="no config.json"):
        convert_eagle(tmp_path / "empty", tmp_path / "dst", target=target)


def test_eagle3_layers_out_of_range(tmp_path):
    target = make_target(num_layers=4)
    config, tensors = eagle3_reference(target)
    write_reference(tmp_path / "src", config, tensors)
    with pytest.raises(EagleCheckpointError, match=r"layers \[1, 2, 4\].*0 to 3"):
        convert_eagle(tmp_path / "src", tmp_path / "dst", target=target, aux_layers=[1, 2, 4])


def test_wrong_target_at_generate_time(tmp_path):
    spec = EagleSpeculator.from_pretrained(convert(tmp_path, make_target(), 1))
    other = make_target(num_layers=3)
    with pytest.raises(ValueError, match="num_hidden_layers=2.*num_hidden_layers=3"):
        other.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4, speculator=spec)


def test_unconverted_directory_is_explained(tmp_path):
    target = make_target()
    config, tensors = eagle1_reference(target)
    src = write_reference(tmp_path / "src", config, tensors)
    with pytest.raises(EagleCheckpointError, match="convert-eagle"):
        EagleSpeculator.from_pretrained(src)


# --- the command line and the pipeline --------------------------------------------------------------------------------
def test_cli_convert_eagle_then_pipeline_detects_the_head(tmp_path, capsys):
    from conftest import make_tokenizer, word_prompt
    from transformers import pipeline

    from hf_specdec.cli import main

    target = make_target()
    target.config.save_pretrained(tmp_path / "target")
    config, tensors = eagle1_reference(target, bias=False)
    src = write_reference(tmp_path / "src", config, tensors, "bin")
    assert main(["convert-eagle", str(src), str(tmp_path / "dst"), "--target", str(tmp_path / "target")]) == 0
    assert "wrote" in capsys.readouterr().out
    tokenizer = make_tokenizer()
    ours = pipeline("speculative-text-generation", model=target, tokenizer=tokenizer, assistant=str(tmp_path / "dst"))
    assert isinstance(ours.speculator, EagleSpeculator)
    stock = pipeline("text-generation", model=target, tokenizer=tokenizer)
    prompts = [word_prompt(1, 9), word_prompt(2, 5)]
    greedy = dict(max_new_tokens=10, do_sample=False)
    assert ours(prompts, batch_size=2, **greedy) == stock(prompts, batch_size=1, **greedy)
    with pytest.raises(EagleCheckpointError, match="convert it first"):
        pipeline("speculative-text-generation", model=target, tokenizer=tokenizer, assistant=str(src))


# --- engine plumbing -------------------------------------------------------------------------------------------------
def test_hidden_states_only_for_speculators_that_ask(tmp_path, monkeypatch):
    target = make_target()
    calls = []
    forward = type(target).forward

    @functools.wraps(forward)  # keeps the signature the engine reads (which cache keyword the model takes)
    def spy(self, *args, **kwargs):
        calls.append(bool(kwargs.get("output_hidden_states")))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "forward", spy)
    input_ids = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    speculate(target, "ngram", input_ids, max_new_tokens=6)
    assert calls and not any(calls)
    calls.clear()
    speculate(target, EagleSpeculator.from_pretrained(convert(tmp_path, target, 1)), input_ids, max_new_tokens=6)
    assert calls and all(calls)


def test_states_of_a_step_that_drafted_nothing_are_kept_and_appended():
    from hf_specdec.runners.model_runner import TargetHiddenStates
    from hf_specdec.speculators.eagle import _PendingStates

    def states(values: list[list[float]], width: int) -> torch.Tensor:  # right-aligned, padding 0
        return torch.tensor([[0.0] * (width - len(v)) + v for v in values])[..., None]

    pending = _PendingStates()
    pending.add(TargetHiddenStates(states([[1, 2, 3], [4], [5, 6]], 3), [3, 1, 2], [0, 0, 0], [0, 1, 2]))
    # Row 1 sat this step out (rows joining the batch had a step of their own); row 3 joined in it.
    pending.add(TargetHiddenStates(states([[7], [8, 9], [10, 11]], 2), [1, 2, 2], [3, 2, 0], [0, 2, 3]))
    assert sorted(pending.rows) == [0, 1, 2, 3] and pending.most() == 4
    merged, counts, starts = pending.take([0, 2, 3, 1])
    assert counts == [4, 4, 2, 1] and starts == [0, 0, 0, 0]
    assert merged[..., 0].tolist() == [[1, 2, 3, 7], [5, 6, 8, 9], [0, 0, 10, 11], [0, 0, 0, 4]]
    assert not pending and pending.most() == 0
    pending.add(TargetHiddenStates(states([[12], [13, 14]], 2), [1, 2], [4, 1], [0, 1]))
    pending.drop([0])
    assert pending.rows == [1] and pending.take([1])[0][..., 0].tolist() == [[13, 14]]


def test_catch_up_groups_feed_a_wide_row_on_its_own():
    from hf_specdec.speculators.eagle import catch_up_groups

    assert catch_up_groups([2, 3, 2]) == [[0, 1, 2]]  # little padding: one forward
    assert catch_up_groups([2, 40, 1, 3]) == [[0, 2, 3], [1]]  # a newcomer's prompt beside rows holding a few
    assert catch_up_groups([30, 32, 1]) == [[0, 1, 2]]  # a third padding: still one
    assert catch_up_groups([5]) == [[0]]


def test_split_catch_up_drafts_what_one_forward_drafts(fitted, tmp_path, monkeypatch):
    """Rows catching up in two forwards (a newcomer's prompt apart from rows holding one state each) get the head
    outputs one padded forward gives: the same drafts, step for step, and the target's output."""
    from hf_specdec.speculators import eagle

    target, src = fitted[3]
    directory = convert_eagle(src, tmp_path / "head", target=target)
    g = torch.Generator().manual_seed(11)
    # Ragged prompts (4 to 30 tokens): the first catch-up of each call feeds the longest prompt apart from the others.
    lengths = [4, 30, 5, 6]
    input_ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, n in enumerate(lengths):
        input_ids[i, -n:] = torch.randint(2, VOCAB, (n,), generator=g)
        mask[i, -n:] = 1
    expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    split = eagle.catch_up_groups
    runs, splits = {}, []
    for one_group in (False, True):
        def groups(counts, one_group=one_group):
            result = [list(range(len(counts)))] if one_group else split(counts)
            splits.append(len(result) > 1)
            return result

        monkeypatch.setattr(eagle, "catch_up_groups", groups)
        spec = EagleSpeculator.from_pretrained(directory)
        propose, drafts = spec.propose, []
        spec.propose = lambda batch, k: drafts.append(propose(batch, k)) or drafts[-1]
        out = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                              speculator=spec, num_speculative_tokens=3, speculative_schedule="constant",
                              return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        runs[one_group] = ([d.token_ids.tolist() for d in drafts], out.speculative_metrics)
    assert any(splits)
    assert runs[False][1].num_accepted_tokens > 0
    assert runs[False][0] == runs[True][0]  # every step's drafts, row by row


def test_adaptive_schedule_stays_lossless(tmp_path):
    target = make_target()
    spec = EagleSpeculator.from_pretrained(convert(tmp_path, target, 1))
    input_ids, mask = ragged_batch(3)
    out = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=40, speculator=spec,
                          num_speculative_tokens=4, return_dict_in_generate=True)
    expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    assert torch.equal(out.sequences, expected)


def idle_then_drafting(fitted, tmp_path, monkeypatch):
    """A fitted target and its converted head, with adaptive k patched to keep drafting off for 14 steps and then
    draft 3 every step, all verified (no per-row trim by the policy's estimates)."""
    from hf_specdec.costs import adaptive

    target, src = fitted[3]
    directory = convert_eagle(src, tmp_path / "head", target=target)
    choose = adaptive.AdaptiveK.choose

    def off_then_on(self, rows, available=None, classes=None, context=0.0, unread=0.0):
        choose(self, rows, available, classes, context)
        self.chosen[-1] = 0 if len(self.chosen) <= 14 else 3
        return self.chosen[-1]

    monkeypatch.setattr(adaptive.AdaptiveK, "choose", off_then_on)
    monkeypatch.setattr(adaptive.AdaptiveK, "choose_rows", lambda self, rows, available, *args, **kwargs: available)
    return target, directory


def test_idle_backlog_is_taken_in_chunks_and_drafting_resumes_from_it(fitted, tmp_path, monkeypatch):
    """While adaptive k keeps drafting off, the head takes the target's pending states every `IDLE_BACKLOG` steps
    instead of letting them pile up; when drafting resumes, its drafts are the ones a head that caught up in one
    forward makes (same acceptance, step by step), and the output is the target's."""
    target, directory = idle_then_drafting(fitted, tmp_path, monkeypatch)
    input_ids = torch.randint(2, VOCAB, (3, 6), generator=torch.Generator().manual_seed(7))
    expected = target.generate(input_ids=input_ids, max_new_tokens=30, do_sample=False)
    runs, widths = {}, {}
    for backlog in (4, 10**9):
        spec = EagleSpeculator.from_pretrained(directory)
        spec.IDLE_WINDOW, spec.IDLE_BACKLOG = None, backlog  # the whole context kept
        observe = spec.observe_hidden_states

        def watch(hidden, spec=spec, observe=observe, backlog=backlog):
            observe(hidden)
            widths.setdefault(backlog, []).append(spec._pending.most())

        spec.observe_hidden_states = watch
        out = target.generate(input_ids=input_ids, max_new_tokens=30, do_sample=False, speculator=spec,
                              num_speculative_tokens=3, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        runs[backlog] = out.speculative_metrics
    # after the prompt's states, chunks taken while idle / one pile
    assert max(widths[4][1:]) <= 4 < max(widths[10**9][1:])
    chunked, whole = runs[4], runs[10**9]
    assert chunked.num_accepted_tokens > 0
    assert (chunked.accepted_per_position, chunked.num_steps) == (whole.accepted_per_position, whole.num_steps)


def test_idle_window_bounds_the_pile_and_the_head_resumes_from_it(fitted, tmp_path, monkeypatch):
    """While drafting is off a row keeps only its newest `IDLE_WINDOW` target states and the head reads none of
    them; when drafting resumes, the head's cache starts again from that window (positions relative to it) and it
    drafts from there: accepted drafts, and the target's output."""
    target, directory = idle_then_drafting(fitted, tmp_path, monkeypatch)
    input_ids = torch.randint(2, VOCAB, (3, 6), generator=torch.Generator().manual_seed(7))
    expected = target.generate(input_ids=input_ids, max_new_tokens=40, do_sample=False)
    spec = EagleSpeculator.from_pretrained(directory)
    spec.IDLE_WINDOW = 4
    piles, head_forwards = [], []
    consume, catch_up = spec._consume_backlog, spec._catch_up

    def watched_consume(batch, rows):
        consume(batch, rows)
        piles.append(spec._pending.most() if spec._pending is not None else 0)

    spec._consume_backlog = watched_consume
    spec._catch_up = lambda batch, rows: head_forwards.append(len(piles)) or catch_up(batch, rows)
    out = target.generate(input_ids=input_ids, max_new_tokens=40, do_sample=False, speculator=spec,
                          num_speculative_tokens=3, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert len(piles) >= 13 and max(piles) <= 4  # bounded while idle
    assert min(head_forwards) >= 14  # the head ran only once drafting resumed, after the 14 idle steps
    assert out.speculative_metrics.num_accepted_tokens > 0


def test_sampling_keeps_the_target_distribution(fitted):
    """The second token (drafted by a fitted head, then accepted or recovered) follows the target's exact marginal."""
    target, src = fitted[1]
    spec = EagleSpeculator.from_pretrained(convert_eagle(src, src.parent / "dist", target=target))
    prompt = torch.randint(2, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    num_samples, temperature = 20000, 0.7
    torch.manual_seed(0)
    out = speculate(target, spec, prompt.expand(num_samples, -1), k=2, max_new_tokens=3, do_sample=True,
                    temperature=temperature, top_k=0)
    metrics = out.speculative_metrics
    assert metrics.num_draft_tokens > 0 and 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens
    with torch.no_grad():  # exact: sum over the first token of p(t1) p(t2 | t1)
        first = torch.softmax(target(prompt).logits[0, -1] / temperature, -1)
        both = torch.cat([prompt.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
        second = torch.softmax(target(both).logits[:, -1] / temperature, -1)
        exact = first @ second
    empirical = torch.bincount(out.sequences[:, 7], minlength=VOCAB).double() / num_samples
    tv = 0.5 * (empirical - exact).abs().sum().item()
    # the same statistic for samples drawn from the exact distribution, for scale
    g = torch.Generator().manual_seed(1)
    noise = max(0.5 * (torch.bincount(torch.multinomial(exact, num_samples, True, generator=g), minlength=VOCAB)
                       .double() / num_samples - exact).abs().sum().item() for _ in range(5))
    print(f"total variation {tv:.4f}, largest of 5 exact-sample draws {noise:.4f}")
    assert tv < 1.5 * noise


def test_unread_is_what_the_head_reads_before_its_next_draft(fitted, tmp_path, monkeypatch):
    """`unread` (what the serving policy prices before a resume): while drafting is off, each row's pending states
    beyond its newest one, at most the idle window's, weighed by the head's fc and layer against the target's
    parameters; after drafting, only the states of the tokens accepted since."""
    target, directory = idle_then_drafting(fitted, tmp_path, monkeypatch)
    input_ids = torch.randint(2, VOCAB, (3, 6), generator=torch.Generator().manual_seed(7))
    spec = EagleSpeculator.from_pretrained(directory)
    spec.IDLE_WINDOW = 4
    seen, propose = [], spec.propose

    def watched(batch, k):
        seen.append((k, spec.unread(batch)))
        return propose(batch, k)

    spec.propose = watched
    out = target.generate(input_ids=input_ids, max_new_tokens=30, do_sample=False, speculator=spec,
                          num_speculative_tokens=3, return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(input_ids=input_ids, max_new_tokens=30, do_sample=False))
    per_state = sum(p.numel() for m in (spec.head.fc, spec.head.layer) for p in m.parameters()) / target.num_parameters()
    first = next(i for i, (k, _) in enumerate(seen) if k > 0)
    assert seen[0][1] == 0 and seen[1][1] == pytest.approx(3 * 5 * per_state)  # none yet; the prompts' 6 states
    # Then the window's 4 states kept at each idle step, and that step's newest one: 4 beyond it, in 3 rows.
    assert [u for _, u in seen[2:first + 1]] == pytest.approx([3 * 4 * per_state] * (first - 1))
    after = [u for _, u in seen[first + 1:]]
    assert after and max(after) <= 3 * 3 * per_state + 1e-12  # at most k = 3 accepted a row since the last draft
