"""What the command line's speculator options name: 'ngram', 'eagle', head directories, draft models (optionally
quantized as they load), 'ngram+HEAD' hybrids; and the --tree and --grammar options."""

from __future__ import annotations

from pathlib import Path

from ..models import EMBEDDED_MODELS, has_trained_head, load_causal_lm, load_tokenizer, trained_head
from ..quantization import QUANTIZATIONS, load_draft
from ..speculators.convert_head import head_speculator_from_dir
from ..speculators.eagle import EagleSpeculator
from ..speculators.head_format import CONFIG_NAME as HEAD_CONFIG_NAME
from ..speculators.heads import CONFIG_NAME as EAGLE_CONFIG_NAME
from ..speculators.hybrid import HybridSpeculator
from ..structured.grammar import Grammar, GrammarError
from ..tokenizers import check_tokenizers_match


def speculator_from_spec(spec: str, target, target_tokenizer, quantization: str | None = None, model_name: str = ""):
    """'ngram', 'eagle' (the trained head shipped for the embedded model `model_name`), a head directory,
    'ngram+eagle' or 'ngram+HEAD_DIR' (`HybridSpeculator`: lookup where the text repeats, the head elsewhere), or a
    draft model loaded like the target (its tokenizer, when it has one, must match), optionally quantized as it
    loads (`hf_specdec.load_draft`); pre-quantized checkpoints load as they are."""
    if (spec in ("ngram", "eagle", "grammar") or spec.startswith("ngram+")) and quantization is not None:
        raise SystemExit(f"--draft-quantization {quantization} applies to draft models, not to {spec!r}")
    if spec in ("ngram", "grammar"):
        return spec
    if spec.startswith("ngram+"):
        head = speculator_from_spec(spec[len("ngram+"):], target, target_tokenizer, model_name=model_name)
        if not isinstance(head, EagleSpeculator):
            raise SystemExit(f"{spec!r}: after 'ngram+' give 'eagle' or an EAGLE head directory (a draft model or "
                             "other head does not combine with the lookup)")
        return HybridSpeculator(head)
    if spec == "eagle":
        try:
            return EagleSpeculator.from_pretrained(trained_head(model_name))
        except ValueError as error:
            raise SystemExit(f"--speculator eagle: {error}") from None
    if (Path(spec) / EAGLE_CONFIG_NAME).is_file():  # a converted EAGLE head (hf-specdec convert-eagle)
        return EagleSpeculator.from_pretrained(spec)
    if (Path(spec) / HEAD_CONFIG_NAME).is_file():  # a converted MLP speculator or Medusa head (convert-head)
        return head_speculator_from_dir(spec)
    quantize = dict(quantization=quantization, target=target, tokenizer=target_tokenizer)
    if spec in EMBEDDED_MODELS:  # GGUF weights: load, then quantize a copy
        draft = load_draft(load_causal_lm(spec, dtype=target.dtype, device=target.device), **quantize)
    else:
        draft = load_draft(spec, dtype=target.dtype, device=target.device, **quantize)
    try:
        draft_tokenizer = load_tokenizer(spec)
    except (OSError, ValueError):
        draft_tokenizer = None  # no tokenizer beside the draft: generate still checks vocabulary sizes
    if draft_tokenizer is not None:
        check_tokenizers_match(target_tokenizer, draft_tokenizer)
    return draft


def quantizations_for(spec: str) -> list[str | None]:
    """'none,fp8' -> [None, 'fp8'], refusing unknown names."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in ("none", *QUANTIZATIONS)]
    if unknown or not names:
        raise SystemExit(f"--draft-quantization: unknown {unknown or [spec]}; choose from none, "
                         f"{', '.join(QUANTIZATIONS)}")
    return [None if name == "none" else name for name in names]


def run_speculators(args, model, tokenizer) -> dict[str, object]:
    """`run`'s speculators: with `--speculator auto`, n-gram, the trained EAGLE head shipped for the model and the
    two combined (`HybridSpeculator`)."""
    names = [args.speculator]
    if args.speculator == "auto":
        names = ["ngram"] + (["eagle", "ngram+eagle"] if has_trained_head(args.model) else [])
    return {name: speculator_from_spec(name, model, tokenizer, model_name=args.model) for name in names}


def grammar_from_args(args):
    """The `hf_specdec.Grammar` that `generate`'s --json-schema FILE / --json / --regex PATTERN / --grammar FILE
    ask for, or None."""

    given = [name for name in ("json_schema", "json", "regex", "grammar") if getattr(args, name)]
    if len(given) > 1:
        raise SystemExit(f"give one of --json-schema, --json, --regex, --grammar (got {len(given)})")
    try:
        if args.json_schema:
            return Grammar.json_schema(Path(args.json_schema).read_text())
        if args.grammar:
            return Grammar.ebnf(Path(args.grammar).read_text())
    except OSError as error:
        raise SystemExit(f"hf-specdec generate: cannot read {error.filename}: {error.strerror}") from None
    except GrammarError as error:
        raise SystemExit(f"hf-specdec generate: {args.json_schema}: {error}") from None
    if args.regex:
        return Grammar.regex(args.regex)
    return Grammar.json() if args.json else None


def tree_shapes(text: str, option: str = "--trees") -> tuple[tuple[int, int], ...]:
    shapes = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        nodes, _, branching = item.partition("x")
        if not (nodes.isdigit() and branching.isdigit() and int(nodes) > 0 and int(branching) > 0):
            raise SystemExit(f"{option} {text!r}: give NODESxBRANCHING shapes, comma-separated, e.g. 16x4,32x4")
        shapes.append((int(nodes), int(branching)))
    return tuple(shapes)
