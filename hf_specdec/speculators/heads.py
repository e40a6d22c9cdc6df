"""EAGLE draft heads: hf_specdec's EAGLE format (tensors, config, checks) and the head modules that compute it.

Layouts (our format, written by `hf_specdec.convert_eagle`; see docs/eagle.md):
- EAGLE-1/2: `fc(cat(embed(token), feature))` over `[embedding, target feature]`, one Llama decoder layer without
  input norm, the target's LM head on the un-normed output. The feature is the target's final hidden state (after
  its norm).
- EAGLE-3: `fc` over three target hidden states concatenated low to high (applied to the target's features only;
  drafted entries feed the head's own output), a layer whose attention reads `cat(input_layernorm(embed),
  hidden_norm(h))`, its own norm and a reduced-vocabulary LM head whose ids map to target ids by `draft_to_target`.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from ..cache.attention import ATTENTION_NAME

CONFIG_NAME = "eagle_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "hf_specdec-eagle"
FORMAT_VERSION = 1
# transformers' `output_hidden_states` indexing: entry i is the input to decoder layer i (0: the embeddings), the last
# entry (index num_hidden_layers) the final hidden state after the model's norm.
HIDDEN_STATES_CONVENTION = "transformers-output_hidden_states-index"


class EagleCheckpointError(ValueError):
    """An EAGLE checkpoint (reference layout or ours) that cannot be used: unknown layout, missing or extra tensors,
    wrong shapes or dtypes, unreadable files."""


def check_head_target(target, expected: dict, kind: str, fix: str | None = None) -> None:
    """Raises if `target` differs from the target a head was made for (`expected`: its config's "target"); `fix`
    replaces the advice that ends the message."""
    text = target.config.get_text_config()
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if getattr(text, key, None) != expected[key]:
            raise ValueError(
                f"this {kind} head was made for a target with {key}={expected[key]}, but the target has "
                f"{key}={getattr(text, key, None)}; " + (fix or "use the head trained for this target, or re-convert "
                                                          "it with --target pointing at this model"))


def expected_tensors(config: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Our format's tensors for an `eagle_config.json`: name -> (shape, "float" | "int")."""
    head = config["head_config"]
    version = config["eagle_version"]
    hidden = head["hidden_size"]
    head_dim = head.get("head_dim") or hidden // head["num_attention_heads"]
    q_out, kv_out = head["num_attention_heads"] * head_dim, head["num_key_value_heads"] * head_dim
    attn_in = 2 * hidden if version == 3 else hidden
    inter = head["intermediate_size"]
    target_hidden = config["target"]["hidden_size"]
    tensors = {
        "fc.weight": ((hidden, len(config["target_hidden_states"]["layers"]) * target_hidden + (
            hidden if version == 1 else 0)), "float"),
        "layer.self_attn.q_proj.weight": ((q_out, attn_in), "float"),
        "layer.self_attn.k_proj.weight": ((kv_out, attn_in), "float"),
        "layer.self_attn.v_proj.weight": ((kv_out, attn_in), "float"),
        "layer.self_attn.o_proj.weight": ((hidden, q_out), "float"),
        "layer.mlp.gate_proj.weight": ((inter, hidden), "float"),
        "layer.mlp.up_proj.weight": ((inter, hidden), "float"),
        "layer.mlp.down_proj.weight": ((hidden, inter), "float"),
        "layer.post_attention_layernorm.weight": ((hidden,), "float"),
    }
    if config.get("fc_bias"):
        tensors["fc.bias"] = ((hidden,), "float")
    if head.get("attention_bias"):
        for name, size in (("q", q_out), ("k", kv_out), ("v", kv_out), ("o", hidden)):
            tensors[f"layer.self_attn.{name}_proj.bias"] = ((size,), "float")
    if version == 3:
        draft_vocab = config["draft_vocab_size"]
        tensors.update({
            "layer.input_layernorm.weight": ((hidden,), "float"),
            "layer.hidden_norm.weight": ((hidden,), "float"),
            "norm.weight": ((hidden,), "float"),
            "lm_head.weight": ((draft_vocab, hidden), "float"),
        })
        if draft_vocab != config["target"]["vocab_size"]:
            tensors["draft_to_target"] = ((draft_vocab,), "int")
    if config.get("own_embeddings"):
        tensors["embed_tokens.weight"] = ((config["target"]["vocab_size"], hidden), "float")
    return tensors


def check_tensors(tensors: dict[str, torch.Tensor], config: dict, where: str,
                  source_names: dict[str, str] | None = None, *,
                  expected: dict[str, tuple[tuple[int, ...], str]] | None = None, what: str | None = None,
                  error: type[EagleCheckpointError] = EagleCheckpointError) -> None:
    """Raises `error` naming the first missing, unexpected, misshapen, mistyped or non-finite tensor. The one
    checker of every head format: EAGLE by default, other kinds through `expected`, `what` and `error`.

    Args:
        source_names (`dict`, *optional*): our name -> the checkpoint's, so errors name what the user has.
        expected (`dict`, *optional*): name -> (shape, "float" | "int"); default: an EAGLE head's for `config`.
        what (`str`, *optional*): the head, as errors describe it (default: "an EAGLE-N head").
    """
    expected = expected_tensors(config) if expected is None else expected
    what = what or f"an EAGLE-{config['eagle_version']} head"
    source_names = source_names or {}
    missing = sorted(source_names.get(n, n) for n in set(expected) - set(tensors))
    if missing:
        raise error(f"{where}: missing tensor(s) {missing} for {what}; the checkpoint is incomplete or of another "
                    "layout (re-download or re-convert it)")
    extra = sorted(source_names.get(n, n) for n in set(tensors) - set(expected))
    if extra:
        raise error(f"{where}: unexpected tensor(s) {extra} for {what}; this layout is not supported (or the "
                    "config does not match the weights)")
    for ours, (shape, kind) in expected.items():
        tensor, name = tensors[ours], source_names.get(ours, ours)
        if tuple(tensor.shape) != shape:
            raise error(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)} but {shape} was expected for a target "
                f"with hidden size {config['target']['hidden_size']} and vocabulary {config['target']['vocab_size']}"
                " and this config; the head was made for another target model (or the file is corrupt)")
        if (kind == "float") != tensor.is_floating_point() or (kind == "int" and tensor.dtype == torch.bool):
            raise error(f"{where}: tensor {name!r} has dtype {tensor.dtype}; a "
                        f"{'floating-point' if kind == 'float' else 'integer'} tensor was expected")
        if kind == "float" and not torch.isfinite(tensor).all():
            raise error(f"{where}: tensor {name!r} holds NaN or inf values; the checkpoint is corrupt")


class EagleLayer(nn.Module):
    """The head's one decoder layer. EAGLE-1: no input norm. EAGLE-3: attention over `cat(norm(embed), norm(h))`."""

    def __init__(self, config: LlamaConfig, version: int):
        super().__init__()
        self.version = version
        self.self_attn = LlamaAttention(config, layer_idx=0)
        if version == 3:
            hidden, bias = config.hidden_size, config.attention_bias
            attn = self.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attn, name, nn.Linear(2 * hidden, getattr(attn, name).out_features, bias=bias))
            self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, position_embeddings, attention_mask=None,
                **kwargs) -> torch.Tensor:
        attn_input = hidden if self.version == 1 else torch.cat(
            [self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        # `attention_mask`: None over the paged cache (the step plan masks), a tensor in a compiled step
        hidden = hidden + self.self_attn(attn_input, position_embeddings=position_embeddings,
                                         attention_mask=attention_mask, **kwargs)[0]
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# transformers 5.24 renamed the attention's `past_key_values` to `cache` (the old name warns, and goes in 5.40).
_CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaAttention.forward).parameters else "past_key_values"


class EagleHead(nn.Module):
    """An EAGLE draft head in our format. Shares the target's input embeddings (and, for EAGLE-1/2, its LM head),
    bound by `bind(target)`.

    Args:
        config (`dict`): the contents of `eagle_config.json`.
    """

    # Ragged catch-ups (a newcomer's prompt beside rows with a token or two) go through as one packed stream: every
    # op is per entry but the attention, which is ours and takes the packed layout (`model_runner.packs`).
    _hf_specdec_packable = True

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self.version = config["eagle_version"]
        head_config = LlamaConfig(**config["head_config"])
        head_config._attn_implementation = ATTENTION_NAME  # the head only ever runs over our paged cache
        hidden = head_config.hidden_size
        shapes = expected_tensors(config)
        self.fc = nn.Linear(shapes["fc.weight"][0][1], hidden, bias=bool(config.get("fc_bias")))
        self.layer = EagleLayer(head_config, self.version)
        self.rotary = LlamaRotaryEmbedding(head_config)
        self.embed_tokens = nn.Embedding(*shapes["embed_tokens.weight"][0]) if config.get("own_embeddings") else None
        if self.version == 3:
            self.norm = LlamaRMSNorm(hidden, eps=head_config.rms_norm_eps)
            self.lm_head = nn.Linear(hidden, config["draft_vocab_size"], bias=False)
            if "draft_to_target" in shapes:
                self.register_buffer("draft_to_target", torch.zeros(config["draft_vocab_size"], dtype=torch.long))
            else:
                self.draft_to_target = None
        self._bound: tuple = (None, None)  # the target's (input embeddings, LM head); a tuple, so not submodules

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def bind(self, target) -> None:
        """Shares the target's input embeddings (unless the head has its own) and, for EAGLE-1/2, its LM head."""
        self._bound = (target.get_input_embeddings(), target.get_output_embeddings() if self.version == 1 else None)

    def forward(self, input_ids, position_ids, cache, features, from_target: bool = True,
                use_cache=None, logits_to_keep=None, output_hidden_states=None, **kwargs) -> torch.Tensor:
        """Runs entries `(features[:, j], input_ids[:, j])`; returns the head's outputs `[rows, q, hidden]`.

        Args:
            input_ids: `[rows, q]` the token after each feature's position.
            features: `[rows, q, width]` the target's features (`from_target=True`), or the head's own outputs.
        """
        embed = self.embed_tokens if self.embed_tokens is not None else self._bound[0]
        embeds = embed(input_ids).to(self.fc.weight.device, self.fc.weight.dtype)  # the target's may sit elsewhere
        if self.version == 1:
            hidden = self.fc(torch.cat([embeds, features], dim=-1))
        else:
            hidden = self.fc(features) if from_target else features
        position_embeddings = self.rotary(hidden, position_ids)
        return self.layer(hidden, embeds, position_embeddings, **{_CACHE_KWARG: cache}, **kwargs)

    def logits(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """`[rows, vocab_size]` logits over the target's vocabulary from head outputs `[rows, hidden]`."""
        if self.version == 1:
            return self._bound[1](hidden)[..., :vocab_size].to(hidden.device)  # the target's head may sit elsewhere
        draft_logits = self.lm_head(self.norm(hidden))
        if self.draft_to_target is None:
            return draft_logits[..., :vocab_size]
        # Tokens outside the draft vocabulary can never be drafted: their logits are -inf.
        logits = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.draft_to_target, draft_logits)


STORAGE_BITS = (4, 8)


def pack_weights(tensors: dict[str, torch.Tensor], config: dict, bits: int,
                 group_size: int = 64) -> tuple[dict[str, torch.Tensor], dict]:
    """Stores a head's matrices in `bits`-bit integers with a float16 scale per `group_size` inputs (symmetric,
    round to nearest); vectors (norm weights, biases) stay as they are: a file about 4x (8 bits) or 7x (4 bits)
    smaller than float32.
    Only the storage changes: `load_eagle_dir` gives float tensors back (`unpack_weights`), and the head computes
    in the target's dtype as before. Returns `(tensors, config)`; the config records what was packed."""
    if bits not in STORAGE_BITS:
        raise ValueError(f"weight storage: bits must be one of {STORAGE_BITS}, got {bits}")
    if group_size < 1:
        raise ValueError(f"weight storage: group_size must be positive, got {group_size}")
    qmax = 2 ** (bits - 1) - 1
    packed, names = {}, []
    for name, tensor in tensors.items():
        if not tensor.is_floating_point() or tensor.dim() != 2:
            packed[name] = tensor
            continue
        rows, cols = tensor.shape
        group = group_size if cols % group_size == 0 else cols  # one group per row where group_size does not divide
        grouped = tensor.float().reshape(rows, cols // group, group)
        scales = (grouped.abs().amax(-1, keepdim=True) / qmax).clamp(min=1e-12).to(torch.float16)
        q = (grouped / scales.float()).round().clamp(-qmax - 1, qmax).to(torch.int8).reshape(rows, cols)
        if bits == 4:  # two per byte, low nibble first
            if cols % 2:
                packed[name] = tensor
                continue
            q = (q + 8).to(torch.uint8).reshape(rows, cols // 2, 2)
            q = q[..., 0] | (q[..., 1] << 4)
        packed[name], packed[f"{name}.scales"] = q, scales.squeeze(-1)
        names.append(name)
    return packed, {**config, "weight_storage": {"bits": bits, "group_size": group_size, "packed": sorted(names)}}


def unpack_weights(tensors: dict[str, torch.Tensor], config: dict, where: str) -> dict[str, torch.Tensor]:
    """Float32 tensors from ones `pack_weights` stored; raises `EagleCheckpointError` if they do not fit."""
    storage = config.get("weight_storage")
    if storage is None:
        return tensors
    bits = storage.get("bits")
    if bits not in STORAGE_BITS:
        raise EagleCheckpointError(f"{where}: weight_storage bits {bits!r} is not one of {STORAGE_BITS}; the config "
                                   "is corrupt or from a newer hf_specdec")
    out = {n: t.float() if t.is_floating_point() else t for n, t in tensors.items() if not n.endswith(".scales")}
    for name in storage["packed"]:
        q, scales = tensors.get(name), tensors.get(f"{name}.scales")
        if q is None or scales is None or q.dim() != 2 or scales.dim() != 2:
            raise EagleCheckpointError(f"{where}: packed tensor {name!r} or its scales are missing or misshapen; "
                                       "the file is truncated or corrupt: write the head again")
        if bits == 4:
            q = torch.stack([(q & 0xF).to(torch.int8) - 8, (q >> 4).to(torch.int8) - 8], dim=-1).flatten(1)
        rows, cols = q.shape
        if scales.shape[0] != rows or cols % scales.shape[1]:
            raise EagleCheckpointError(f"{where}: packed tensor {name!r} has {tuple(q.shape)} values but "
                                       f"{tuple(scales.shape)} scales; the file is corrupt: write the head again")
        out[name] = (q.float().reshape(rows, scales.shape[1], -1) * scales.float()[..., None]).reshape(rows, cols)
    return out


def load_eagle_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Reads and checks a directory in our format; returns `(config, tensors)`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    if not config_file.is_file():
        raise EagleCheckpointError(f"{path} has no {CONFIG_NAME}; convert a published EAGLE checkpoint first with "
                                   "`hf-specdec convert-eagle SRC DST --target TARGET` (or hf_specdec.convert_eagle)")
    config = json.loads(config_file.read_text())
    if config.get("format") != FORMAT or config.get("format_version") != FORMAT_VERSION:
        raise EagleCheckpointError(f"{config_file} is not {FORMAT} version {FORMAT_VERSION}; re-convert the head")
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError) as error:
        raise EagleCheckpointError(f"could not read {weights_file} ({error}); the file is missing, truncated or "
                                   "corrupt: convert the head again") from error
    tensors = unpack_weights(tensors, config, str(weights_file))
    check_tensors(tensors, config, str(weights_file))
    return config, tensors
