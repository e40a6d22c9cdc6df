"""Trains EAGLE heads from the target itself: `hf_specdec.train_eagle_head` and `hf-specdec train-eagle`.

The training set is self-distilled: the target continues prompts (a file, or the built-in set of
`hf_specdec.train_prompts`), then one
teacher-forced pass over each sequence records the hidden states the head reads and the target's next-token argmax
at every position. Entry p of the head reads the target's feature at p and the token at p + 1 and learns (a) the
target's argmax at p + 1 (cross-entropy) and (b) to reproduce what its own input would be at p + 1 (the target's
feature for EAGLE-1/2, `fc` of the target's states for EAGLE-3), which is what chain drafting feeds back. With
`num_unroll > 1` the head also trains on its own outputs, as chain drafting runs it. Data order is a pure function
of (seed, step), so a run resumed from a checkpoint equals an uninterrupted one. The output loads with
`EagleSpeculator.from_pretrained`.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .eagle_convert import _write
from .speculators.heads import (
    CONFIG_NAME, FORMAT, FORMAT_VERSION, HIDDEN_STATES_CONVENTION, STORAGE_BITS, WEIGHTS_NAME, EagleHead,
    check_head_target, load_eagle_dir, pack_weights,
)
from .train_prompts import HAND_WRITTEN, built_in_prompts, max_prompts

CHECKPOINT_NAME = "checkpoint.pt"
TRAINING_SET_NAME = "training_set.pt"  # a whole set in one file (sets built before parts existed)
TRAINING_PARTS_DIR = "training_set"  # a set built in parts: index.json and part-NNNNN.pt

@dataclass
class TrainingSet:
    """Self-distilled sequences, right-padded. `features` are the target hidden states the head reads,
    concatenated; `labels[:, p]` is the target's argmax after token p (-100 past a row's length)."""

    token_ids: torch.Tensor  # [num_sequences, max_len]
    lengths: torch.Tensor  # [num_sequences]
    features: torch.Tensor  # [num_sequences, max_len, num_layers * hidden]
    labels: torch.Tensor  # [num_sequences, max_len]
    layers: list[int]
    prompt_index: torch.Tensor | None = None  # [num_sequences] the prompt each sequence continues
    # The target's K most likely next tokens after each token and their probabilities (`add_soft_labels`): the
    # head then learns the target's distribution, not only its argmax.
    soft_ids: torch.Tensor | None = None  # [num_sequences, max_len, K] int32
    soft_probs: torch.Tensor | None = None  # [num_sequences, max_len, K] float16

    def save(self, path: str | Path) -> None:
        names = ("token_ids", "lengths", "features", "labels", "prompt_index", "soft_ids", "soft_probs")
        torch.save({**{k: getattr(self, k) for k in names if getattr(self, k) is not None}, "layers": self.layers},
                   path)

    @classmethod
    def load(cls, path: str | Path) -> TrainingSet:
        """Memory-mapped: the tensors are read from the file as they are used, so loading the parts of a large set to
        join them holds only the joined copy in memory."""
        return cls(**torch.load(path, weights_only=True, mmap=True))

    @classmethod
    def concat(cls, parts: list[TrainingSet]) -> TrainingSet:
        """One set holding every part's sequences, right-padded to the longest."""
        if len({tuple(p.layers) for p in parts}) != 1:
            raise ValueError("the parts of a training set must hold the same layers")
        width = max(p.token_ids.shape[1] for p in parts)

        def joined(name: str, value) -> torch.Tensor | None:
            tensors = [getattr(p, name) for p in parts]
            if any(t is None for t in tensors):
                return None
            if value is None:
                return torch.cat(tensors)
            # Filled part by part into one tensor: no padded copy of each part, so the peak is the joined set.
            out = tensors[0].new_full((sum(len(t) for t in tensors), width, *tensors[0].shape[2:]), value)
            row = 0
            for t in tensors:
                out[row:row + len(t), :t.shape[1]] = t
                row += len(t)
            return out

        return cls(joined("token_ids", 0), joined("lengths", None), joined("features", 0.0), joined("labels", -100),
                   list(parts[0].layers), joined("prompt_index", None), joined("soft_ids", 0),
                   joined("soft_probs", 0.0))

    def select(self, rows: torch.Tensor) -> TrainingSet:
        """The sequences `rows` (a boolean mask or indices), cut to the longest of them."""
        width = int(self.lengths[rows].max())

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows][:, :width]

        return TrainingSet(cut(self.token_ids), self.lengths[rows], cut(self.features), cut(self.labels),
                           list(self.layers), None if self.prompt_index is None else self.prompt_index[rows],
                           cut(self.soft_ids), cut(self.soft_probs))


@dataclass
class TrainResult:
    path: Path
    losses: list[float] = field(default_factory=list)  # one per step, from step 1


def default_layers(target, version: int) -> list[int]:
    """EAGLE-1/2: the final (normed) state. EAGLE-3: the inputs to layers (2, L // 2, L - 3), as the reference."""
    num_layers = target.config.get_text_config().num_hidden_layers
    if version == 1:
        return [num_layers]
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


@torch.no_grad()
def build_training_set(target, prompt_ids: list[list[int]], layers: list[int], *, max_new_tokens: int = 128,
                       samples_per_prompt: int = 1, temperature: float = 0.7, batch_size: int = 8,
                       eos_token_id: int | None = None, seed: int = 0, progress: bool = False,
                       feature_dtype: torch.dtype = torch.float32) -> TrainingSet:
    """Continues each prompt with the target (greedy first, then `samples_per_prompt - 1` sampled continuations)
    and records, in one teacher-forced pass per sequence, the hidden states `layers` and the target's argmax.

    Args:
        prompt_ids (`list[list[int]]`): tokenised prompts (with the chat template applied, when there is one).
        layers (`list[int]`): `output_hidden_states` indices the head reads (see `default_layers`).
        eos_token_id (`int`, *optional*): a continuation is cut after it.
        progress (`bool`): show a progress bar over the generation batches.
        feature_dtype (`torch.dtype`): how the features are stored (`torch.bfloat16` halves the memory of a large
            set; training computes in float32 either way).
    """
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("build_training_set needs at least one prompt, and no empty prompt")
    sequences, sources = [], []
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))  # similar lengths waste less padding
    prompt_ids = [prompt_ids[i] for i in order]
    chunks = [(sample_index, start) for sample_index in range(samples_per_prompt)  # greedy first, then sampled
              for start in range(0, len(prompt_ids), batch_size)]
    for sample_index, start in _progress(chunks, progress, "self-distill", "batch"):
        sample = sample_index > 0
        chunk = prompt_ids[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=target.device)
        mask = (torch.arange(width, device=ids.device)[None] >= torch.tensor(
            [width - len(p) for p in chunk], device=ids.device)[:, None]).long()
        torch.manual_seed(seed + 1000 * sample_index + start)
        out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              do_sample=sample, temperature=temperature if sample else None, top_k=None,
                              top_p=None, pad_token_id=0 if eos_token_id is None else eos_token_id)
        for i, (prompt, row) in enumerate(zip(chunk, out)):
            new = row[width:].tolist()
            if eos_token_id is not None and eos_token_id in new:
                new = new[:new.index(eos_token_id) + 1]
            sequences.append(prompt + new)
            sources.append(order[start + i])
    max_len = max(len(s) for s in sequences)
    token_ids = torch.zeros(len(sequences), max_len, dtype=torch.long)
    lengths = torch.tensor([len(s) for s in sequences])
    for i, s in enumerate(sequences):
        token_ids[i, :len(s)] = torch.tensor(s)
    features, labels = [], []
    lm_head = target.get_output_embeddings()
    for start in range(0, len(sequences), batch_size):
        ids = token_ids[start:start + batch_size].to(target.device)
        mask = (torch.arange(max_len)[None] < lengths[start:start + batch_size, None]).long().to(target.device)
        out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
        features.append(torch.cat([out.hidden_states[i] for i in layers], dim=-1).to(feature_dtype).cpu())
        # The LM head one sequence at a time: a batch's logits over a large vocabulary would take gigabytes. The
        # last hidden state is the normed one the LM head reads; a logit softcap or scale keeps the argmax.
        argmax = torch.stack([lm_head(final).argmax(-1) for final in out.hidden_states[-1]])
        labels.append(argmax.cpu().masked_fill(mask.cpu() == 0, -100))
    return TrainingSet(token_ids, lengths, torch.cat(features), torch.cat(labels), list(layers),
                       torch.tensor(sources, dtype=torch.long))


def build_in_parts(target, prompt_ids: list[list[int]], layers: list[int], directory: str | Path, recipe: dict, *,
                   part_size: int = 500, progress: bool = False, soft_top_k: int = 0,
                   **build_kwargs) -> TrainingSet:
    """The training set of `prompt_ids`, kept in `directory` in parts of `part_size` prompts.

    An interrupted build resumes at its first unfinished part, and asking for more prompts of the same list builds
    only the new ones. `recipe` holds every setting the sequences depend on (target, lengths, dtype, layers, seed);
    it and the prompts already built must match what is stored, else a `ValueError` says what differs.
    With `soft_top_k` > 0 each part also gets the target's top-k distributions (`add_soft_labels`), kept beside it
    in `part-NNNNN.topK.pt`, so a set built without them gains them later without generating again.
    `build_kwargs` go to `build_training_set`.
    """
    if part_size < 1:
        raise ValueError(f"part_size (--data-part-size) must be at least 1, got {part_size}")
    directory = Path(directory)
    index_file = directory / "index.json"
    recipe = json.loads(json.dumps({**recipe, "layers": list(layers)}))
    digests = [hashlib.sha1(json.dumps(p).encode()).hexdigest()[:12] for p in prompt_ids]
    index = {"recipe": recipe, "prompts": [], "parts": []}
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        if index["recipe"] != recipe:
            changed = sorted(k for k in {**recipe, **index["recipe"]} if recipe.get(k) != index["recipe"].get(k))
            raise ValueError(f"{directory} holds a training set built with other settings ({', '.join(changed)}: "
                             f"{[index['recipe'].get(k) for k in changed]} there, {[recipe.get(k) for k in changed]} "
                             "now); use another output directory, or --rebuild-data to build it again")
        stored = index["prompts"]
        differs = next((i for i, (a, b) in enumerate(zip(stored, digests)) if a != b), None)
        if differs is not None:
            raise ValueError(f"{directory} holds a training set built from other prompts (prompt {differs} differs); "
                             "use another output directory, or --rebuild-data to build it again")
    directory.mkdir(parents=True, exist_ok=True)
    covered = len(index["prompts"])
    starts = list(range(covered, len(prompt_ids), part_size))
    if progress and not starts:
        print(f"reusing the training set in {directory}")
    elif progress:
        print(f"generating {(len(prompt_ids) - covered) * build_kwargs.get('samples_per_prompt', 1)} training "
              f"sequences (prompts {covered}-{len(prompt_ids) - 1}) ...")
    for number, start in enumerate(starts):
        end = min(start + part_size, len(prompt_ids))
        if progress:
            print(f"training set part {number + 1}/{len(starts)}: prompts {start}-{end - 1} of {len(prompt_ids)}")
        part = build_training_set(target, prompt_ids[start:end], layers, progress=progress,
                                  **{**build_kwargs, "seed": build_kwargs.get("seed", 0) + start})
        part.prompt_index += start
        name = f"part-{len(index['parts']):05d}.pt"
        part.save(directory / name)
        index["parts"].append({"file": name, "prompts": [start, end]})
        index["prompts"] = index["prompts"] + digests[start:end]
        _write_json(index_file, index)  # after the part: an interrupted build resumes at the next one
    files = [directory / part["file"] for part in index["parts"] if part["prompts"][0] < len(prompt_ids)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{directory} lacks {missing}, which its index.json lists; --rebuild-data builds the set "
                         "again")
    parts = [TrainingSet.load(f) for f in files]
    if soft_top_k > 0:
        for number, (file, part) in enumerate(zip(files, parts)):
            soft_file = file.with_suffix(f".top{soft_top_k}.pt")
            if not soft_file.is_file():
                if progress:
                    print(f"soft labels (top {soft_top_k}) for part {number + 1}/{len(parts)}")
                ids, probs = teacher_top_k(target, part.token_ids, part.lengths, soft_top_k)
                torch.save({"soft_ids": ids, "soft_probs": probs}, soft_file)
            soft = torch.load(soft_file, weights_only=True)
            part.soft_ids, part.soft_probs = soft["soft_ids"], soft["soft_probs"]
    data = TrainingSet.concat(parts)
    keep = data.prompt_index < len(prompt_ids)
    if not bool(keep.all()):  # the stored set covers more prompts than asked for
        data = data.select(keep)
    return data


def _write_json(path: Path, value) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


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


@torch.no_grad()
def teacher_top_k(target, token_ids: torch.Tensor, lengths: torch.Tensor, k: int, *,
                  max_logits: int = 1 << 27) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's `k` most likely next tokens after every token of `token_ids` and their probabilities.

    The target's own forward gives the logits (so a logit softcap or scale is applied as in generation), a few
    sequences at a time so that at most about `max_logits` logits exist at once. Returns `int32` ids and `float16`
    probabilities, `[num_sequences, length, k]`, zero past each sequence's length.
    """
    num, length = token_ids.shape
    vocab = target.config.get_text_config().vocab_size
    if not 1 <= k <= vocab:
        raise ValueError(f"soft labels: top-k must be between 1 and the vocabulary size {vocab}, got {k}")
    ids = torch.zeros(num, length, k, dtype=torch.int32)
    probs = torch.zeros(num, length, k, dtype=torch.float16)
    order = lengths.argsort()  # similar lengths together waste less padding
    step = max(1, max_logits // (length * vocab))
    for start in range(0, num, step):
        rows = order[start:start + step]
        width = int(lengths[rows].max())
        batch = token_ids[rows, :width].to(target.device)
        mask = (torch.arange(width)[None] < lengths[rows, None]).long().to(target.device)
        logits = target(input_ids=batch, attention_mask=mask).logits
        for i, row in enumerate(rows.tolist()):
            n = int(lengths[row])
            top = torch.softmax(logits[i, :n].float(), dim=-1).topk(k, dim=-1)
            ids[row, :n] = top.indices.to(torch.int32).cpu()
            probs[row, :n] = top.values.to(torch.float16).cpu()
    return ids, probs


def add_soft_labels(target, data: TrainingSet, k: int) -> TrainingSet:
    """`data` with the target's top-`k` distribution after each token (`TrainingSet.soft_ids`, `soft_probs`)."""
    data.soft_ids, data.soft_probs = teacher_top_k(target, data.token_ids, data.lengths, k)
    return data


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
    out_dir = Path(out_dir)
    if init_from is None:
        version = 3 if version is None else version
        check_new_head_options(version, draft_vocab_size)
        if version == 1 and data.layers != default_layers(target, 1):
            raise ValueError(f"an EAGLE-1/2 head reads the final hidden state {default_layers(target, 1)}, but the "
                             f"training set holds layers {data.layers}; rebuild it with those layers")
        config, draft_to_target = head_config_for(target, data, version, draft_vocab_size=draft_vocab_size,
                                                  intermediate_size=intermediate_size)
        head = new_head(target, config, draft_to_target, seed)
    else:
        check_init_from_is_not_out(init_from, out_dir)
        head = _head_to_fine_tune(target, data, init_from, version, draft_vocab_size, intermediate_size)
        config = head.config
    out_dir.mkdir(parents=True, exist_ok=True)
    # What a checkpoint must match besides the head's config: the training set (its draft vocabulary and batches
    # come from it) and the head the run started from.
    run = {"sequences": len(data.lengths), "tokens": int(data.lengths.sum()),
           "init_from": None if init_from is None else _head_digest(init_from)}
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    start, losses = 0, []
    soft_top_k = 0 if data.soft_ids is None else data.soft_ids.shape[-1]
    checkpoint_file = out_dir / CHECKPOINT_NAME
    if resume and checkpoint_file.is_file():
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
        start, losses = state["step"], state["losses"]
    draft_to_target = getattr(head, "draft_to_target", None)  # the run's own (a resumed run: its checkpoint's)
    accelerator = _accelerator()
    device = target.device
    if accelerator is not None:
        head, optimizer = accelerator.prepare(head, optimizer)
        device = accelerator.device
    head.to(device)
    head.bind(target)
    target_to_draft = None
    if draft_to_target is not None:
        target_to_draft = torch.full((config["target"]["vocab_size"],), -100, dtype=torch.long)
        target_to_draft[draft_to_target] = torch.arange(len(draft_to_target))
        target_to_draft = target_to_draft.to(device)

    def save(step: int) -> None:
        torch.save({"step": step, "head": head.state_dict(), "optimizer": optimizer.state_dict(), "losses": losses,
                    "config": config, "soft_top_k": soft_top_k, "run": run}, checkpoint_file)

    frozen = [(p, p.requires_grad) for p in target.parameters()]
    attention = head.layer.self_attn.config._attn_implementation
    head.layer.self_attn.config._attn_implementation = "sdpa"  # plain causal attention over whole sequences
    head.train()
    step = start
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        bar = _progress(range(start, steps), progress, "train-eagle", "step", start, steps)
        for step in bar:
            rows = _batch_indices(len(data.lengths), batch_size, seed, step)
            width = int(data.lengths[rows].max())
            batch = [None if t is None else t[rows][:, :width].to(device)
                     for t in (data.token_ids, data.features, data.labels, data.soft_ids, data.soft_probs)]
            batch[1] = batch[1].float()
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(lr, step, steps)
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=mixed_precision == "bf16"):
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
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
        head.layer.self_attn.config._attn_implementation = attention
        head.eval()
    save_head(head, out_dir, save_dtype, weight_bits)
    return TrainResult(out_dir, losses)


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
        from .head_convert import CONFIG_NAME as OTHER_HEAD_CONFIG

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


def save_head(head: EagleHead, out_dir: str | Path, dtype: torch.dtype = torch.float32,
              weight_bits: int | None = None) -> Path:
    """Writes `head` in our format (`eagle_config.json`, `model.safetensors`), checked by loading it back.
    `weight_bits` (4 or 8) stores its matrices as integers with group scales (`pack_weights`), for shipping."""
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).detach().cpu() for n, t in head.state_dict().items()}
    config = {k: v for k, v in head.config.items() if k != "weight_storage"}  # a loaded head is float again
    if weight_bits is not None:
        tensors, config = pack_weights(tensors, config, weight_bits)
    return _write(out_dir, config, tensors)


def _accelerator():
    if not torch.cuda.is_available():
        return None
    from accelerate import Accelerator

    return Accelerator()


def _progress(items, enabled: bool, desc: str, unit: str, start: int = 0, total: int | None = None):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, initial=start, total=len(items) + start if total is None else total, desc=desc, unit=unit)


def read_prompts(path: str | Path) -> list[str]:
    """Prompts from a file: one per line (`.txt`), or JSON lines with a "prompt" field (`.jsonl`)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--data {path}: no such file; give a text file with one prompt per line")
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        try:
            lines = [json.loads(line)["prompt"] for line in lines]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"--data {path}: every line of a .jsonl file must be an object with a \"prompt\" field "
                             f"({error})") from error
    if not lines:
        raise ValueError(f"--data {path} holds no prompts; write one prompt per line")
    return lines


def tokenize_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as a user turn, with the chat template when the tokenizer has one."""
    if getattr(tokenizer, "chat_template", None):
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True) for p in prompts]
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


def add_arguments(parser) -> None:
    parser.add_argument("--target", required=True, help="the target: embedded model name, hub id or path")
    parser.add_argument("--out", required=True, help="output directory (head, checkpoint, training set)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", default=None, help="prompts file: one per line (.txt) or {\"prompt\": ...} "
                        "lines (.jsonl)")
    source.add_argument("--self-distill", type=int, default=None, metavar="N",
                        help=f"use the first N of the built-in prompts: {len(HAND_WRITTEN)} hand-written, then requests "
                        f"composed from task forms and subjects, {max_prompts()} in all (default: the hand-written "
                        f"{len(HAND_WRITTEN)})")
    parser.add_argument("--version", type=int, default=None, choices=[1, 3],
                        help="EAGLE-1/2 or EAGLE-3 head (default 3, or the --init-from head's)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--unroll", type=int, default=2, help="chain steps trained per entry")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="EAGLE-3 draft vocabulary size (default 8192, or the --init-from head's)")
    parser.add_argument("--init-from", default=None, metavar="HEAD_DIR",
                        help="start from this head (trained, shipped or converted; our format) instead of a new one: "
                        "fine-tune it on more data or for more passes; its architecture, target layers and draft "
                        "vocabulary are kept. 'eagle': the head shipped for --target. Write to another --out")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens the target generates per prompt")
    parser.add_argument("--samples-per-prompt", type=int, default=2,
                        help="continuations per prompt: one greedy, the rest sampled (temperature 0.7)")
    parser.add_argument("--generation-batch-size", type=int, default=16, help="prompts the target continues at once")
    parser.add_argument("--save-every", type=int, default=50, help="checkpoint interval in steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-resume", action="store_true", help="train from scratch even if --out holds a checkpoint "
                        "(the stored training set is still used)")
    parser.add_argument("--rebuild-data", action="store_true", help="build the training set again even if --out "
                        "holds one")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--data-part-size", type=int, default=500,
                        help="prompts per saved part of the training set: an interrupted build resumes at its first "
                        "unfinished part, and a larger --self-distill adds only the new prompts")
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16"],
                        help="train under bfloat16 autocast (weights and optimizer in float32): about twice as fast "
                        "on CPUs with AMX and on GPUs")
    parser.add_argument("--soft-labels", type=int, default=0, metavar="K",
                        help="train on the target's top-K next-token distribution, not only its argmax (0: argmax "
                        "only); computed once per part of the training set and kept beside it")
    parser.add_argument("--weight-bits", type=int, default=None, choices=list(STORAGE_BITS),
                        help="write the head's matrices as 4- or 8-bit integers with group scales, a file 7x or 4x "
                        "smaller (the checkpoint stays float32; run again after training to re-write a finished head)")
    parser.add_argument("--data-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the target's dtype while it builds the training set (bfloat16: about twice as fast "
                        "on CPUs with AMX, faster on GPUs; the head then learns from the bfloat16 target's states)")


def cmd_train_eagle(args) -> int:
    """`hf-specdec train-eagle`: build (or reuse) the self-distilled training set, train, write the head."""
    import time

    from .models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.soft_labels < 0:
        raise SystemExit(f"--soft-labels {args.soft_labels}: give the number of most likely tokens to learn from "
                         "(e.g. 16), or 0 for the argmax only")
    out = Path(args.out)
    data_file, parts_dir = out / TRAINING_SET_NAME, out / TRAINING_PARTS_DIR
    target, tokenizer = load_model(args.target, device="cuda" if torch.cuda.is_available() else None)
    version, layers = args.version or 3, None
    if args.init_from is not None:  # checked, and its version and layers taken, before any data is built
        if args.init_from == "eagle":
            from .models import trained_head
            try:
                args.init_from = str(trained_head(args.target))
            except ValueError as error:
                raise SystemExit(f"--init-from eagle: {error}") from None
        try:
            check_init_from_is_not_out(args.init_from, args.out)
            config = head_to_fine_tune_config(target, args.init_from, version=args.version,
                                              draft_vocab_size=args.draft_vocab)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        version, layers = config["eagle_version"], list(config["target_hidden_states"]["layers"])
    else:
        try:
            check_new_head_options(version, args.draft_vocab)
        except ValueError as error:
            raise SystemExit(str(error)) from None
    start = time.perf_counter()
    if args.rebuild_data:
        shutil.rmtree(parts_dir, ignore_errors=True)
    if data_file.is_file() and not args.rebuild_data and not parts_dir.is_dir():
        data = TrainingSet.load(data_file)  # a set saved whole by an earlier version
        print(f"reusing the training set in {data_file} ({len(data.lengths)} sequences)")
        if args.soft_labels:
            add_soft_labels(target, data, args.soft_labels)
    else:
        if args.data:
            prompts = read_prompts(args.data)
        else:
            count = args.self_distill or len(HAND_WRITTEN)
            if not 1 <= count <= max_prompts():
                raise SystemExit(f"--self-distill {count}: choose 1 to {max_prompts()} built-in prompts, or give "
                                 "your own with --data FILE (more samples per prompt: --samples-per-prompt)")
            prompts = built_in_prompts(count, seed=args.seed)
        layers = layers or default_layers(target, version)
        recipe = {"target": args.target, "max_new_tokens": args.max_new_tokens,
                  "samples_per_prompt": args.samples_per_prompt, "temperature": 0.7, "data_dtype": args.data_dtype,
                  "seed": args.seed}
        dtype = target.dtype
        target.to(getattr(torch, args.data_dtype))
        try:
            data = build_in_parts(target, tokenize_prompts(tokenizer, prompts), layers, parts_dir, recipe,
                                  part_size=args.data_part_size, progress=True, soft_top_k=args.soft_labels,
                                  max_new_tokens=args.max_new_tokens,
                                  samples_per_prompt=args.samples_per_prompt, batch_size=args.generation_batch_size,
                                  eos_token_id=tokenizer.eos_token_id, seed=args.seed, feature_dtype=torch.bfloat16)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        except KeyboardInterrupt:
            print(f"\ninterrupted; the parts built so far are in {parts_dir}, and the same command goes on from "
                  "there", file=sys.stderr)
            return 130
        finally:
            target.to(dtype)
        print(f"training set: {len(data.lengths)} sequences, {int(data.lengths.sum())} tokens, "
              f"{time.perf_counter() - start:.0f} s")
    try:
        result = train_eagle_head(target, data, out, version=version, steps=args.steps,
                                  batch_size=args.batch_size, lr=args.lr, num_unroll=args.unroll,
                                  draft_vocab_size=(args.draft_vocab if args.draft_vocab is not None
                                                    else 8192 if version == 3 and not args.init_from else None),
                                  save_every=args.save_every, seed=args.seed, resume=not args.no_resume,
                                  mixed_precision=args.mixed_precision, weight_bits=args.weight_bits,
                                  init_from=args.init_from)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    except KeyboardInterrupt:
        print(f"\ninterrupted; the checkpoint in {out} resumes with the same command", file=sys.stderr)
        return 130
    print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} over {len(result.losses)} steps, "
          f"{time.perf_counter() - start:.0f} s; wrote {result.path}: use --speculator {result.path} or "
          f"EagleSpeculator.from_pretrained({str(result.path)!r})")
    return 0
