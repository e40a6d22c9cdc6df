"""One conversion path for draft heads: EAGLE, MLP speculators (ibm-fms accelerators) and Medusa heads.

`convert_head` detects the layout of a published checkpoint and writes our format: EAGLE heads go through
`convert_eagle` (`eagle_config.json`); MLP speculators and Medusa heads become `model.safetensors` plus
`head_config.json`, which states the kind, the head's hyper-parameters, the target it was checked against and which
target hidden state it reads (transformers' `output_hidden_states` index: the final, normed state). Reference layouts
read (see docs/eagle.md):
- MLP speculator (`model_type` `mlp_speculator`): `speculator.{emb,proj,head}.{i}.weight`, `speculator.ln.{i}.{weight,
  bias}` (the `speculator.` prefix optional; with `tie_weights` only the distinct stages may be stored).
- Medusa-1 (`medusa_lm_head.pt` / `.safetensors`): `{i}.{j}.linear.{weight,bias}` blocks and `{i}.{L}.weight` LM
  heads; Medusa-2 checkpoints prefix them with `medusa_head.` beside the base model's weights (skipped).
- vLLM's Medusa: `blocks.{i}.layers.{j}.{weight,bias}`, `lm_heads.{i}.weight` (prefix `medusa_heads.` optional),
  `token_map` with `truncated_vocab_size`, a single LM head with `original_lm_head`.
Pickled files are read with `torch.load(weights_only=True)` only.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from .convert_eagle import (
    _read_json,
    _resolve_source,
    _target_config,
    convert_eagle,
    eagle_speculator_from_dir,
    load_pickled_tensors,
    looks_like_reference_eagle,
    read_reference_tensors,
)
from .head_format import CONFIG_NAME, FORMAT, FORMAT_VERSION, HeadCheckpointError, check_tensors, load_head_dir
from .heads import HIDDEN_STATES_CONVENTION, WEIGHTS_NAME, EagleCheckpointError
from .medusa import MedusaSpeculator
from .mlp import MlpSpeculator

logger = logging.getLogger("hf_specdec")

KINDS = {cls.kind: cls for cls in (MlpSpeculator, MedusaSpeculator)}


def convert_head(src: str | Path, dst: str | Path, target=None, *, dtype: torch.dtype | None = None,
                 **eagle_options) -> Path:
    """Converts an EAGLE head, an MLP speculator or Medusa heads into hf_specdec's format, detecting the layout.

    Load the result with `EagleSpeculator`, `MlpSpeculator` or `MedusaSpeculator.from_pretrained`, or give the
    directory as the pipeline's `assistant=` (detected).

    Args:
        src (`str` or `Path`): a directory, or a hub id (downloaded), holding the checkpoint and its `config.json`.
        dst (`str` or `Path`): the output directory.
        target: the target model the head was trained for (model id or path, `PretrainedConfig` or
            `PreTrainedModel`); every tensor's shape is checked against it.
        dtype (`torch.dtype`, *optional*): cast floating-point weights; default keeps the checkpoint's dtype.
        eagle_options: EAGLE-3 only: `aux_layers`, `aux_layer_convention` (see `convert_eagle`).
    Returns:
        The output directory.
    """
    src_dir = _resolve_source(src)
    kind = detect_layout(src_dir)
    if kind == "eagle":
        return convert_eagle(src, dst, target, dtype=dtype, **eagle_options)
    if eagle_options:
        raise ValueError(f"{sorted(eagle_options)} apply to EAGLE-3 heads only; {src_dir} holds a {kind} head")
    source_config = _read_json(src_dir / "config.json")
    target_config = _target_config(target)
    tensors = read_tensors(src_dir)
    convert = _convert_mlp if kind == "mlp_speculator" else _convert_medusa
    config, converted, names = convert(source_config, tensors, target_config, str(src_dir))
    check_tensors(converted, config, str(src_dir), KINDS[config["kind"]].expected_tensors, names)
    if dtype is not None:
        converted = {n: t.to(dtype) if t.is_floating_point() else t for n, t in converted.items()}
    config["source"] = {"path": str(src), "architectures": source_config.get("architectures")}
    return _write(dst, config, converted)


def detect_layout(src_dir: Path) -> str:
    """`"eagle"`, `"mlp_speculator"` or `"medusa"` for a checkpoint directory in a reference layout."""
    config_file = src_dir / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    architectures = " ".join(config.get("architectures") or [])
    if config.get("model_type") == "mlp_speculator" or "MLPSpeculator" in architectures:
        return "mlp_speculator"
    if "medusa_num_heads" in config or config.get("model_type") == "medusa" or "Medusa" in architectures:
        return "medusa"
    if looks_like_reference_eagle(src_dir):
        return "eagle"
    names = set(_tensor_names(src_dir))
    if {"emb.0.weight", "proj.0.weight"} <= {n.removeprefix("speculator.") for n in names}:
        return "mlp_speculator"
    if any(_MEDUSA_NAME.fullmatch(n) or _VLLM_MEDUSA_NAME.fullmatch(n) for n in names):
        return "medusa"
    raise HeadCheckpointError(
        f"{src_dir}: unknown layout (config model_type {config.get('model_type')!r}, tensors "
        f"{sorted(names)[:6]}...); expected an EAGLE-1/2 or EAGLE-3 head, an MLP speculator (model_type "
        "'mlp_speculator', speculator.emb/proj/head/ln.*) or Medusa heads (medusa_num_heads in config, "
        "{i}.{j}.linear.* or blocks.{i}.layers.{j}.*)")


def read_tensors(src_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: safetensors, `pytorch_model*.bin`, else Medusa's `*.pt`."""
    if any(src_dir.glob("*.safetensors")) or any(src_dir.glob("pytorch_model*.bin")):
        try:
            return read_reference_tensors(src_dir)
        except HeadCheckpointError:
            raise
        except EagleCheckpointError as error:
            raise HeadCheckpointError(str(error)) from error
    files = sorted(src_dir.glob("*.pt"))
    if not files:
        raise HeadCheckpointError(f"{src_dir} has no *.safetensors, pytorch_model*.bin or medusa_lm_head.pt")
    return load_pickled_tensors(files, HeadCheckpointError)


def _tensor_names(src_dir: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for file in [*src_dir.glob("*.safetensors"), *src_dir.glob("pytorch_model*.bin"), *src_dir.glob("*.pt")]:
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), "pt") as handle:
                    names += list(handle.keys())
            else:  # memory-mapped: only the names are read
                names += list(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
        except Exception:  # unreadable: not for detection to judge; reading it reports the problem
            continue
    return names


# --- MLP speculators -------------------------------------------------------------------------------------------------
def _convert_mlp(source_config, tensors, target_config, where):
    names = {n.removeprefix("speculator."): n for n in tensors}
    tensors = {n.removeprefix("speculator."): t for n, t in tensors.items()}
    emb_dim = source_config.get("emb_dim", target_config.hidden_size)
    vocab = source_config.get("vocab_size", target_config.vocab_size)
    if "n_predict" not in source_config:
        raise HeadCheckpointError(f"{where}/config.json has no n_predict; an MLP speculator's config states its "
                                  "number of stages")
    _check_target(where, "emb_dim", emb_dim, "hidden_size", target_config.hidden_size)
    _check_target(where, "vocab_size", vocab, "vocab_size", target_config.vocab_size)
    section = {"n_predict": int(source_config["n_predict"]), "emb_dim": emb_dim,
               "inner_dim": source_config.get("inner_dim") or emb_dim, "vocab_size": vocab,
               "tie_weights": bool(source_config.get("tie_weights", False)),
               "scale_input": bool(source_config.get("scale_input", False)),
               "top_k_tokens_per_head": source_config.get("top_k_tokens_per_head")}
    config = _config("mlp_speculator", section, target_config)
    if section["tie_weights"]:
        tensors = _untie(tensors, MlpSpeculator.expected_tensors(config), where)
    prefix = "speculator." if any(n.startswith("speculator.") for n in names.values()) else ""
    return config, tensors, {n: prefix + n for n in MlpSpeculator.expected_tensors(config)} | names


def _untie(tensors, expected, where):
    """Drops the copies a tied checkpoint may store for every stage, after checking they are copies."""
    kept = {}
    for name, tensor in tensors.items():
        match = re.fullmatch(r"(emb|head|ln|proj)\.(\d+)\.(weight|bias)", name)
        if match is None or name in expected:
            kept[name] = tensor
            continue
        group, index, leaf = match.groups()
        shared = f"{group}.{1 if group == 'proj' and int(index) > 0 else 0}.{leaf}"
        if shared not in tensors or not torch.equal(tensors[shared], tensor):
            raise HeadCheckpointError(f"{where}: the config sets tie_weights but tensor 'speculator.{name}' is not a "
                                      f"copy of 'speculator.{shared}'; the checkpoint is inconsistent")
    return kept


# --- Medusa ----------------------------------------------------------------------------------------------------------
_MEDUSA_NAME = re.compile(r"(?:medusa_head\.)?(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)")
_VLLM_MEDUSA_NAME = re.compile(r"(?:medusa_heads\.)?(?:blocks\.(\d+)\.layers\.(\d+)|lm_heads\.(\d+))\.(weight|bias)")


def _convert_medusa(source_config, tensors, target_config, where):
    vllm_style = any(_VLLM_MEDUSA_NAME.fullmatch(n) for n in tensors)
    num_heads = source_config.get("medusa_num_heads", source_config.get("num_heads"))
    num_layers = source_config.get("medusa_num_layers", source_config.get("num_hidden_layers", 1))
    if num_heads is None:
        raise HeadCheckpointError(f"{where}/config.json states no medusa_num_heads (or num_heads)")
    converted, names, skipped = {}, {"draft_to_target": "token_map"}, []
    for name, tensor in tensors.items():
        ours = _medusa_name(name, num_layers, vllm_style)
        if ours is None and name.startswith(("model.", "lm_head.")) and not vllm_style:
            skipped.append(name)  # a Medusa-2 checkpoint's base model: the target itself
            continue
        ours = ours or name
        converted[ours], names[ours] = tensor, name
    if skipped:
        logger.info("%s: skipped %d base-model tensors; the target must be the model these heads were trained with",
                    where, len(skipped))
    shared = bool(source_config.get("original_lm_head", False))
    if shared and "lm_heads.0.weight" in converted:
        converted["lm_head.weight"] = converted.pop("lm_heads.0.weight")
        names["lm_head.weight"] = names.pop("lm_heads.0.weight")
    draft_vocab = source_config.get("truncated_vocab_size") or target_config.vocab_size
    if "token_map" in converted:
        token_map = converted.pop("token_map")
        if token_map.is_floating_point() or token_map.dim() != 1:
            raise HeadCheckpointError(f"{where}: tensor 'token_map' must be a 1-D integer tensor, got "
                                      f"{token_map.dtype} {tuple(token_map.shape)}")
        if draft_vocab != target_config.vocab_size:
            if token_map.min() < 0 or token_map.max() >= target_config.vocab_size:
                raise HeadCheckpointError(f"{where}: tensor 'token_map' maps ids outside the target's vocabulary "
                                          f"of {target_config.vocab_size}")
            converted["draft_to_target"], names["draft_to_target"] = token_map.long(), "token_map"
    fc_bias = source_config.get("medusa_fc_bias", False) if vllm_style else True  # Medusa's ResBlock has a bias
    section = {"num_heads": int(num_heads), "num_layers": int(num_layers), "hidden_size": target_config.hidden_size,
               "fc_bias": bool(fc_bias), "shared_lm_head": shared, "draft_vocab_size": int(draft_vocab)}
    config = _config("medusa", section, target_config)
    prefix = next((p for p in ("medusa_head.", "medusa_heads.") if any(n.startswith(p) for n in tensors)), "")
    spelled = {ours: _medusa_source_name(ours, num_layers, vllm_style, prefix)
               for ours in MedusaSpeculator.expected_tensors(config)}
    return config, converted, spelled | names


def _medusa_source_name(ours: str, num_layers: int, vllm_style: bool, prefix: str) -> str:
    """How a reference checkpoint of this style spells one of our tensor names (for errors about missing ones)."""
    parts = ours.split(".")
    if ours == "draft_to_target":
        return "token_map"
    if parts[0] == "blocks":
        return prefix + (f"blocks.{parts[1]}.layers.{parts[2]}.{parts[3]}" if vllm_style
                         else f"{parts[1]}.{parts[2]}.linear.{parts[3]}")
    index = parts[1] if parts[0] == "lm_heads" else "0"
    return prefix + (f"lm_heads.{index}.weight" if vllm_style else f"{index}.{num_layers}.weight")


def _medusa_name(name: str, num_layers: int, vllm_style: bool) -> str | None:
    if vllm_style:
        match = _VLLM_MEDUSA_NAME.fullmatch(name)
        if match is None:
            return name.removeprefix("medusa_heads.")
        head, layer, lm_index, leaf = match.groups()
        return f"lm_heads.{lm_index}.{leaf}" if lm_index is not None else f"blocks.{head}.{layer}.{leaf}"
    match = _MEDUSA_NAME.fullmatch(name)
    if match is None:
        return None
    head, layer, leaf = match.groups()
    if int(layer) == num_layers and ".linear." not in name:  # the head's last module: its LM head
        return f"lm_heads.{head}.{leaf}"
    return f"blocks.{head}.{layer}.{leaf}" if ".linear." in name else None


# --- our format ------------------------------------------------------------------------------------------------------
def _check_target(where, key, value, target_key, target_value):
    if value != target_value:
        raise HeadCheckpointError(f"{where}: the head's {key} is {value} but the target's {target_key} is "
                                  f"{target_value}; the head was made for another target model")


def _config(kind: str, section: dict, target_config) -> dict:
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind, kind: section,
        "target": {"hidden_size": target_config.hidden_size, "vocab_size": target_config.vocab_size,
                   "num_hidden_layers": target_config.num_hidden_layers,
                   "name_or_path": getattr(target_config, "_name_or_path", "") or ""},
        "target_hidden_states": {"layers": [target_config.num_hidden_layers], "convention": HIDDEN_STATES_CONVENTION,
                                 "note": "the target's final hidden state, after its final norm"},
    }


def _write(dst, config, tensors) -> Path:
    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(dst / WEIGHTS_NAME), metadata={"format": FORMAT})
    (dst / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    load_head_dir(dst, config["kind"], KINDS[config["kind"]].expected_tensors)  # what we wrote must load
    return dst


def head_speculator_from_dir(path):
    """The speculator for a converted head directory (EAGLE, MLP speculator or Medusa), `None` when `path` is no
    head at all; a head still in a reference layout raises, saying how to convert it."""
    if not isinstance(path, (str, Path)) or not Path(path).is_dir():
        return None
    if (Path(path) / CONFIG_NAME).is_file():
        kind = json.loads((Path(path) / CONFIG_NAME).read_text()).get("kind")
        if kind not in KINDS:
            load_head_dir(path, kind, lambda config: {})  # raises, naming what is wrong with the directory
        return KINDS[kind].from_pretrained(path)
    eagle = eagle_speculator_from_dir(path)  # converted EAGLE heads; raises for unconverted ones
    if eagle is not None:
        return eagle
    if (Path(path) / "config.json").is_file():
        try:
            kind = detect_layout(Path(path))
        except HeadCheckpointError:
            return None  # not a head: a draft model, say
        raise HeadCheckpointError(
            f"{path} holds a {kind} head in a reference layout; convert it first: `hf-specdec convert-head {path} "
            "DST --target TARGET` (or hf_specdec.convert_head), then pass DST")
    return None
