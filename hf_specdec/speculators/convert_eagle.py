"""Converts published EAGLE checkpoints (reference layouts) into hf_specdec's EAGLE format.

Reads EAGLE-1/2 heads (`fc` over `[embedding, target feature]`, `layers.0.*` without input norm, no LM head) and
EAGLE-3 heads (`fc` over three target hidden states, `midlayer.*` with 2H-wide q/k/v, `norm`, a reduced-vocabulary
`lm_head` with `d2t`/`t2d`), from `model.safetensors` or `pytorch_model.bin` (unpickled with `weights_only=True` only),
checks every tensor against the target's config, and writes `model.safetensors` plus `eagle_config.json`, which says
which of the target's hidden states the head reads, in transformers' `output_hidden_states` indexing.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import torch

from .eagle import EagleSpeculator
from .heads import (
    CONFIG_NAME,
    FORMAT,
    FORMAT_VERSION,
    HIDDEN_STATES_CONVENTION,
    WEIGHTS_NAME,
    EagleCheckpointError,
    check_tensors,
    load_eagle_dir,
)

logger = logging.getLogger("hf_specdec")

_HEAD_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "rms_norm_eps", "max_position_embeddings", "hidden_act", "attention_bias", "mlp_bias",
                     "rope_parameters", "vocab_size")


def convert_eagle(src: str | Path, dst: str | Path, target=None, *, aux_layers: list[int] | None = None,
                  aux_layer_convention: str = "input", dtype: torch.dtype | None = None) -> Path:
    """Converts an EAGLE-1/2 or EAGLE-3 head into hf_specdec's format (load it with `EagleSpeculator.from_pretrained`).

    Args:
        src (`str` or `Path`): a directory, or a hub id (downloaded), holding `config.json` and `model.safetensors`
            (or sharded `*.safetensors`) or `pytorch_model.bin`.
        dst (`str` or `Path`): the output directory.
        target: the target model the head was trained for: a model id or path, a `PretrainedConfig` or a
            `PreTrainedModel`. Its config fixes the expected shapes and the hidden-state layers.
        aux_layers (`list[int]`, *optional*): EAGLE-3 only: the three target layers whose hidden states `fc` reads.
            Default: the head config's `eagle_aux_hidden_state_layer_ids`, else the reference's `[2, L // 2, L - 3]`.
        aux_layer_convention (`str`): how `aux_layers` (or the config's ids) count: `"input"` (vLLM and the EAGLE
            reference: the input to layer i, transformers' `hidden_states[i]`) or `"output"` (SGLang: the output of
            layer i, i.e. `hidden_states[i + 1]`).
        dtype (`torch.dtype`, *optional*): cast floating-point weights; default keeps the checkpoint's dtype.
    Returns:
        The output directory.
    """
    if aux_layer_convention not in ("input", "output"):
        raise ValueError(f"aux_layer_convention must be 'input' or 'output', got {aux_layer_convention!r}")
    src_dir = _resolve_source(src)
    source_config = _read_json(src_dir / "config.json")
    tensors = _strip_prefix(read_reference_tensors(src_dir))
    target_config = _target_config(target)
    if any(name.startswith("midlayer.") for name in tensors):
        config, converted, names = _convert_eagle3(source_config, tensors, target_config, aux_layers,
                                                   aux_layer_convention)
    elif "fc.weight" in tensors and any(name.startswith("layers.0.") for name in tensors):
        config, converted, names = _convert_eagle1(source_config, tensors, target_config)
    else:
        raise EagleCheckpointError(
            f"{src_dir}: unknown layout (tensors {sorted(tensors)[:6]}...); expected an EAGLE-1/2 head "
            "(fc.weight, layers.0.*) or an EAGLE-3 head (fc.weight, midlayer.*)")
    check_tensors(converted, config, str(src_dir), source_names=names)
    if config["eagle_version"] == 1 and config["head_config"]["hidden_size"] != target_config.hidden_size:
        raise EagleCheckpointError(
            f"{src_dir}: the head's hidden size ({config['head_config']['hidden_size']}) differs from the target's "
            f"({target_config.hidden_size}); an EAGLE-1/2 head runs on the target's own features and LM head, so "
            "it was made for another target model")
    if dtype is not None:
        converted = {n: t.to(dtype) if t.is_floating_point() else t for n, t in converted.items()}
    config["source"] = {"path": str(src), "architectures": source_config.get("architectures")}
    return _write(dst, config, converted)


def read_reference_tensors(src_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: safetensors preferred, else `pytorch_model*.bin` with `weights_only`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(src_dir.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError) as error:
            raise EagleCheckpointError(f"could not read {file} ({error}): the file is truncated or corrupt; "
                                       "download it again") from error
    if files:
        return tensors
    files = sorted(src_dir.glob("pytorch_model*.bin"))
    if not files:
        raise EagleCheckpointError(f"{src_dir} has no model.safetensors or pytorch_model.bin")
    return load_pickled_tensors(files)


def load_pickled_tensors(files: list[Path], error_class: type[Exception] = EagleCheckpointError
                         ) -> dict[str, torch.Tensor]:
    """Tensors from `torch.save` files, read with `weights_only=True`: a pickle that would run code is refused."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
        except pickle.UnpicklingError as error:
            raise error_class(
                f"refused to load {file}: it holds pickled objects other than tensors, which could run code "
                f"({str(error).splitlines()[0]}); get the checkpoint as safetensors or from a source you trust"
            ) from error
        except (RuntimeError, EOFError, OSError) as error:
            raise error_class(f"could not read {file} ({error}): the file is truncated or corrupt; "
                              "download it again") from error
    return tensors


def looks_like_reference_eagle(path: str | Path) -> bool:
    """True for a directory holding an EAGLE checkpoint in a reference layout (not yet converted)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file() or (path / CONFIG_NAME).is_file():
        return False
    config = json.loads(config_file.read_text())
    architectures = " ".join(config.get("architectures") or [])
    if "Eagle" in architectures or "draft_vocab_size" in config:
        return True
    from safetensors import safe_open

    for file in [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]:
        try:
            if file.suffix == ".bin":  # memory-mapped: only the names are read
                names = set(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
            else:
                with safe_open(str(file), "pt") as handle:
                    names = set(handle.keys())
        except Exception:  # unreadable: not for this check to judge; loading it reports the problem
            continue
        if "fc.weight" in names and any(n.startswith(("layers.0.", "midlayer.")) for n in names):
            return True
    return False


def _convert_eagle1(source_config, tensors, target_config):
    num_layers = target_config.num_hidden_layers
    fc_bias = source_config.get("bias", True)  # the reference's default when the key is absent
    converted, names = {}, {}
    for name, tensor in tensors.items():
        if name == "embed_tokens.weight":
            _check_embedding(name, tensor, target_config)
            continue  # a copy of the target's: shared at run time
        ours = "layer." + name[len("layers.0."):] if name.startswith("layers.0.") else name
        converted[ours], names[ours] = tensor, name
    config = _config(1, source_config, target_config, [num_layers], fc_bias=fc_bias)
    config["target_hidden_states"]["note"] = "the target's final hidden state, after its final norm"
    return config, converted, names


def _convert_eagle3(source_config, tensors, target_config, aux_layers, convention):
    num_layers = target_config.num_hidden_layers
    ids = aux_layers if aux_layers is not None else source_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids, convention = [2, num_layers // 2, num_layers - 3], "input"
    else:
        logger.info("EAGLE-3 hidden-state layers %s read as the %s of each layer", list(ids), convention)
    layers = [int(i) + (1 if convention == "output" else 0) for i in ids]
    if len(layers) != 3 or not all(0 <= i < num_layers for i in layers):
        raise EagleCheckpointError(
            f"EAGLE-3 reads three target hidden states; layers {list(ids)} ({convention} convention) do not fit a "
            f"target of {num_layers} layers (each must be the input to a layer, 0 to {num_layers - 1})")
    converted, names = {}, {}
    draft_vocab = tensors["lm_head.weight"].shape[0] if "lm_head.weight" in tensors else None
    hidden = source_config.get("hidden_size")
    own_embeddings = False
    for name, tensor in tensors.items():
        if name == "t2d":
            continue  # checked against d2t below; derivable, not stored
        if name == "embed_tokens.weight":
            if hidden == target_config.hidden_size:
                _check_embedding(name, tensor, target_config)
                continue
            own_embeddings = True
        if name == "d2t":
            if tensor.is_floating_point() or tensor.dtype == torch.bool or tensor.dim() != 1:
                raise EagleCheckpointError(f"tensor 'd2t' must be a 1-D integer tensor, got {tensor.dtype} "
                                           f"{tuple(tensor.shape)}")
            ours, tensor = "draft_to_target", tensor.long() + torch.arange(tensor.shape[0])
        else:
            ours = "layer." + name[len("midlayer."):] if name.startswith("midlayer.") else name
        converted[ours], names[ours] = tensor, name
    if draft_vocab is not None and draft_vocab == target_config.vocab_size and "draft_to_target" in converted:
        if not torch.equal(converted["draft_to_target"], torch.arange(draft_vocab)):
            raise EagleCheckpointError("d2t permutes a full-size draft vocabulary; this is not a supported layout")
        del converted["draft_to_target"]
    _check_vocab_maps(tensors, converted, target_config.vocab_size)
    config = _config(3, source_config, target_config, layers, fc_bias=False)
    config["draft_vocab_size"] = source_config.get("draft_vocab_size", draft_vocab)
    config["own_embeddings"] = own_embeddings
    config["target_hidden_states"]["note"] = "hidden states before the final norm, concatenated low to high"
    return config, converted, names


def _check_vocab_maps(tensors, converted, vocab_size):
    ids = converted.get("draft_to_target")
    if ids is None:
        return
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise EagleCheckpointError(f"tensor 'd2t' maps draft ids outside the target's vocabulary of {vocab_size}")
    if "t2d" in tensors:
        t2d = tensors["t2d"]
        if t2d.shape != (vocab_size,):
            raise EagleCheckpointError(f"tensor 't2d' has shape {tuple(t2d.shape)}, expected ({vocab_size},): the "
                                       "head was made for another target vocabulary")
        expected = torch.zeros(vocab_size, dtype=torch.bool)
        expected[ids] = True
        if not torch.equal(t2d.bool(), expected):
            raise EagleCheckpointError("tensors 'd2t' and 't2d' disagree about the draft vocabulary; the checkpoint "
                                       "is corrupt")


def _check_embedding(name, tensor, target_config):
    expected = (target_config.vocab_size, target_config.hidden_size)
    if tuple(tensor.shape) != expected:
        raise EagleCheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)} but the target's embeddings are "
                                   f"{expected}; the head was made for another target model")


def _config(version, source_config, target_config, layers, fc_bias):
    from transformers import LlamaConfig

    known = set(LlamaConfig().to_dict()) | {"rope_theta", "rope_scaling"}
    head = LlamaConfig(**{k: v for k, v in source_config.items() if k in known}).to_dict()
    head_config = {k: head[k] for k in _HEAD_CONFIG_KEYS if head.get(k) is not None}
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "eagle_version": version,
        "fc_bias": bool(fc_bias),
        "head_config": head_config,
        "target": {"hidden_size": target_config.hidden_size, "vocab_size": target_config.vocab_size,
                   "num_hidden_layers": target_config.num_hidden_layers,
                   "name_or_path": getattr(target_config, "_name_or_path", "") or ""},
        "target_hidden_states": {"layers": list(layers), "convention": HIDDEN_STATES_CONVENTION},
    }


def _write(dst, config, tensors) -> Path:
    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(dst / WEIGHTS_NAME),
              metadata={"format": FORMAT})
    (dst / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    load_eagle_dir(dst)  # what we wrote must load
    return dst


def _strip_prefix(tensors):
    # Some re-publications prefix every name with "model." (SGLang-style); the layout is otherwise the same.
    if tensors and all(n.startswith("model.") or n.startswith("lm_head.") for n in tensors):
        return {n[len("model."):] if n.startswith("model.") else n: t for n, t in tensors.items()}
    return tensors


def _resolve_source(src) -> Path:
    path = Path(src)
    if path.is_dir():
        return path
    if path.exists() or str(src).startswith((".", "/")) or str(src).count("/") != 1:
        raise EagleCheckpointError(f"{src} is not a directory holding an EAGLE checkpoint, nor a hub id")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(src), allow_patterns=["*.json", "*.safetensors", "*.bin"]))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise EagleCheckpointError(f"{path.parent} has no config.json; an EAGLE checkpoint needs the head's config")
    return json.loads(path.read_text())


def _target_config(target):
    from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

    if target is None:
        raise ValueError("convert_eagle needs target= (the target model's id, path, config or model): the head's "
                         "shapes are checked against it and its layer count fixes which hidden states are read")
    if isinstance(target, PreTrainedModel):
        target = target.config
    elif not isinstance(target, PretrainedConfig):
        target = AutoConfig.from_pretrained(str(target))
    return target.get_text_config()


def eagle_speculator_from_dir(path) -> EagleSpeculator | None:
    """An `EagleSpeculator` when `path` is a converted EAGLE head, `None` when it is no EAGLE head at all; an
    EAGLE checkpoint still in a reference layout raises, saying how to convert it."""
    if not isinstance(path, (str, Path)) or not Path(path).is_dir():
        return None
    if (Path(path) / CONFIG_NAME).is_file():
        return EagleSpeculator.from_pretrained(path)
    if looks_like_reference_eagle(path):
        raise EagleCheckpointError(
            f"{path} holds an EAGLE head in a reference layout; convert it first: `hf-specdec convert-eagle {path} "
            "DST --target TARGET` (or hf_specdec.convert_eagle), then pass DST")
    return None
