"""What a `ServingEngine` is built from: its constructor's options checked, the padded batch its slots live in, the
adaptive-k policy, grammar constraints, the prefix cache, and the defaults that depend on which cache the target runs
on (prefix caching, chunked prefill, a draft model's catch-up budget)."""

from __future__ import annotations

import torch

from ..cache.paged import PagedKVCache
from ..cache.prefix import PrefixCache
from ..costs.adaptive import AdaptiveK
from ..costs.calibration import adaptive_costs
from ..decode.engine import steps_packed
from ..decode.row_sampling import RowSampling
from ..metrics import logger
from ..runners.distributed import tp_group
from ..runners.model_runner import ModelRunner
from ..speculators.draft_model import DraftModelSpeculator
from ..structured.constraints import RowConstraints
from ..structured.grammar import xgrammar
from ..types import SequenceBatch

DEFAULT_PREFIX_CACHE_TOKENS = 8192
# Prompt tokens a step feeds at most for prompts longer than that (chunked prefill), by device type: a piece costs
# the running rows about as much as a few of their steps on a CPU, and little beyond a step's fixed cost on a GPU.
DEFAULT_PREFILL_CHUNK_TOKENS = {"cpu": 256, "cuda": 2048}


def check_options(kv_region_tokens: int | None, max_num_blocks: int | None, prefix_cache_tokens: int | None,
                  prefill_chunk_tokens: int | None) -> int:
    """Refuses options that cannot be served (`ValueError`); returns `kv_region_tokens` with its default filled in."""
    if kv_region_tokens is None:
        kv_region_tokens = 0 if max_num_blocks is not None else 1024
    if kv_region_tokens < 0:
        raise ValueError(f"kv_region_tokens must be >= 0 (0 for no regions), got {kv_region_tokens}")
    if kv_region_tokens and max_num_blocks is not None:
        raise ValueError("kv_region_tokens and max_num_blocks cannot be combined (regions are held outside the "
                         "cap's accounting); pass kv_region_tokens=0 to cap the pool")
    if prefix_cache_tokens is not None and prefix_cache_tokens < 0:
        raise ValueError(f"prefix_cache_tokens must be >= 0 (0 for none), got {prefix_cache_tokens}")
    if prefill_chunk_tokens is not None and prefill_chunk_tokens < 0:
        raise ValueError(f"prefill_chunk_tokens must be >= 0 (0: whole prompts), got {prefill_chunk_tokens}")
    return kv_region_tokens


def capped_model_len(fits: int | None, max_model_len: int, max_num_blocks: int | None, block_size: int) -> int:
    """`max_model_len`, lowered to what one request can hold (`fits` tokens) in a pool capped at `max_num_blocks`."""
    if fits is None:
        return max_model_len
    # A request waits until its worst case fits the capped pool: one that never can would hold up the queue
    # for good (a request without max_tokens asks for the whole context).
    if fits < 2:
        raise ValueError(f"max_num_blocks={max_num_blocks} leaves no room for a request (one block of "
                         f"{block_size} tokens is the pool's scratch block, and a step's drafts need room); "
                         "raise it")
    if fits < max_model_len:
        logger.warning(f"hf_specdec: serving prompt + max_tokens up to {fits} tokens, what "
                       f"max_num_blocks={max_num_blocks} holds for one request")
        return fits
    return max_model_len


def make_batch(slots: int, width: int, device, pad_token_id: int, vocab_size: int,
               eos_token_ids: list[int]) -> SequenceBatch:
    """The engine's batch: `slots` rows of `width` token positions, every row free."""
    token_ids = torch.full((slots, width), pad_token_id, dtype=torch.long, device=device)
    sampling = RowSampling(slots, device, vocab_size, eos_token_ids)
    return SequenceBatch(token_ids, torch.zeros(slots, dtype=torch.long, device=device), [0] * slots, [],
                         0, False, sampling, vocab_size, sampling)


def adaptive_policy(model, speculator, target, slots: int, k: int, calibration: bool) -> AdaptiveK:
    cost, draft_cost, _ = adaptive_costs(model, speculator, None, calibration)
    # Arrivals change the batch every step, so k is not reproducible here anyway: the policy corrects the
    # step cost by the steps' own timings (a profile from an idle host misprices a loaded server's drafts).
    # And it checks them per batch size: what whole steps with drafts took beyond plain ones, against what
    # it priced (`returns.DraftReturns`). A model speculator's backlog (states or tokens of steps without
    # drafts, newcomers' prompts), read before it drafts again, is priced with the drafts (`price_reading`).
    return AdaptiveK(slots, k, cost, draft_cost, priors=speculator.confidence_priors, packed=steps_packed(target),
                     measure_steps=True, calibrate=True, check_returns=True, price_reading=True)


def row_constraints(tokenizer, slots: int, vocab_size: int) -> RowConstraints | None:
    """Grammar constraints for the engine's rows; `None` without xgrammar or a tokenizer (no structured output)."""
    try:
        xgrammar()
        if tokenizer is not None:
            return RowConstraints(slots, vocab_size, tokenizer=tokenizer)
    except ImportError:
        pass
    return None


def on_plain_paged_cache(target) -> bool:
    return type(target) is ModelRunner and type(target.cache) is PagedKVCache


def make_prefix_cache(tokens: int | None, block_size: int, model, target, speculator) -> PrefixCache | None:
    """The prefix cache for `prefix_cache_tokens=tokens` (`None`: the default), or `None` for none."""
    # Keys and values alone stand for a prefix only in a pure paged-attention cache (recurrent layers carry
    # state past them; the dense runner's rows are the model's own cache), on one process (tensor parallel
    # ranks would each decide alone).
    supported = on_plain_paged_cache(target) and tp_group(model) is None
    if tokens is None:
        tokens = DEFAULT_PREFIX_CACHE_TOKENS if supported else 0
    if not tokens:
        return None
    if not supported:
        raise ValueError(f"prefix caching needs a target on hf_specdec's paged KV cache; "
                         f"{type(model).__name__} runs outside it (recurrent layers, its own attention or "
                         "tensor parallelism): pass prefix_cache_tokens=0")
    rope = target.rope
    return PrefixCache(tokens, block_size, features=speculator.needs_hidden_states,
                       length_key=None if rope is None else rope.prefix_key)


def prefill_chunk(tokens: int | None, target, device) -> int | None:
    """The scheduler's chunked-prefill budget for `prefill_chunk_tokens=tokens` (`None`: the default); `None` for
    whole prompts."""
    if tokens is None:
        # Off by default where a piece costs more than its share: recurrent layers read a row's later pieces a
        # token at a time (their chunked scan starts from an empty state only), and the masked dense cache
        # compacts its rows whenever a piece and a step alternate.
        tokens = DEFAULT_PREFILL_CHUNK_TOKENS.get(device.type, 2048) if on_plain_paged_cache(target) else 0
    return tokens or None


def bound_catch_up(speculator, chunk: int | None, block_size: int) -> None:
    """A draft model reads a newcomer's prompt at its first draft for the row: no more of it a step than the
    target does (the scheduler's budget `chunk`, in whole blocks), unless the speculator was given its own."""
    if isinstance(speculator, DraftModelSpeculator) and speculator.catch_up_tokens is None:
        speculator.catch_up_tokens = chunk and -(-chunk // block_size) * block_size
