"""The training set of `hf-specdec train-eagle`: the target's own continuations of prompts, with the hidden states
an EAGLE head reads and the target's next-token choice at every position, built in resumable parts."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

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


def _progress(items, enabled: bool, desc: str, unit: str, start: int = 0, total: int | None = None):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, initial=start, total=len(items) + start if total is None else total, desc=desc, unit=unit)
