"""Quantized drafts: a draft quantized as it loads (`fp8`, `int8`, `nf4`, `gptq`), or a pre-quantized checkpoint.

Everything goes through transformers' quantizer integrations and the libraries behind them: torchao for FP8,
bitsandbytes for int8 and nf4, optimum with gptqmodel for GPTQ, compressed-tensors for FP8 checkpoints. We write no
quantizer of our own. What we add: checks that the requested quantization can run on this hardware (refused with an
error naming what it needs, never replaced by full precision), a calibration set for GPTQ, and a structural check
of pre-quantized checkpoints (truncated files, missing tensors, wrong shapes or dtypes) before transformers loads
them (`quantized_checkpoint`), so a bad checkpoint is an error rather than randomly initialised layers.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from .quantized_checkpoint import check_quantized_checkpoint, checkpoint_quantization, expected_layout
from .workloads import GROUNDED, OPEN_CHAT, chat_inputs

logger = logging.getLogger("hf_specdec")

QUANTIZATIONS = ("fp8", "int8", "nf4", "gptq")
_INSTALL = "pip install 'hf_specdec[quant]'"


class QuantizationUnavailableError(RuntimeError):
    """The requested quantization cannot run here; the message names what it needs."""


def load_draft(path_or_model, quantization: str | None = None, *, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None, calibration: str | list[str] | None = None,
               tokenizer=None, target=None, bits: int = 4, group_size: int | None = None):
    """Loads a draft model, quantized as it loads or as its checkpoint already is.

    Args:
        path_or_model (`str`, `os.PathLike` or `PreTrainedModel`): a checkpoint directory or hub id, or a model
            already in memory (quantized from a temporary copy; the model passed in is left as it is).
            Pre-quantized checkpoints (GPTQ, compressed-tensors FP8) are recognised from their `config.json`.
        quantization (`str`, *optional*): `None` (the checkpoint as it is), `"fp8"` (e4m3 weights with per-channel
            scales through torchao: weight-only on CPUs and on GPUs without FP8 units, FP8 matrix multiplies on
            GPUs of compute capability 8.9 or newer), `"int8"` or `"nf4"` (bitsandbytes), `"gptq"` (optimum with
            gptqmodel, calibrated on `calibration`). For a pre-quantized checkpoint it must be `None` or its own
            method.
        dtype (`torch.dtype`, *optional*): dtype of the unquantized parts and of the compute.
        device (`str` or `torch.device`, *optional*): where to load the draft (default: CPU).
        calibration (`str` or `list[str]`, *optional*): GPTQ calibration texts, or the path of a text file whose
            blank-line separated paragraphs are the texts. Without it, `target` and `tokenizer` draw the texts from
            the target's own greedy generations on hf_specdec's built-in prompts.
        tokenizer (*optional*): the draft's tokenizer, for GPTQ calibration (loaded from the checkpoint if absent).
        target (`PreTrainedModel`, *optional*): the target, to generate calibration texts from.
        bits (`int`): GPTQ bits (2, 3, 4 or 8).
        group_size (`int`, *optional*): GPTQ group size (`-1`: one group per row). By default the largest of 128,
            64, 32, 16 that divides every layer's input size (gptqmodel's CPU kernel needs that; 576-wide models
            such as SmolLM2 get 64).

    Returns:
        `PreTrainedModel`: the draft, in eval mode, ready for `generate(..., speculator=draft)`.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {list(QUANTIZATIONS)} or None")
    if not isinstance(path_or_model, (str, Path)):
        if quantization is None:
            return path_or_model
        with tempfile.TemporaryDirectory(prefix="hf_specdec_draft_") as tmp:
            _save_copy(path_or_model, tmp)
            return load_draft(tmp, quantization, dtype=dtype or path_or_model.dtype, device=device,
                              calibration=calibration, tokenizer=tokenizer, target=target, bits=bits,
                              group_size=group_size)
    from transformers import AutoConfig, AutoModelForCausalLM

    path = str(path_or_model)
    config = AutoConfig.from_pretrained(path)
    existing = checkpoint_quantization(config)
    kwargs = dict(dtype=dtype, device_map=str(device) if device is not None else "cpu")
    if existing is not None:
        if quantization not in (None, existing):
            raise ValueError(f"{path} is already quantized ({existing}); pass quantization=None (or {existing!r}) to "
                             f"load it as it is, or quantize its full-precision original with {quantization!r}")
        if Path(path).is_dir():  # a broken file is named first, whatever libraries are installed
            check_quantized_checkpoint(path)
        _require_checkpoint_libraries(config)
        if existing == "fp8":
            kwargs["quantization_config"] = _fp8_checkpoint_config(device, path)
        logger.info("hf_specdec: loading the %s checkpoint %s as it is", existing, path)
    elif quantization is not None:
        kwargs["quantization_config"] = quantization_config(
            quantization, device, calibration=calibration, tokenizer=tokenizer, target=target, path=path,
            bits=bits, group_size=group_size)
    with warnings.catch_warnings():  # our loading attributes for a quantized checkpoint are deliberate
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()


def _fp8_checkpoint_config(device, path: str):
    """FP8 matmuls where the GPU has them; elsewhere the FP8 weights are dequantized once, at load, and said so."""
    from transformers import CompressedTensorsConfig

    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        return CompressedTensorsConfig(use_optimized_inference=True)
    logger.warning("hf_specdec: %s has FP8 weights and %s has no FP8 matrix multiply: they are dequantized at load "
                   "(the FP8 rounding stays, compute and memory are those of the unquantized dtype). FP8 matmuls "
                   "need a CUDA GPU of compute capability 8.9 or newer", path, device)
    return CompressedTensorsConfig(dequantize=True)


def quantization_config(quantization: str, device=None, *, calibration=None, tokenizer=None, target=None,
                        path: str | None = None, bits: int = 4, group_size: int | None = None):
    """The transformers quantization config for `quantization` on `device`, after checking it can run there.

    Raises:
        `QuantizationUnavailableError`: the library is missing or cannot run this quantization on this hardware.
    """
    device = torch.device(device if device is not None else "cpu")
    if device.type not in ("cpu", "cuda"):
        raise QuantizationUnavailableError(f"quantization={quantization!r} runs on a CPU or a CUDA GPU here, not on "
                                           f"{device.type}; load the draft on 'cpu' or 'cuda'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise QuantizationUnavailableError(f"quantization={quantization!r} on {device} needs a CUDA GPU, and torch "
                                           "sees none; pass device='cpu'")
    if quantization == "fp8":
        return _fp8_config(device)
    if quantization in ("int8", "nf4"):
        return _bnb_config(quantization, device)
    return _gptq_config(device, calibration, tokenizer, target, path, bits, group_size)


def _fp8_config(device: torch.device):
    _require("torchao", "quantization='fp8'")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Float8WeightOnlyConfig, PerRow
    from transformers import TorchAoConfig

    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        # FP8 tensor cores: activations are quantized per row on the fly and the matmul runs in FP8.
        return TorchAoConfig(Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return TorchAoConfig(Float8WeightOnlyConfig())


def _bnb_config(quantization: str, device: torch.device):
    _require("bitsandbytes", f"quantization={quantization!r}")
    import bitsandbytes.functional as bnb_functional
    from transformers import BitsAndBytesConfig

    probe = torch.randn(64, 64, device=device, dtype=torch.float16)
    try:  # bitsandbytes' backends differ by device and version: ask it rather than guess
        if quantization == "int8":
            bnb_functional.int8_vectorwise_quant(probe)
        else:
            bnb_functional.quantize_4bit(probe, quant_type="nf4")
    except (RuntimeError, NotImplementedError, AttributeError) as error:
        raise QuantizationUnavailableError(
            f"bitsandbytes cannot run {quantization} on {device} here ({error}); it needs a CUDA GPU, or "
            "bitsandbytes >= 0.49 for its CPU backend (x86-64 or aarch64)") from error
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=torch.float16 if device.type == "cuda" else torch.float32)


def _gptq_config(device, calibration, tokenizer, target, path, bits, group_size):
    _require_gptq("quantization='gptq'")
    if device.type == "cpu" and shutil.which("c++") is None and shutil.which("g++") is None:
        raise QuantizationUnavailableError("quantization='gptq' on a CPU needs a C++ compiler: gptqmodel builds its "
                                           "CPU packing extension on first use (e.g. apt-get install g++)")
    from transformers import AutoTokenizer, GPTQConfig

    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as error:
            raise ValueError(f"quantization='gptq' needs the draft's tokenizer for calibration, and none loads "
                             f"from {path}; pass tokenizer=") from error
    texts = calibration_texts(calibration, tokenizer, target)
    group_size = _gptq_group_size(path, group_size, device)
    return GPTQConfig(bits=bits, group_size=group_size, dataset=texts, tokenizer=tokenizer, desc_act=False)


def _gptq_group_size(path: str, group_size: int | None, device: torch.device) -> int:
    from transformers import AutoConfig

    inputs = {in_features for _, in_features in expected_layout(AutoConfig.from_pretrained(path))[0].values()}
    if group_size is None:
        return next((g for g in (128, 64, 32, 16) if all(n % g == 0 for n in inputs)), -1)
    uneven = sorted(n for n in inputs if n % group_size) if group_size > 0 else []
    if uneven and device.type == "cpu":
        raise QuantizationUnavailableError(
            f"GPTQ with group_size={group_size} cannot run on a CPU for this model: gptqmodel's CPU kernel needs every "
            f"layer's input size to be a multiple of the group size, and {uneven} are not; pass a group_size that "
            "divides them, or leave it unset")
    return group_size


def calibration_texts(calibration: str | list[str] | None, tokenizer=None, target=None, num_prompts: int = 8,
                      max_new_tokens: int = 64) -> list[str]:
    """GPTQ calibration texts: the given list, a text file's paragraphs, or the target's own generations.

    Args:
        calibration: a list of texts, the path of a text file (paragraphs separated by blank lines), or `None`.
        tokenizer: the target's tokenizer (needed when `calibration` is `None`).
        target: the target model; with `calibration=None` it continues hf_specdec's built-in prompts greedily and
            each prompt with its continuation becomes one text.

    Returns:
        `list[str]`: the non-empty texts.
    """
    if isinstance(calibration, (str, Path)):
        file = Path(calibration)
        if not file.is_file():
            raise ValueError(f"calibration={str(calibration)!r} is not a file; pass a text file's path or a list of "
                             "strings")
        texts = [p.strip() for p in re.split(r"\n\s*\n", file.read_text(encoding="utf-8")) if p.strip()]
    elif calibration is not None:
        texts = [t for t in calibration if t.strip()]
    elif target is not None and tokenizer is not None:
        texts = _target_generations(target, tokenizer, num_prompts, max_new_tokens)
    else:
        raise ValueError("quantization='gptq' needs calibration texts: pass calibration= (a list of strings or a "
                         "text file), or target= and tokenizer= to draw them from the target's own generations")
    if not texts:
        raise ValueError("the GPTQ calibration set is empty; give at least one non-empty text")
    return texts


def _target_generations(target, tokenizer, num_prompts: int, max_new_tokens: int) -> list[str]:
    prompts = (list(OPEN_CHAT.values()) + list(GROUNDED.values()))[:num_prompts]
    texts = []
    for prompt in prompts:  # one at a time: no padding tokens in the texts
        inputs = chat_inputs(tokenizer, [prompt]).to(target.device)
        out = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        texts.append(tokenizer.decode(out[0], skip_special_tokens=True))
    return texts


def _require(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise QuantizationUnavailableError(f"{what} needs the {module} package, which is not installed; {_INSTALL} "
                                           f"(or pip install {module})")


def _require_gptq(what: str) -> None:
    for module in ("optimum", "gptqmodel"):
        if importlib.util.find_spec(module) is None:
            raise QuantizationUnavailableError(
                f"{what} needs optimum and gptqmodel (transformers' GPTQ backend; its torch kernels run on CPUs), "
                f"and {module} is not installed; pip install 'hf_specdec[gptq]' (gptqmodel pins numpy==2.2.6; "
                "`pip install --no-deps gptqmodel` plus its other requirements keeps your numpy)")


def _require_checkpoint_libraries(config) -> None:
    method = checkpoint_quantization(config)
    if method == "gptq":
        _require_gptq("loading a GPTQ checkpoint")
    elif method in ("fp8", "compressed-tensors"):
        _require("compressed_tensors", "loading a compressed-tensors checkpoint")


def _save_copy(model, directory: str) -> None:
    """Writes a model's config and weights as safetensors (works for models loaded from GGUF files too)."""
    from safetensors.torch import save_model

    model.config.save_pretrained(directory)
    config_file = Path(directory) / "config.json"
    config = json.loads(config_file.read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "gguf":  # GGUF loads dequantized
        del config["quantization_config"]
        config_file.write_text(json.dumps(config, indent=2))
    save_model(model, str(Path(directory) / "model.safetensors"), metadata={"format": "pt"})
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)

