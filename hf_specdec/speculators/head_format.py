"""Our on-disk format for MLP-speculator and Medusa heads: `head_config.json` beside `model.safetensors`.

The format states the head's kind, its hyper-parameters, the target it was checked against and which target hidden
state it reads. Loading checks every tensor against the names and shapes the loading speculator class expects
(`expected_tensors`), so this module knows no head class.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .heads import WEIGHTS_NAME, EagleCheckpointError
from .heads import check_tensors as check_eagle_tensors

CONFIG_NAME = "head_config.json"
FORMAT = "hf_specdec-head"
FORMAT_VERSION = 1
KIND_CLASSES = {"mlp_speculator": "MlpSpeculator", "medusa": "MedusaSpeculator"}  # kind -> the class that loads it


class HeadCheckpointError(EagleCheckpointError):
    """A draft-head checkpoint (reference layout or ours) that cannot be used: unknown layout, missing or extra
    tensors, wrong shapes or dtypes, unreadable files. A subclass of `EagleCheckpointError`."""


def check_tensors(tensors: dict[str, torch.Tensor], config: dict, where: str,
                  expected_tensors: Callable[[dict], dict[str, tuple[int, ...]]],
                  source_names: dict[str, str] | None = None) -> None:
    """Raises `HeadCheckpointError` naming (as the checkpoint spells it) the first missing, unexpected,
    misshapen, mistyped or non-finite tensor (the EAGLE checker, with this kind's tensors)."""
    expected = {name: (shape, "int" if name == "draft_to_target" else "float")
                for name, shape in expected_tensors(config).items()}
    check_eagle_tensors(tensors, config, where, source_names, expected=expected,
                       what=f"a {config['kind']} head with this config", error=HeadCheckpointError)


def load_head_dir(path: str | Path, kind: str | None,
                  expected_tensors: Callable[[dict], dict[str, tuple[int, ...]]]) -> tuple[dict, dict[str, torch.Tensor]]:
    """Reads and checks a directory in our format; returns `(config, tensors)`.

    Args:
        kind (`str`): the kind the caller loads (`"mlp_speculator"` or `"medusa"`); a head of another kind is
            refused, naming the class that loads it.
        expected_tensors (`Callable`): the caller's tensor names and shapes for a config of its kind.
    """
    path = Path(path)
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        hint = " (it is a reference checkpoint: convert it first)" if (path / "config.json").is_file() else ""
        raise HeadCheckpointError(f"{path} has no {CONFIG_NAME}{hint}; convert the head with `hf-specdec "
                                  "convert-head SRC DST --target TARGET` (or hf_specdec.convert_head)")
    config = json.loads(config_file.read_text())
    if config.get("format") != FORMAT or config.get("format_version") != FORMAT_VERSION or config.get(
            "kind") not in KIND_CLASSES:
        raise HeadCheckpointError(f"{config_file} is not {FORMAT} version {FORMAT_VERSION} of a known kind; "
                                  "re-convert the head")
    if kind is not None and config["kind"] != kind:
        raise HeadCheckpointError(f"{path} holds a {config['kind']} head, not a {kind} head; load it with "
                                  f"{KIND_CLASSES[config['kind']]}.from_pretrained")
    weights_file = path / WEIGHTS_NAME
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError) as error:
        raise HeadCheckpointError(f"could not read {weights_file} ({error}); the file is missing, truncated or "
                                  "corrupt: convert the head again") from error
    check_tensors(tensors, config, str(weights_file), expected_tensors)
    return config, tensors
