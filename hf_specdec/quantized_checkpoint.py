"""Checks a pre-quantized checkpoint's structure before transformers loads it: the quantization its config
declares, and every tensor the model needs present with the shape and dtype its format prescribes (GPTQ, FP8),
read from the safetensors headers alone. A truncated, incomplete or mismatched checkpoint is then an error naming
the tensor, rather than randomly initialised layers."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

logger = logging.getLogger("hf_specdec")

_FLOAT_DTYPES = {"F16", "BF16", "F32"}


class QuantizedCheckpointError(ValueError):
    """A pre-quantized checkpoint is truncated, incomplete, or has tensors of the wrong shape or dtype."""


def checkpoint_quantization(config) -> str | None:
    """The quantization a checkpoint's config declares (`"gptq"`, `"fp8"`, `"int8"`, `"nf4"`, or the method's
    own name for others), or `None` for a full-precision checkpoint."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
        if weights and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
            return "fp8"
        return "compressed-tensors"
    if method == "bitsandbytes":
        return "int8" if qc.get("load_in_8bit") else "nf4" if qc.get("bnb_4bit_quant_type") == "nf4" else method
    return method


def check_quantized_checkpoint(path: str | Path) -> None:
    """Checks a pre-quantized checkpoint's tensors against its config before loading it.

    Reads only the safetensors headers. Every parameter of the model its config describes must be present (a
    quantized linear layer as its packed tensors), with the shapes and dtypes its quantization format prescribes.

    Raises:
        `QuantizedCheckpointError`: a truncated or unreadable file, a pickle checkpoint, a missing tensor, or a
            tensor of the wrong shape or dtype; the message names the tensor and what was expected.
    """
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    method = checkpoint_quantization(config)
    tensors = _read_headers(path)
    linears, expected = expected_layout(config)
    if not expected & tensors.keys():
        logger.warning("hf_specdec: %s names its tensors in a layout we do not check; loading it unchecked", path)
        return
    qc = config.quantization_config if isinstance(config.quantization_config, dict) \
        else config.quantization_config.to_dict()
    quantized = set()
    if method == "gptq":
        quantized = _check_gptq(tensors, linears, qc)
    elif method == "fp8":
        quantized = _check_fp8(tensors, linears, qc)
    missing = sorted(k for k in expected - tensors.keys() if k.rsplit(".", 1)[0] not in quantized)
    if missing:
        raise QuantizedCheckpointError(
            f"{path} lacks {len(missing)} tensors its config needs (first: {missing[:3]}); the checkpoint is "
            "incomplete or truncated (a missing shard?): download it again")


def _read_headers(path: Path) -> dict[str, tuple[list[int], str]]:
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        raise QuantizedCheckpointError(
            f"{path} has no .safetensors weights" + (f" (only pickle files {pickles}, which can run code when "
                                                     "loaded; convert them to safetensors)" if pickles else ""))
    tensors = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    tensors[key] = (list(piece.get_shape()), piece.get_dtype())
        except (SafetensorError, OSError) as error:
            raise QuantizedCheckpointError(f"{file} is truncated or corrupt ({error}); download it again") from error
    return tensors


def expected_layout(config) -> tuple[dict[str, tuple[int, int]], set[str]]:
    """`{linear name: (out_features, in_features)}` and the parameter names of the model `config` describes."""
    from transformers import AutoModelForCausalLM

    config = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linears = {name: (m.out_features, m.in_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)}
    tied = {"lm_head.weight"} if getattr(config.get_text_config(), "tie_word_embeddings", False) else set()
    return linears, {k for k in model.state_dict()} - tied


def _expect(tensors, name: str, shape: list[int], dtypes: set[str], why: str) -> None:
    if name not in tensors:
        raise QuantizedCheckpointError(f"{name} is missing: {why} needs it; the checkpoint is incomplete")
    got_shape, got_dtype = tensors[name]
    if got_shape != shape:
        raise QuantizedCheckpointError(f"{name} has shape {got_shape}, but {why} needs {shape}; the checkpoint does "
                                       "not match its config.json (wrong bits or group size, or another model)")
    if got_dtype not in dtypes:
        raise QuantizedCheckpointError(f"{name} has dtype {got_dtype}, but {why} needs one of {sorted(dtypes)}")


def _check_gptq(tensors, linears, qc) -> set[str]:
    bits, group_size = qc.get("bits", 4), qc.get("group_size", 128)
    if bits not in (2, 3, 4, 8):
        raise QuantizedCheckpointError(f"GPTQ bits={bits} in config.json; GPTQ packs 2, 3, 4 or 8 bits")
    quantized = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".qweight")}
    for name in sorted(quantized):
        if name not in linears:
            raise QuantizedCheckpointError(f"{name}.qweight belongs to no linear layer of the model in config.json")
        out_features, in_features = linears[name]
        num_groups = -(-in_features // group_size) if group_size > 0 else 1
        why = f"a {bits}-bit GPTQ layer with {in_features} inputs, {out_features} outputs and group size {group_size}"
        _expect(tensors, f"{name}.qweight", [in_features * bits // 32, out_features], {"I32"}, why)
        _expect(tensors, f"{name}.qzeros", [num_groups, out_features * bits // 32], {"I32"}, why)
        _expect(tensors, f"{name}.scales", [num_groups, out_features], _FLOAT_DTYPES, why)
        if f"{name}.g_idx" in tensors:
            _expect(tensors, f"{name}.g_idx", [in_features], {"I32"}, why)
    return quantized


def _check_fp8(tensors, linears, qc) -> set[str]:
    ignore = [pattern for pattern in qc.get("ignore") or []]

    def ignored(name: str) -> bool:
        return any(re.fullmatch(p[3:], name) if p.startswith("re:") else name == p or name.endswith("." + p)
                   for p in ignore)

    quantized = set()
    for name, (out_features, in_features) in linears.items():
        if ignored(name) or f"{name}.weight" not in tensors:
            continue
        why = f"an FP8 (e4m3) layer with {in_features} inputs and {out_features} outputs"
        _expect(tensors, f"{name}.weight", [out_features, in_features], {"F8_E4M3"}, why)
        scale_shape = tensors.get(f"{name}.weight_scale", ([out_features, 1], ""))[0]
        if scale_shape not in ([out_features, 1], [1], []):  # per channel or per tensor
            scale_shape = [out_features, 1]
        _expect(tensors, f"{name}.weight_scale", scale_shape, _FLOAT_DTYPES, why + " and per-channel scales")
        quantized.add(name)
    return quantized
