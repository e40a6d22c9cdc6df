"""`model.generate(..., speculator=...)`: the generation strategy hf_specdec registers on import.

`GenerationMixin.generate` is wrapped once. Without `speculator=` the call goes to transformers untouched. With it,
transformers still prepares everything as usual (generation config, special tokens, attention mask, logits processors,
stopping criteria) and then hands over to our engine through its documented `custom_generate=` callable hook.
"""

from __future__ import annotations

import copy
import functools
from contextlib import contextmanager
from dataclasses import dataclass

from transformers import GenerationMixin
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.logits_process import LogitsProcessorList, PrefixConstrainedLogitsProcessor
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .costs.step_cost import StepCost
from .decode.engine import SpeculativeEngine
from .decode.speculator import Speculator
from .metrics import SpeculativeMetrics
from .runners.support import check_model_supported, exact_context
from .speculators.grammar import GrammarSpeculator
from .speculators.resolve import resolve_speculator
from .structured.constraints import RowConstraints
from .structured.grammar import Grammar, compile_grammars, xgrammar
from .tokenizers import check_tokenizers_match

# Without `num_speculative_tokens` each speculator's own default applies (`Speculator.default_num_speculative_tokens`:
# 5, the lookup's 10, the grammar's 16).
DEFAULT_NUM_SPECULATIVE_TOKENS = Speculator.default_num_speculative_tokens
DEFAULT_GRAMMAR_TOKENS = GrammarSpeculator.default_num_speculative_tokens
MAX_NUM_SPECULATIVE_TOKENS = 64
MAX_TREE_NODES = 256
DEFAULT_TREE_BRANCHING = 4
# model_kwargs that transformers prepares on its own and our engine replaces (mask handled, positions recomputed).
_PREPARED_MODEL_KWARGS = ("attention_mask", "position_ids", "past_key_values", "cache", "use_cache",
                          "logits_to_keep", "cache_position")  # transformers >= 5.24 names the cache `cache`
_OWN_OPTIONS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "custom_generate")
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the call's `speculative_metrics` (a `SpeculativeMetrics`). Its
    `past_key_values` is None: the keys and values lived in hf_specdec's paged cache, freed when the call returned
    (a later `generate` given None recomputes them from the prompt, as with `use_cache=False`)."""

    speculative_metrics: SpeculativeMetrics | None = None


def _check_num_speculative_tokens(k) -> int:
    if k is None:
        return DEFAULT_NUM_SPECULATIVE_TOKENS
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
        raise ValueError(
            f"num_speculative_tokens must be an int from 1 to {MAX_NUM_SPECULATIVE_TOKENS}, got {k!r}; "
            f"{DEFAULT_NUM_SPECULATIVE_TOKENS} is a good start"
        )
    return k


def _check_tree(nodes, branching, schedule) -> tuple[int | None, int]:
    if nodes is None:
        if branching is not None:
            raise ValueError("speculative_tree_branching= only applies together with speculative_tree_nodes=")
        return None, DEFAULT_TREE_BRANCHING
    for name, value in (("speculative_tree_nodes", nodes), ("speculative_tree_branching", branching)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not
                                  1 <= value <= MAX_TREE_NODES):
            raise ValueError(f"{name} must be an int from 1 to {MAX_TREE_NODES}, got {value!r}")
    if branching is not None and branching > nodes:
        raise ValueError(f"speculative_tree_branching={branching} is more children than the tree's "
                         f"speculative_tree_nodes={nodes}; keep branching at most the node count (4 to 10 is usual)")
    if schedule == "adaptive":
        raise ValueError("draft trees have a fixed shape: speculative_tree_nodes= goes with "
                         "speculative_schedule='constant' (or leave speculative_schedule unset)")
    return nodes, min(DEFAULT_TREE_BRANCHING, nodes) if branching is None else branching


def _speculative_generate(self, *args, speculator=None, num_speculative_tokens=None, speculative_schedule=None,
                          speculative_step_cost=None, speculative_tree_nodes=None, speculative_tree_branching=None,
                          grammar=None, speculative_calibration=None, **kwargs):
    if grammar is not None and speculator is None:  # plain constrained decoding, through xgrammar's own processor
        compiled = compile_grammars(grammar, 1 if isinstance(grammar, Grammar) else len(grammar),
                                    kwargs.get("tokenizer"), _vocab_size(self), _eos_ids(self, kwargs))
        if compiled is not None:
            kwargs["logits_processor"] = LogitsProcessorList(
                [*(kwargs.get("logits_processor") or []),
                 xgrammar().contrib.hf.LogitsProcessor(compiled if len(compiled) > 1 else compiled[0])])
    if speculator is None:
        for name, value in (("num_speculative_tokens", num_speculative_tokens),
                            ("speculative_schedule", speculative_schedule),
                            ("speculative_step_cost", speculative_step_cost),
                            ("speculative_tree_nodes", speculative_tree_nodes),
                            ("speculative_tree_branching", speculative_tree_branching),
                            ("speculative_calibration", speculative_calibration)):
            if value is not None:
                raise ValueError(f"{name}= only applies together with speculator=")
        return _speculative_generate.original(self, *args, **kwargs)
    if grammar is not None:  # an invalid schema, regex or grammar is refused before anything runs
        grammars = grammar if isinstance(grammar, (list, tuple)) else [grammar]
        if any(g is not None for g in grammars) and _eos_ids(self, kwargs) is None:
            raise ValueError(_NO_EOS_WITH_GRAMMAR.format("grammar="))
        for g in {id(g): g for g in grammars}.values():
            if isinstance(g, Grammar):
                g.compile(kwargs.get("tokenizer"), _vocab_size(self), _eos_ids(self, kwargs))
    spec = resolve_speculator(speculator)
    k = _check_num_speculative_tokens(num_speculative_tokens)
    if num_speculative_tokens is None:
        k = spec.default_num_speculative_tokens
    tree_nodes, tree_branching = _check_tree(speculative_tree_nodes, speculative_tree_branching,
                                             speculative_schedule)
    schedule = speculative_schedule or ("adaptive" if tree_nodes is None else "constant")
    if schedule not in ("adaptive", "constant"):
        raise ValueError(f"speculative_schedule must be 'adaptive' (k chosen each step, at most "
                         f"num_speculative_tokens) or 'constant', got {speculative_schedule!r}")
    if speculative_step_cost is not None and not isinstance(speculative_step_cost, StepCost):
        raise TypeError(f"speculative_step_cost must be a hf_specdec.StepCost (StepCost.measure(model) makes one), "
                        f"got {type(speculative_step_cost).__name__}")
    if speculative_step_cost is not None and schedule != "adaptive":
        raise ValueError("speculative_step_cost= only applies to speculative_schedule='adaptive'")
    if speculative_calibration not in (None, True, False):
        raise TypeError(f"speculative_calibration must be True (use this host's cached profile, the default) or "
                        f"False (static defaults), got {speculative_calibration!r}")
    for name in _OWN_OPTIONS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{name}= cannot be combined with speculator=; hf_specdec replaces it (pass one or the other)"
            )
    cache_implementation = kwargs.get("cache_implementation")
    if cache_implementation == "paged":  # transformers would switch to its continuous batching, dropping speculator=
        raise ValueError("cache_implementation='paged' switches generate to transformers' continuous batching, "
                         "which runs no speculator; drop it: speculator= always decodes over hf_specdec's own paged "
                         "KV cache (for many requests, hf_specdec.ServingEngine or `hf-specdec serve`)")
    if cache_implementation not in (None, "dynamic"):
        raise ValueError(f"cache_implementation={cache_implementation!r} does not apply with speculator=: it decodes "
                         "over hf_specdec's own paged KV cache, sized to the batch; drop cache_implementation=")
    check_model_supported(self, role="target model")
    spec.validate(self)
    tokenizer, assistant_tokenizer = kwargs.get("tokenizer"), kwargs.pop("assistant_tokenizer", None)
    if assistant_tokenizer is not None:
        if tokenizer is None:
            raise ValueError("assistant_tokenizer= needs tokenizer= too, so the two can be compared")
        check_tokenizers_match(tokenizer, assistant_tokenizer)
    stop_strings = kwargs.pop("stop_strings", None)
    passed = kwargs.get("generation_config")
    config = passed or self.generation_config
    if getattr(config, "token_healing", False) or kwargs.get("token_healing"):
        raise ValueError("token_healing is not supported with speculator=; drop it (or call generate without "
                         "speculator=)")
    # Stop strings set in a GenerationConfig (the call's, else the model's own, as transformers merges them) are
    # matched by our criterion; transformers must not see them, as it would build its own and want tokenizer=,
    # which it does not keep for a custom decoding function.
    if stop_strings is None:
        own = getattr(passed, "stop_strings", None)  # an explicit [] in the caller's config turns them off
        stop_strings = own if own is not None else getattr(self.generation_config, "stop_strings", None)
        stop_strings = stop_strings or None
    if getattr(passed, "stop_strings", None) is not None:
        kwargs["generation_config"] = copy.deepcopy(passed)
        kwargs["generation_config"].stop_strings = None  # the caller's config is left as it was
    if stop_strings is not None:  # transformers builds this criterion only for its own decoding methods
        if tokenizer is None:
            raise ValueError("stop_strings= needs tokenizer= so the strings can be matched against tokens")
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer, stop_strings))
        kwargs["stopping_criteria"] = criteria
    streamer = kwargs.get("streamer")
    constraint = (grammar, tokenizer)

    def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        return _decode(model, spec, k, schedule, speculative_step_cost, input_ids, logits_processor,
                       stopping_criteria, generation_config, streamer, model_kwargs, (tree_nodes, tree_branching),
                       constraint, calibration=speculative_calibration is not False)

    with _stop_strings_hidden(self.generation_config):
        return _speculative_generate.original(self, *args, custom_generate=decode, **kwargs)


@contextmanager
def _stop_strings_hidden(config):
    """The model's own generation config without stop strings for the duration (transformers would merge them into
    the call's config and build a criterion needing tokenizer=); ours matches them."""
    saved = getattr(config, "stop_strings", None)
    if saved is None:
        yield
        return
    config.stop_strings = None
    try:
        yield
    finally:
        config.stop_strings = saved


def _cache_filled(cache) -> bool:
    try:
        return cache.get_seq_length() > 0
    except ValueError:  # a cache of recurrent layers only (Mamba) holds no length; it holds a state or not
        return cache.has_previous_state()


def _decode(model, speculator, k, schedule, step_cost, input_ids, logits_processor, stopping_criteria,
            generation_config, streamer, model_kwargs, tree=(None, DEFAULT_TREE_BRANCHING), constraint=(None, None),
            calibration=True):
    config = generation_config
    if config.num_beams > 1:
        raise ValueError(f"speculative decoding does not support beam search (num_beams={config.num_beams}); "
                         "use num_beams=1")
    # A custom decoding function skips transformers' own dispatch on the mode: other modes would silently decode
    # greedily here.
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"speculative decoding runs greedy search or sampling, not {mode.value} (set by "
                         f"{_MODE_OPTIONS.get(mode, 'the generation config')}); drop it or call generate without "
                         "speculator=")
    requested = [name for name in _UNSUPPORTED_OUTPUTS if getattr(config, name, False)]
    if requested:
        raise NotImplementedError(f"{', '.join(requested)} are not supported with speculator= yet; drop them")
    # A model whose config turns the cache off by default (MPT's, for training) still decodes with ours; only a
    # caller's own use_cache=False is refused.
    if config.use_cache is False and getattr(model.generation_config, "use_cache", True) is not False:
        raise ValueError("speculative decoding needs a KV cache; drop use_cache=False")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and _cache_filled(cache):
        raise ValueError("speculator= cannot continue from a filled past_key_values; pass the full prompt instead")
    # A multimodal model given text only gets `mm_encoder_outputs={}` from transformers: empty means not given.
    unknown = sorted(name for name, value in model_kwargs.items() if name not in _PREPARED_MODEL_KWARGS
                     and value is not None and not (isinstance(value, dict) and not value))
    if unknown:
        raise ValueError(f"generate arguments {unknown} are not supported with speculator=; drop them")
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("streamer= needs batch size 1 (tokens of different rows arrive at different steps)")
    max_new_tokens = config.max_length - input_ids.shape[1]
    max_positions, why = exact_context(model)
    if max_positions is not None and config.max_length > max_positions:
        limit = f"the model's context of {max_positions} tokens" if why is None else (
            f"{max_positions} tokens, the most speculative decoding serves for this model ({why})")
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds {limit}; lower "
            "max_new_tokens or shorten the prompt"
        )
    eos = config._eos_token_tensor
    pad = config._pad_token_tensor
    per_row = [type(c).__name__ for c in stopping_criteria or []
               if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria, MaxTimeCriteria))]
    if eos is None and per_row and input_ids.shape[0] > 1:
        # Without an EOS plain generate pads nothing: a row its criterion stopped goes on generating until every row
        # has stopped, and all end at one length. Rows here end where they stop, so the outputs would differ.
        raise ValueError(
            f"stopping criteria ({', '.join(per_row)}: stop_strings= or stopping_criteria=) at batch size "
            f"{input_ids.shape[0]} need an eos_token_id with speculator=: without one, plain generate keeps "
            "generating a stopped row until every row has stopped, which speculative decoding does not reproduce; "
            "pass eos_token_id= (stopped rows are then padded, as plain generate pads them) or one row per call")
    pad_token_id = int(pad) if pad is not None else (int(eos.flatten()[0]) if eos is not None else 0)
    logits_processor, constraints = _constraints(model, speculator, input_ids.shape[0], logits_processor,
                                                 constraint, config)
    engine = SpeculativeEngine(model, speculator, k, schedule=schedule, step_cost=step_cost, tree_nodes=tree[0],
                               tree_branching=tree[1], calibration=calibration, generation_config=config)
    sequences, metrics = engine.generate(
        input_ids, model_kwargs.get("attention_mask"), max_new_tokens, config.do_sample, logits_processor,
        stopping_criteria, eos.flatten() if eos is not None else None, pad_token_id, streamer, constraints,
    )
    if config.return_dict_in_generate:
        return SpeculativeGenerateOutput(sequences=sequences, speculative_metrics=metrics)
    return sequences


# The options that turn on each decoding mode speculation cannot run, as `GenerationConfig.get_generation_mode` reads
# them.
_MODE_OPTIONS = {
    GenerationMode.CONTRASTIVE_SEARCH: "penalty_alpha with top_k > 1",
    GenerationMode.DOLA_GENERATION: "dola_layers",
    GenerationMode.CONSTRAINED_BEAM_SEARCH: "force_words_ids or constraints",
    GenerationMode.ASSISTED_GENERATION: "use_mtp, assistant_early_exit, assistant_model or prompt_lookup_num_tokens",
    GenerationMode.GROUP_BEAM_SEARCH: "num_beam_groups",
}


# Without an EOS, plain constrained generate goes on past the grammar's end, and xgrammar's processor decides what
# follows there, which speculation does not reproduce: the outputs would differ, so the call is refused.
_NO_EOS_WITH_GRAMMAR = ("{} with speculator= needs an eos_token_id (none on the call or in the model's generation "
                        "config): a grammar's answer ends with the EOS token, and without one plain generate goes on "
                        "past the grammar's end, which speculative decoding does not reproduce; pass "
                        "eos_token_id=tokenizer.eos_token_id (or set model.generation_config.eos_token_id)")


def _vocab_size(model) -> int:
    return model.config.get_text_config().vocab_size


def _eos_ids(model, kwargs) -> list[int] | None:
    """The EOS ids a plain `generate` call with these kwargs stops at (a grammar's completion token). Without any,
    xgrammar would take the tokenizer's EOS as the grammar's stop token, one generate does not stop at."""
    eos = kwargs.get("eos_token_id")
    if eos is None:
        eos = getattr(kwargs.get("generation_config"), "eos_token_id", None)
    if eos is None:  # transformers fills what the call's generation config leaves unset from the model's
        eos = model.generation_config.eos_token_id
    if eos is None:
        return None
    return [int(e) for e in (eos.flatten().tolist() if hasattr(eos, "flatten") else
                             eos if isinstance(eos, (list, tuple)) else [eos])]


def _constraints(model, speculator, num_rows, logits_processor, constraint, config):
    """Takes the call's constraints out of its logits processors: `grammar=`, transformers'
    `PrefixConstrainedLogitsProcessor` (from `prefix_allowed_tokens_fn=`) and xgrammar's transformers processor.
    Returns `(the other processors, RowConstraints or None)`."""
    grammar, tokenizer = constraint
    kept, prefix_fn, found = LogitsProcessorList(), None, []
    for p in logits_processor or []:
        if isinstance(p, PrefixConstrainedLogitsProcessor):
            prefix_fn = p._prefix_allowed_tokens_fn
            found.append("prefix_allowed_tokens_fn=")
        elif type(p).__module__.startswith("xgrammar") and hasattr(p, "compiled_grammars"):
            if getattr(p, "matchers", None):
                raise ValueError("this xgrammar LogitsProcessor was already used by a generate call; xgrammar's "
                                 "processor holds one call's state: make a new one per call (or pass grammar=)")
            grammar = [Grammar.compiled(c) for c in p.compiled_grammars]
            found.append("xgrammar's LogitsProcessor")
        else:
            kept.append(p)
    if constraint[0] is not None:
        found.append("grammar=")
    if len(found) > 1:
        raise ValueError(f"one constraint per call: got {' and '.join(found)}; pass only one")
    compiled = None
    if grammar is not None:
        if isinstance(grammar, (list, tuple)) and len(grammar) == 1:
            grammar = grammar[0]
        if isinstance(grammar, (list, tuple)) and num_rows % len(grammar) == 0 and num_rows != len(grammar):
            grammar = [g for g in grammar for _ in range(num_rows // len(grammar))]  # num_return_sequences
        eos = config._eos_token_tensor
        constrained = any(g is not None for g in (grammar if isinstance(grammar, (list, tuple)) else [grammar]))
        if eos is None and constrained:
            raise ValueError(_NO_EOS_WITH_GRAMMAR.format(" or ".join(found)))
        compiled = compile_grammars(grammar, num_rows, tokenizer, _vocab_size(model),
                                    eos.flatten().tolist() if eos is not None else None)
    if getattr(speculator, "needs_constraint", False) and compiled is None and prefix_fn is None:
        raise ValueError("speculator='grammar' drafts only the tokens a grammar forces: pass grammar= (an "
                         "hf_specdec.Grammar) or prefix_allowed_tokens_fn=, or use another speculator")
    if compiled is None and prefix_fn is None:
        return kept, None
    return kept, RowConstraints(num_rows, _vocab_size(model), compiled, prefix_fn, tokenizer)


def register_generation_strategy() -> None:
    """Wraps `GenerationMixin.generate` so it accepts `speculator=` (idempotent)."""
    current = GenerationMixin.generate
    if getattr(current, "_hf_specdec", False):
        return
    wrapped = functools.wraps(current)(_speculative_generate)
    wrapped._hf_specdec = True
    _speculative_generate.original = current
    GenerationMixin.generate = wrapped
