"""The head a training run starts from (a new one shaped by the target and the training set, or a trained one to
fine-tune, checked before any data is built) and how a trained head is written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ..speculators.convert_eagle import _write
from ..speculators.head_format import CONFIG_NAME as OTHER_HEAD_CONFIG
from ..speculators.heads import (
    CONFIG_NAME,
    FORMAT,
    FORMAT_VERSION,
    HIDDEN_STATES_CONVENTION,
    WEIGHTS_NAME,
    EagleHead,
    check_head_target,
    load_eagle_dir,
    pack_weights,
)
from .data import TrainingSet


def head_config_for(target, data: TrainingSet, version: int, *, draft_vocab_size: int | None = None,
                    intermediate_size: int | None = None) -> tuple[dict, torch.Tensor | None]:
    """Our `eagle_config.json` for a head over `target`: one Llama layer of the target's width. EAGLE-3 heads draft
    from the `draft_vocab_size` tokens the target predicts most often in `data` (returned, ascending)."""
    text = target.config.get_text_config()
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "max_position_embeddings", "hidden_act", "rope_parameters", "vocab_size")
    head = {k: getattr(text, k) for k in keys if getattr(text, k, None) is not None}
    head["hidden_act"] = "silu" if "gelu" not in str(head.get("hidden_act")) else head["hidden_act"]
    head["intermediate_size"] = intermediate_size or text.intermediate_size
    config = {"format": FORMAT, "format_version": FORMAT_VERSION, "eagle_version": version, "fc_bias": False,
              "head_config": head,
              "target": {"hidden_size": text.hidden_size, "vocab_size": text.vocab_size,
                         "num_hidden_layers": text.num_hidden_layers,
                         "name_or_path": getattr(target.config, "_name_or_path", "") or ""},
              "target_hidden_states": {"layers": list(data.layers), "convention": HIDDEN_STATES_CONVENTION}}
    draft_to_target = None
    if version == 3:
        vocab = text.vocab_size
        size = min(draft_vocab_size or vocab, vocab)
        config["draft_vocab_size"] = size
        if size < vocab:  # the most frequent argmax tokens (ties: lower id first)
            counts = data.labels[data.labels >= 0].bincount(minlength=vocab)
            draft_to_target = counts.argsort(descending=True, stable=True)[:size].sort().values
    return config, draft_to_target


def new_head(target, config: dict, draft_to_target: torch.Tensor | None, seed: int = 0) -> EagleHead:
    """A seeded head; an EAGLE-3 head's LM head starts from the target's rows of its draft vocabulary."""
    torch.manual_seed(seed)
    head = EagleHead(config).float()
    if config["eagle_version"] == 3:
        rows = draft_to_target if draft_to_target is not None else torch.arange(config["draft_vocab_size"])
        with torch.no_grad():
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[rows.to(target.device)].float().cpu())
            if draft_to_target is not None:
                head.draft_to_target.copy_(draft_to_target)
    return head


def check_new_head_options(version: int, draft_vocab_size: int | None) -> None:
    """Refuses options that cannot shape a new head of this version."""
    if version == 1 and draft_vocab_size is not None:
        raise ValueError("--draft-vocab (draft_vocab_size) applies to EAGLE-3 heads only: an EAGLE-1/2 head drafts "
                         "with the target's LM head over its whole vocabulary; leave it out, or train --version 3")


def check_init_from_is_not_out(init_from: str | Path, out_dir: str | Path) -> None:
    if Path(init_from).resolve() == Path(out_dir).resolve():
        raise ValueError(f"--init-from {init_from} is also --out: its checkpoint would take precedence and the head "
                         "would overwrite itself; write the fine-tuned head to another --out (the one given stays "
                         "as it is)")


def head_to_fine_tune_config(target, path: str | Path, *, version: int | None = None,
                             draft_vocab_size: int | None = None, intermediate_size: int | None = None) -> dict:
    """The `eagle_config.json` of the head in `path` (`--init-from`), with everything that does not need the
    training set checked: its format and weights, its target against `target`, and the options that would shape a
    new head (`version`, `draft_vocab_size`, `intermediate_size`: each None or the head's own). Called before any
    training data is built, so that a head that cannot be fine-tuned is refused at once."""
    return _read_head_to_fine_tune(target, path, version, draft_vocab_size, intermediate_size)[0]


def _read_head_to_fine_tune(target, path: str | Path, version: int | None, draft_vocab_size: int | None,
                            intermediate_size: int | None) -> tuple[dict, dict[str, torch.Tensor]]:
    path = Path(path)
    what = f"--init-from {path}"
    if not (path / CONFIG_NAME).is_file():
        if (path / OTHER_HEAD_CONFIG).is_file():
            raise ValueError(f"{what} holds an MLP speculator or Medusa head ({OTHER_HEAD_CONFIG}); train-eagle "
                             "fine-tunes EAGLE heads only: give an EAGLE head's directory, or leave --init-from out "
                             "to train a new head")
        raise ValueError(f"{what}: no {CONFIG_NAME} there; give a head directory in our format (one written by "
                         "train-eagle or convert-eagle, or a shipped head: hf_specdec.models.trained_head(NAME), or "
                         "--init-from eagle for the --target's own)")
    try:
        config, tensors = load_eagle_dir(path)
        check_head_target(target, config["target"], "EAGLE", fix="fine-tune a head made for this target, or leave "
                          "--init-from out to train a new one")
        head_version, vocab = config["eagle_version"], config["target"]["vocab_size"]
        head_draft_vocab, width = config.get("draft_vocab_size", vocab), config["head_config"]["intermediate_size"]
    except KeyError as error:
        raise ValueError(f"{what}: its {CONFIG_NAME} has no {error} entry; give a head written by train-eagle or "
                         "convert-eagle, or a shipped one") from None
    except ValueError as error:  # the format, the weights, the target
        raise ValueError(f"{what}: {error}") from None
    if version is not None and version != head_version:
        raise ValueError(f"{what} is an EAGLE-{head_version} head, not EAGLE-{version}; leave --version out to "
                         "fine-tune it as it is")
    if draft_vocab_size is not None:
        if head_version == 1:
            raise ValueError(f"{what} is an EAGLE-1/2 head, which drafts with the target's LM head over its whole "
                             "vocabulary: --draft-vocab applies to EAGLE-3 heads only (leave it out)")
        if min(draft_vocab_size, vocab) != head_draft_vocab:
            raise ValueError(f"{what} drafts from {head_draft_vocab} tokens, not {draft_vocab_size}; a fine-tuned "
                             "head keeps its draft vocabulary (leave --draft-vocab out, or at the head's size)")
    if intermediate_size is not None and intermediate_size != width:
        raise ValueError(f"{what} has MLP width {width}, not {intermediate_size}; a fine-tuned head keeps its "
                         "architecture")
    return config, tensors


def _head_to_fine_tune(target, data: TrainingSet, path: str | Path, version: int | None,
                       draft_vocab_size: int | None, intermediate_size: int | None) -> EagleHead:
    """The head in `path` as a float32 module to train on, checked against the target, the training set and the
    options that would otherwise shape a new head."""
    config, tensors = _read_head_to_fine_tune(target, path, version, draft_vocab_size, intermediate_size)
    layers = list(config["target_hidden_states"]["layers"])
    if layers != list(data.layers):
        raise ValueError(f"--init-from {path} reads target layers {layers}, but the training set holds layers "
                         f"{list(data.layers)}; build the set for this head in another --out directory")
    config = {k: v for k, v in config.items() if k != "weight_storage"}  # loaded weights are float
    # the head is now trained for this target: its config names it (as a new head's would)
    config["target"] = {**config["target"], "name_or_path": getattr(target.config, "_name_or_path", "") or ""}
    head = EagleHead(config).float()
    head.load_state_dict({n: t.float() if t.is_floating_point() else t for n, t in tensors.items()})
    if head.embed_tokens is not None:  # a converted head's own embeddings stay as published, like the target's
        head.embed_tokens.weight.requires_grad_(False)  # that a head trained here shares
    return head


def _head_digest(path: str | Path) -> str:
    """Identifies the head a fine-tune started from (its config and weights), to tell its checkpoints apart."""
    digest = hashlib.sha1()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        digest.update((Path(path) / name).read_bytes())
    return digest.hexdigest()


def save_head(head: EagleHead, out_dir: str | Path, dtype: torch.dtype = torch.float32,
              weight_bits: int | None = None) -> Path:
    """Writes `head` in our format (`eagle_config.json`, `model.safetensors`), checked by loading it back.
    `weight_bits` (4 or 8) stores its matrices as integers with group scales (`pack_weights`), for shipping."""
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).detach().cpu() for n, t in head.state_dict().items()}
    config = {k: v for k, v in head.config.items() if k != "weight_storage"}  # a loaded head is float again
    if weight_bits is not None:
        tensors, config = pack_weights(tensors, config, weight_bits)
    return _write(out_dir, config, tensors)
