"""The training loop: EAGLE's loss, a data order that is a pure function of (seed, step), checkpoints, and
resuming a run exactly where it stopped."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..speculators.heads import STORAGE_BITS, EagleHead
from .data import TrainingSet, _progress, default_layers
from .head import (
    _head_digest,
    _head_to_fine_tune,
    check_init_from_is_not_out,
    check_new_head_options,
    head_config_for,
    new_head,
    save_head,
)

CHECKPOINT_NAME = "checkpoint.pt"


@dataclass
class TrainResult:
    path: Path
    losses: list[float] = field(default_factory=list)  # one per step, from step 1


def eagle_loss(head: EagleHead, token_ids: torch.Tensor, lengths: torch.Tensor, features: torch.Tensor,
               labels: torch.Tensor, num_unroll: int = 1, target_to_draft: torch.Tensor | None = None,
               soft_ids: torch.Tensor | None = None, soft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over unroll steps of cross-entropy against the target plus smooth-L1 against the next input.

    The cross-entropy is against the target's argmax, or, given `soft_ids` and `soft_probs`, against its top-k
    distribution restricted to the draft vocabulary and renormalised (positions whose argmax is outside the draft
    vocabulary are left out either way).

    Args:
        token_ids, labels: `[batch, length]`; features: `[batch, length, width]`; lengths: `[batch]`.
        target_to_draft: `[vocab]` EAGLE-3 draft id of each target id, -100 outside the draft vocabulary.
        soft_ids, soft_probs: `[batch, length, k]` from `teacher_top_k`.
    """
    length = token_ids.shape[1]
    positions = torch.arange(length - 1, device=token_ids.device).expand(token_ids.shape[0], -1)
    if head.version == 1:
        next_input = features[:, 1:]
    else:
        with torch.no_grad():
            next_input = head.fc(features[:, 1:])
    draft_labels = labels if target_to_draft is None else torch.where(labels >= 0, target_to_draft[labels.clamp(
        min=0)], -100)
    soft = None
    if soft_ids is not None:
        soft_ids = soft_ids.long() if target_to_draft is None else target_to_draft[soft_ids.long()]
        weights = torch.where(soft_ids >= 0, soft_probs.float(), 0.0) * (draft_labels >= 0)[..., None]
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-12)
        soft = soft_ids.clamp(min=0), weights
    total, inputs, from_target = 0.0, features[:, :-1], True
    for u in range(num_unroll):  # step u: entry p reads (the input at p + u, token p + u + 1), at position p + u
        hidden = head(token_ids[:, u + 1:], positions[:, u:], None, inputs, from_target=from_target)
        valid = positions[:, u:] + 1 < lengths[:, None]  # the token at p + u + 1 exists
        logits = head.logits(hidden, head.config["target"]["vocab_size"]) if head.version == 1 else \
            head.lm_head(head.norm(hidden))
        step_labels = draft_labels[:, u + 1:].flatten()
        count = (step_labels >= 0).sum().clamp(min=1)
        if soft is None:
            ce = F.cross_entropy(logits.flatten(0, 1), step_labels, reduction="sum") / count
        else:
            log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, soft[0][:, u + 1:])
            ce = -(log_probs * soft[1][:, u + 1:]).sum() / count
        reg = F.smooth_l1_loss(hidden[valid], next_input[:, u:][valid])
        total = total + ce + reg
        inputs, from_target = hidden[:, :-1], False
    return total / num_unroll


def _batch_indices(num_sequences: int, batch_size: int, seed: int, step: int) -> torch.Tensor:
    """The sequences of training step `step` (0-based): epoch-wise seeded permutations, a pure function of step."""
    per_epoch = max(num_sequences // batch_size, 1)
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    return order[index * batch_size:(index + 1) * batch_size]


def _learning_rate(lr: float, step: int, steps: int) -> float:
    warmup = max(min(steps // 10, 100), 1)  # linear warm-up, then cosine decay to a tenth
    return lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(step / steps, 1.0))))


def train_eagle_head(target, data: TrainingSet, out_dir: str | Path, *, version: int | None = None,
                     steps: int = 200, batch_size: int = 8, lr: float = 1e-3, num_unroll: int = 1,
                     draft_vocab_size: int | None = None, intermediate_size: int | None = None, save_every: int = 50,
                     seed: int = 0, resume: bool = True, progress: bool = True,
                     save_dtype: torch.dtype = torch.float32, mixed_precision: str = "no",
                     weight_bits: int | None = None, init_from: str | Path | None = None) -> TrainResult:
    """Trains an EAGLE head for `target` on `data` and writes it to `out_dir` in our format.

    Checkpoints (`checkpoint.pt`: head, optimizer, step, losses) every `save_every` steps and when interrupted; with
    `resume=True` a run continues from `out_dir`'s checkpoint and ends where an uninterrupted run would. Uses a GPU
    through accelerate when one is present.

    Args:
        target: the target model (its input embeddings, and for EAGLE-1/2 its LM head, are shared, kept frozen).
        data (`TrainingSet`): from `build_training_set`, with the layers the head reads.
        version (`int`, *optional*): 1 (EAGLE-1/2: reads the final state, drafts with the target's LM head) or 3
            (EAGLE-3: reads `data.layers`, its own norm and LM head over `draft_vocab_size` tokens). Default: the
            `init_from` head's version, or 3.
        num_unroll (`int`): chain steps trained per entry (1: teacher forcing only).
        draft_vocab_size (`int`, *optional*): EAGLE-3 draft vocabulary (default: the target's); refused for
            EAGLE-1/2 heads, which draft with the target's LM head.
        intermediate_size (`int`, *optional*): the head's MLP width (default: the target's).
        mixed_precision (`str`): "no" (float32) or "bf16": forward and backward under bfloat16 autocast, weights
            and optimizer state in float32 (about twice as fast on CPUs with AMX and on GPUs).
        weight_bits (`int`, *optional*): write the head's matrices as 4- or 8-bit integers with group scales
            (`pack_weights`; a file 7x or 4x smaller, for shipping); the checkpoint stays float32.
        init_from (`str` or `Path`, *optional*): a head in our format (trained, shipped or converted) to start from
            instead of a new one: fine-tuning on more data, for more passes, or for a fine-tuned target. It must read
            the training set's layers; its architecture and draft vocabulary are kept (`draft_vocab_size` must then
            be None or equal to its own). The optimizer and learning-rate schedule start afresh. A checkpoint in
            `out_dir` from an interrupted fine-tune of the same head on the same training set is resumed; one from
            another start or another training set is refused. `init_from` may not be `out_dir` itself.
    Returns:
        `TrainResult` with the output directory and the loss of every step run so far.
    """
    _check_options(data, version, steps, batch_size, num_unroll, draft_vocab_size, mixed_precision, weight_bits)
    out_dir = Path(out_dir)
    head = _start_head(target, data, out_dir, version, draft_vocab_size, intermediate_size, seed, init_from)
    config = head.config
    out_dir.mkdir(parents=True, exist_ok=True)
    # What a checkpoint must match besides the head's config: the training set (its draft vocabulary and batches
    # come from it) and the head the run started from.
    run = {"sequences": len(data.lengths), "tokens": int(data.lengths.sum()),
           "init_from": None if init_from is None else _head_digest(init_from)}
    soft_top_k = 0 if data.soft_ids is None else data.soft_ids.shape[-1]
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    checkpoint_file = out_dir / CHECKPOINT_NAME
    start, losses = 0, []
    if resume and checkpoint_file.is_file():
        start, losses = _resume(checkpoint_file, head, optimizer, config, soft_top_k, run)
    draft_to_target = getattr(head, "draft_to_target", None)  # the run's own (a resumed run: its checkpoint's)
    accelerator = _accelerator()
    device = target.device
    if accelerator is not None:
        head, optimizer = accelerator.prepare(head, optimizer)
        device = accelerator.device
    head.to(device)
    head.bind(target)
    target_to_draft = None if draft_to_target is None else _target_to_draft(draft_to_target, config, device)

    def save(step: int) -> None:
        torch.save({"step": step, "head": head.state_dict(), "optimizer": optimizer.state_dict(), "losses": losses,
                    "config": config, "soft_top_k": soft_top_k, "run": run}, checkpoint_file)

    step = start
    try:
        with _training(target, head):
            bar = _progress(range(start, steps), progress, "train-eagle", "step", start, steps)
            for step in bar:
                rows = _batch_indices(len(data.lengths), batch_size, seed, step)
                width = int(data.lengths[rows].max())
                batch = [None if t is None else t[rows][:, :width].to(device)
                         for t in (data.token_ids, data.features, data.labels, data.soft_ids, data.soft_probs)]
                batch[1] = batch[1].float()
                for group in optimizer.param_groups:
                    group["lr"] = _learning_rate(lr, step, steps)
                with torch.autocast(torch.device(device).type, dtype=torch.bfloat16,
                                    enabled=mixed_precision == "bf16"):
                    loss = eagle_loss(head, batch[0], data.lengths[rows].to(device), batch[1], batch[2], num_unroll,
                                      target_to_draft, batch[3], batch[4])
                optimizer.zero_grad()
                accelerator.backward(loss) if accelerator is not None else loss.backward()
                optimizer.step()
                losses.append(loss.item())
                step += 1
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{losses[-1]:.3f}")
                if step % save_every == 0 or step == steps:
                    save(step)
    except KeyboardInterrupt:
        save(step)  # the last completed step: resuming continues from there
        raise
    save_head(head, out_dir, save_dtype, weight_bits)
    return TrainResult(out_dir, losses)


def _check_options(data: TrainingSet, version: int | None, steps: int, batch_size: int, num_unroll: int,
                   draft_vocab_size: int | None, mixed_precision: str, weight_bits: int | None) -> None:
    if version not in (None, 1, 3):
        raise ValueError(f"version must be 1 (EAGLE-1/2) or 3 (EAGLE-3), got {version}")
    if weight_bits is not None and weight_bits not in STORAGE_BITS:
        raise ValueError(f"weight_bits (--weight-bits) must be one of {STORAGE_BITS}, or None for float weights")
    if draft_vocab_size is not None and draft_vocab_size < 1:
        raise ValueError(f"draft_vocab_size (--draft-vocab) must be at least 1, got {draft_vocab_size}; leave it out "
                         "for the default")
    if mixed_precision not in ("no", "bf16"):
        raise ValueError(f"mixed_precision must be 'no' or 'bf16', got {mixed_precision!r}")
    if steps < 1 or batch_size < 1 or num_unroll < 1 or num_unroll >= int(data.lengths.min()):
        raise ValueError("steps, batch_size and num_unroll must be positive, num_unroll shorter than every sequence")


def _start_head(target, data: TrainingSet, out_dir: Path, version: int | None, draft_vocab_size: int | None,
                intermediate_size: int | None, seed: int, init_from: str | Path | None) -> EagleHead:
    """A new head shaped by the target and the training set, or the `init_from` head to fine-tune."""
    if init_from is not None:
        check_init_from_is_not_out(init_from, out_dir)
        return _head_to_fine_tune(target, data, init_from, version, draft_vocab_size, intermediate_size)
    version = 3 if version is None else version
    check_new_head_options(version, draft_vocab_size)
    if version == 1 and data.layers != default_layers(target, 1):
        raise ValueError(f"an EAGLE-1/2 head reads the final hidden state {default_layers(target, 1)}, but the "
                         f"training set holds layers {data.layers}; rebuild it with those layers")
    config, draft_to_target = head_config_for(target, data, version, draft_vocab_size=draft_vocab_size,
                                              intermediate_size=intermediate_size)
    return new_head(target, config, draft_to_target, seed)


def _resume(checkpoint_file: Path, head: EagleHead, optimizer, config: dict, soft_top_k: int,
            run: dict) -> tuple[int, list[float]]:
    """Loads the checkpoint into `head` and `optimizer` once it is shown to come from this run; returns its step
    and losses."""
    state = torch.load(checkpoint_file, weights_only=True)
    if _without_name(state["config"]) != _without_name(json.loads(json.dumps(config))):
        raise ValueError(f"{checkpoint_file} is from a run with another head or training set; pass another "
                         "output directory, or resume=False (--no-resume) to start over")
    if state.get("soft_top_k", 0) != soft_top_k:
        raise ValueError(f"{checkpoint_file} is from a run trained with soft labels top-"
                         f"{state.get('soft_top_k', 0)}, this training set has top-{soft_top_k} (0: argmax only); "
                         "pass the same --soft-labels, another output directory, or resume=False (--no-resume) "
                         "to start over")
    _check_checkpoint_run(checkpoint_file, state.get("run"), run)
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["losses"]


def _target_to_draft(draft_to_target: torch.Tensor, config: dict, device) -> torch.Tensor:
    """`[vocab]` the EAGLE-3 draft id of each target id, -100 outside the draft vocabulary."""
    target_to_draft = torch.full((config["target"]["vocab_size"],), -100, dtype=torch.long)
    target_to_draft[draft_to_target] = torch.arange(len(draft_to_target))
    return target_to_draft.to(device)


@contextmanager
def _training(target, head: EagleHead):
    """The target frozen and the head in training mode with plain causal attention over whole sequences; both as
    they were afterwards."""
    frozen = [(p, p.requires_grad) for p in target.parameters()]
    attention = head.layer.self_attn.config._attn_implementation
    head.layer.self_attn.config._attn_implementation = "sdpa"
    head.train()
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
        head.layer.self_attn.config._attn_implementation = attention
        head.eval()


def _check_checkpoint_run(checkpoint_file: Path, saved: dict | None, run: dict) -> None:
    """Refuses to resume a checkpoint written by a run on another training set or from another start head
    (checkpoints written before runs were recorded are taken as they are)."""
    if saved is None:
        return
    fix = "pass another output directory, or --no-resume (resume=False) to start over"
    if (saved["sequences"], saved["tokens"]) != (run["sequences"], run["tokens"]):
        raise ValueError(f"{checkpoint_file} is from a run on another training set ({saved['sequences']} sequences, "
                         f"{saved['tokens']} tokens; this one has {run['sequences']} and {run['tokens']}); {fix}")
    if saved["init_from"] != run["init_from"]:
        started = {None: "a new head"}.get(saved["init_from"], "another --init-from head")
        now = "a new head" if run["init_from"] is None else "this --init-from head"
        raise ValueError(f"{checkpoint_file} is from a run that started from {started}, not from {now}; {fix}")


def _without_name(config: dict) -> dict:
    """A head config without the target's `name_or_path`, which says where the target was loaded from, not what
    it is (a checkpoint stays resumable when the same target is loaded by another path)."""
    return {**config, "target": {k: v for k, v in config["target"].items() if k != "name_or_path"}}


def _accelerator():
    if not torch.cuda.is_available():
        return None
    from accelerate import Accelerator

    return Accelerator()
