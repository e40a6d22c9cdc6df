"""Whether a target and a draft tokenizer map token ids to the same strings."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable


class TokenizerMismatchError(ValueError):
    """The draft's tokenizer does not match the target's, so its token ids would mean other strings."""


def check_tokenizers_match(target_tokenizer, draft_tokenizer) -> None:
    """Raises `TokenizerMismatchError` saying what differs; returns quietly when the two agree.

    Vocabularies are compared id by id over the ids both define, and their sizes must agree; embedding padding past
    the tokenizer (as in the Qwen2.5 family) is not part of a tokenizer and so does not count. Special tokens must match.
    """
    if target_tokenizer is draft_tokenizer:
        return
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    problems = []
    if len(target_vocab) != len(draft_vocab):
        problems.append(f"vocabulary sizes differ: target {len(target_vocab)}, draft {len(draft_vocab)}")
    target_by_id = {i: t for t, i in target_vocab.items()}
    draft_by_id = {i: t for t, i in draft_vocab.items()}
    for token_id in sorted(set(target_by_id) & set(draft_by_id)):
        if target_by_id[token_id] != draft_by_id[token_id]:
            problems.append(f"id {token_id} is {target_by_id[token_id]!r} for the target but "
                            f"{draft_by_id[token_id]!r} for the draft")
            break
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        ours, theirs = getattr(target_tokenizer, name, None), getattr(draft_tokenizer, name, None)
        if ours is not None and theirs is not None and ours != theirs:
            problems.append(f"{name} differs: target {ours}, draft {theirs}")
    if problems:
        raise TokenizerMismatchError(
            "the draft's tokenizer does not match the target's: " + "; ".join(problems)
            + ". Speculative decoding needs one shared tokenizer: pick a draft from the target's model family, "
            "or use speculator='ngram', which needs no draft model"
        )


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes as characters (GPT-2's scheme): printable Latin-1 bytes stand for
    themselves, the other 68 are moved past 255 in order. Character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


@dataclass(frozen=True)
class ByteSpelling:
    """How a tokenizer spells its tokens in bytes: `spell(token id)` gives a token's raw bytes (special tokens none:
    they are not part of the text), and `strip_start` how many leading spaces its decoder drops from the start of a
    text (Llama 2's `Strip`, a `Metaspace` decoder's prefix space)."""

    spell: Callable[[int], bytes]
    strip_start: int = 0


def backend_decoder(tokenizer) -> dict | None:
    """A fast tokenizer's backend decoder as its JSON (`{}` for none); `None` where it cannot be read: a slow
    tokenizer, or a custom Python decoder (the backend cannot serialize it)."""
    try:
        return json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except Exception:  # noqa: BLE001 - the backend raises a bare Exception for a custom decoder
        return None


def _decoder_parts(decoder: dict) -> list[dict]:
    parts = [decoder]
    for part in decoder.get("decoders") or []:
        parts += _decoder_parts(part)
    return parts


def token_bytes(tokenizer) -> ByteSpelling | None:
    """The byte spelling of tokenizers whose tokens are bytes (byte-level BPE as GPT-2's, Llama 3's, SmolLM's;
    SentencePiece with byte fallback as Llama 2's, Gemma's), where a token may hold part of a character; `None` for
    others (their tokens are whole characters). Cached on the tokenizer."""
    cached = getattr(tokenizer, "_hf_specdec_token_bytes", False)
    if cached is not False:
        return cached
    parts = _decoder_parts(backend_decoder(tokenizer) or {})
    kinds = {part.get("type") for part in parts}
    special = set(getattr(tokenizer, "all_special_ids", ()) or ()) | {
        i for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
        if getattr(added, "special", False)}
    strip = sum(p.get("start", 0) for p in parts if p.get("type") == "Strip" and p.get("content") == " ")
    strip += any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never" for p in parts)
    spelling = None
    if "ByteLevel" in kinds:
        alphabet = _byte_level_alphabet()

        def spell(token_id: int) -> bytes:
            if token_id in special:
                return b""
            piece = tokenizer.convert_ids_to_tokens(token_id) or ""
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return piece.encode("utf-8")  # an added token spelled in plain text
        spelling = ByteSpelling(spell, strip)
    elif "ByteFallback" in kinds:
        replaces = [(p["pattern"]["String"], p["content"]) for p in parts
                    if p.get("type") == "Replace" and "String" in (p.get("pattern") or {})]
        replaces += [(p.get("replacement", "\u2581"), " ") for p in parts if p.get("type") == "Metaspace"]

        def spell(token_id: int) -> bytes:
            if token_id in special:
                return b""
            piece = tokenizer.convert_ids_to_tokens(token_id) or ""
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
            if byte:
                return bytes([int(byte.group(1), 16)])
            for old, new in replaces:
                piece = piece.replace(old, new)
            return piece.encode("utf-8")
        spelling = ByteSpelling(spell, strip)
    try:
        tokenizer._hf_specdec_token_bytes = spelling
    except AttributeError:
        pass
    return spelling
