"""`hf-specdec train-eagle`: build (or reuse) the training set, train or fine-tune a head, write it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from ..models import load_model, trained_head
from ..speculators.heads import STORAGE_BITS
from .data import (
    TRAINING_PARTS_DIR,
    TRAINING_SET_NAME,
    TrainingSet,
    add_soft_labels,
    build_in_parts,
    default_layers,
    read_prompts,
    tokenize_prompts,
)
from .head import check_init_from_is_not_out, check_new_head_options, head_to_fine_tune_config
from .loop import train_eagle_head
from .prompts import HAND_WRITTEN, built_in_prompts, max_prompts


def add_arguments(parser) -> None:
    parser.add_argument("--target", required=True, help="the target: embedded model name, hub id or path")
    parser.add_argument("--out", required=True, help="output directory (head, checkpoint, training set)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", default=None, help="prompts file: one per line (.txt) or {\"prompt\": ...} "
                        "lines (.jsonl)")
    source.add_argument("--self-distill", type=int, default=None, metavar="N",
                        help=f"use the first N of the built-in prompts: {len(HAND_WRITTEN)} hand-written, then "
                        f"requests composed from task forms and subjects, {max_prompts()} in all (default: the "
                        f"hand-written {len(HAND_WRITTEN)})")
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


    if args.threads:
        torch.set_num_threads(args.threads)
    if args.soft_labels < 0:
        raise SystemExit(f"--soft-labels {args.soft_labels}: give the number of most likely tokens to learn from "
                         "(e.g. 16), or 0 for the argmax only")
    out = Path(args.out)
    target, tokenizer = load_model(args.target, device="cuda" if torch.cuda.is_available() else None)
    version, layers = _head_plan(args, target)
    start = time.perf_counter()
    try:
        data = _training_set(args, target, tokenizer, out, version, layers)
    except KeyboardInterrupt:
        print(f"\ninterrupted; the parts built so far are in {out / TRAINING_PARTS_DIR}, and the same command goes "
              "on from there", file=sys.stderr)
        return 130
    print(f"training set: {len(data.lengths)} sequences, {int(data.lengths.sum())} tokens, "
          f"{time.perf_counter() - start:.0f} s")
    draft_vocab = args.draft_vocab
    if draft_vocab is None and version == 3 and not args.init_from:
        draft_vocab = 8192  # the CLI's default for a new EAGLE-3 head; a fine-tuned head keeps its own
    try:
        result = train_eagle_head(target, data, out, version=version, steps=args.steps, batch_size=args.batch_size,
                                  lr=args.lr, num_unroll=args.unroll, draft_vocab_size=draft_vocab,
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


def _head_plan(args, target) -> tuple[int, list[int] | None]:
    """The head's EAGLE version and, for `--init-from`, the layers it reads (None: the version's default), with
    the options checked before any training data is built. `--init-from eagle` becomes the shipped head's path."""
    if args.init_from is None:
        version = args.version or 3
        try:
            check_new_head_options(version, args.draft_vocab)
        except ValueError as error:
            raise SystemExit(str(error)) from None
        return version, None
    if args.init_from == "eagle":
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
    return config["eagle_version"], list(config["target_hidden_states"]["layers"])


def _training_set(args, target, tokenizer, out: Path, version: int, layers: list[int] | None) -> TrainingSet:
    """The training set stored in `out` (built, or completed, first): the target's continuations of `--data` or
    of the built-in prompts."""
    data_file, parts_dir = out / TRAINING_SET_NAME, out / TRAINING_PARTS_DIR
    if args.rebuild_data:
        shutil.rmtree(parts_dir, ignore_errors=True)
    if data_file.is_file() and not args.rebuild_data and not parts_dir.is_dir():
        data = TrainingSet.load(data_file)  # a set saved whole by an earlier version
        print(f"reusing the training set in {data_file} ({len(data.lengths)} sequences)")
        return add_soft_labels(target, data, args.soft_labels) if args.soft_labels else data
    if args.data:
        prompts = read_prompts(args.data)
    else:
        count = args.self_distill or len(HAND_WRITTEN)
        if not 1 <= count <= max_prompts():
            raise SystemExit(f"--self-distill {count}: choose 1 to {max_prompts()} built-in prompts, or give "
                             "your own with --data FILE (more samples per prompt: --samples-per-prompt)")
        prompts = built_in_prompts(count, seed=args.seed)
    recipe = {"target": args.target, "max_new_tokens": args.max_new_tokens,
              "samples_per_prompt": args.samples_per_prompt, "temperature": 0.7, "data_dtype": args.data_dtype,
              "seed": args.seed}
    dtype = target.dtype
    target.to(getattr(torch, args.data_dtype))
    try:
        return build_in_parts(target, tokenize_prompts(tokenizer, prompts), layers or default_layers(target, version),
                              parts_dir, recipe, part_size=args.data_part_size, progress=True,
                              soft_top_k=args.soft_labels, max_new_tokens=args.max_new_tokens,
                              samples_per_prompt=args.samples_per_prompt, batch_size=args.generation_batch_size,
                              eos_token_id=tokenizer.eos_token_id, seed=args.seed, feature_dtype=torch.bfloat16)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    finally:
        target.to(dtype)
