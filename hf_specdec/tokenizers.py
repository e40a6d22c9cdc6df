"""Whether a target and a draft tokenizer map token ids to the same strings."""

from __future__ import annotations


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
