"""`model.generate(..., speculator=...)`: the generation strategy hf_specdec registers on import.

`GenerationMixin.generate` is wrapped once. Without `speculator=` the call goes to transformers untouched. With it,
transformers still prepares everything as usual (generation config, special tokens, attention mask, logits processors,
stopping criteria) and then hands over to our engine through its documented `custom_generate=` callable hook.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from transformers import GenerationMixin, PreTrainedModel
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .adaptive import StepCost
from .compat import check_model_supported
from .engine import SpeculativeEngine
from .metrics import SpeculativeMetrics
from .speculators.base import Speculator
from .speculators.draft_model import DraftModelSpeculator
from .speculators.ngram import NgramSpeculator

DEFAULT_NUM_SPECULATIVE_TOKENS = 5
MAX_NUM_SPECULATIVE_TOKENS = 64
MAX_TREE_NODES = 256
DEFAULT_TREE_BRANCHING = 4
# model_kwargs that transformers prepares on its own and our engine replaces (mask handled, positions recomputed).
_PREPARED_MODEL_KWARGS = ("attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep",
                          "cache_position")
_OWN_OPTIONS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "custom_generate")
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus the call's `speculative_metrics` (a `SpeculativeMetrics`)."""

    speculative_metrics: SpeculativeMetrics | None = None


def resolve_speculator(speculator) -> Speculator:
    """Turns what a user passed as `speculator=` into a `Speculator`, or raises naming `speculator`."""
    if isinstance(speculator, Speculator):
        return speculator
    if isinstance(speculator, PreTrainedModel):
        return DraftModelSpeculator(speculator)
    if isinstance(speculator, str):
        if speculator == "ngram":
            return NgramSpeculator()
        raise ValueError(
            f"speculator={speculator!r} is not a known speculator name; pass 'ngram', a draft PreTrainedModel "
            "(load one with AutoModelForCausalLM.from_pretrained) or an hf_specdec.Speculator"
        )
    raise TypeError(
        f"speculator= must be a draft PreTrainedModel, 'ngram' or an hf_specdec.Speculator, "
        f"got {type(speculator).__name__}"
    )


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
                          **kwargs):
    if speculator is None:
        for name, value in (("num_speculative_tokens", num_speculative_tokens),
                            ("speculative_schedule", speculative_schedule),
                            ("speculative_step_cost", speculative_step_cost),
                            ("speculative_tree_nodes", speculative_tree_nodes),
                            ("speculative_tree_branching", speculative_tree_branching)):
            if value is not None:
                raise ValueError(f"{name}= only applies together with speculator=")
        return _speculative_generate.original(self, *args, **kwargs)
    spec = resolve_speculator(speculator)
    k = _check_num_speculative_tokens(num_speculative_tokens)
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
    for name in _OWN_OPTIONS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{name}= cannot be combined with speculator=; hf_specdec replaces it (pass one or the other)"
            )
    check_model_supported(self, role="target model")
    spec.validate(self)
    tokenizer, assistant_tokenizer = kwargs.get("tokenizer"), kwargs.pop("assistant_tokenizer", None)
    if assistant_tokenizer is not None:
        from .tokenizers import check_tokenizers_match

        if tokenizer is None:
            raise ValueError("assistant_tokenizer= needs tokenizer= too, so the two can be compared")
        check_tokenizers_match(tokenizer, assistant_tokenizer)
    stop_strings = kwargs.pop("stop_strings", None)
    if stop_strings is not None:  # transformers builds this criterion only for its own decoding methods
        if tokenizer is None:
            raise ValueError("stop_strings= needs tokenizer= so the strings can be matched against tokens")
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer, stop_strings))
        kwargs["stopping_criteria"] = criteria
    streamer = kwargs.get("streamer")

    def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        return _decode(model, spec, k, schedule, speculative_step_cost, input_ids, logits_processor,
                       stopping_criteria, generation_config, streamer, model_kwargs, (tree_nodes, tree_branching))

    return _speculative_generate.original(self, *args, custom_generate=decode, **kwargs)


def _decode(model, speculator, k, schedule, step_cost, input_ids, logits_processor, stopping_criteria,
            generation_config, streamer, model_kwargs, tree=(None, DEFAULT_TREE_BRANCHING)):
    config = generation_config
    if config.num_beams > 1:
        raise ValueError(f"speculative decoding does not support beam search (num_beams={config.num_beams}); "
                         "use num_beams=1")
    requested = [name for name in _UNSUPPORTED_OUTPUTS if getattr(config, name, False)]
    if requested:
        raise NotImplementedError(f"{', '.join(requested)} are not supported with speculator= yet; drop them")
    if config.use_cache is False:
        raise ValueError("speculative decoding needs a KV cache; drop use_cache=False")
    cache = model_kwargs.get("past_key_values")
    if cache is not None and cache.get_seq_length() > 0:
        raise ValueError("speculator= cannot continue from a filled past_key_values; pass the full prompt instead")
    unknown = sorted(set(model_kwargs) - set(_PREPARED_MODEL_KWARGS))
    if unknown:
        raise ValueError(f"generate arguments {unknown} are not supported with speculator=; drop them")
    if streamer is not None and input_ids.shape[0] > 1:
        raise ValueError("streamer= needs batch size 1 (tokens of different rows arrive at different steps)")
    max_new_tokens = config.max_length - input_ids.shape[1]
    max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_positions is not None and config.max_length > max_positions:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
            f"of {max_positions} tokens; lower max_new_tokens or shorten the prompt"
        )
    eos = config._eos_token_tensor
    pad = config._pad_token_tensor
    pad_token_id = int(pad) if pad is not None else (int(eos.flatten()[0]) if eos is not None else 0)
    engine = SpeculativeEngine(model, speculator, k, schedule=schedule, step_cost=step_cost, tree_nodes=tree[0],
                               tree_branching=tree[1])
    sequences, metrics = engine.generate(
        input_ids, model_kwargs.get("attention_mask"), max_new_tokens, config.do_sample, logits_processor,
        stopping_criteria, eos.flatten() if eos is not None else None, pad_token_id, streamer,
    )
    if config.return_dict_in_generate:
        return SpeculativeGenerateOutput(sequences=sequences, speculative_metrics=metrics)
    return sequences


def register_generation_strategy() -> None:
    """Wraps `GenerationMixin.generate` so it accepts `speculator=` (idempotent)."""
    current = GenerationMixin.generate
    if getattr(current, "_hf_specdec", False):
        return
    wrapped = functools.wraps(current)(_speculative_generate)
    wrapped._hf_specdec = True
    _speculative_generate.original = current
    GenerationMixin.generate = wrapped
