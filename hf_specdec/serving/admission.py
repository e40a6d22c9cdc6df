"""What a request must be to join a `ServingEngine`'s queue: `submit`'s arguments checked against the engine (its
context, vocabulary, end-of-sequence tokens, tokenizer), and grammars compiled and checked (`CheckedGrammar`). Each
refusal is a `RequestError` naming the field and the fix."""

from __future__ import annotations

from dataclasses import dataclass

from ..decode.requests import SamplingParams
from ..structured.constraints import first_position_spellable
from .stream import RequestError

# The most alternatives a request may ask for with each token's log probability (vLLM's default limit).
MAX_LOGPROBS = 20


@dataclass(frozen=True, eq=False)
class CheckedGrammar:
    """A grammar `ServingEngine.compile_grammar` compiled and checked for `engine`; its `submit` takes it as it is."""

    compiled: object
    engine: object  # the `ServingEngine` it was checked for


def check_request(engine, prompt_ids: list[int], max_tokens: int | None, sampling: SamplingParams | None,
                  stop: list[str] | None, grammar, logprobs: int | None,
                  prompt_logprobs: int | None) -> tuple[int, SamplingParams]:
    """Refuses a request `engine` (a `ServingEngine`) cannot serve as given (`ServingEngine.submit`'s arguments);
    returns its `max_tokens` and `sampling` with their defaults filled in."""
    if not prompt_ids:
        raise RequestError("the prompt is empty; give at least one token", "prompt")
    if max(prompt_ids) >= engine.vocab_size or min(prompt_ids) < 0:
        raise RequestError(f"the prompt holds token ids outside the model's vocabulary of {engine.vocab_size}",
                           "prompt")
    room = engine.max_model_len - len(prompt_ids)
    if max_tokens is None:
        max_tokens = room
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
        raise RequestError(f"max_tokens must be a non-negative integer (0: nothing generated, the prompt scored "
                           f"with prompt_logprobs), got {max_tokens!r}", "max_tokens")
    if max_tokens > room:
        raise RequestError(
            f"this model's context is {engine.max_model_len} tokens, but the prompt has {len(prompt_ids)} and "
            f"max_tokens asks for {max_tokens} more; shorten the prompt or lower max_tokens to at most "
            f"{max(room, 0)}", "max_tokens")
    sampling = sampling or SamplingParams()
    if sampling.ignore_eos and grammar is not None:  # a finished grammar allows only EOS: EOS to max_tokens
        raise RequestError("ignore_eos cannot be combined with response_format (once the grammar is complete, "
                           "only the end of the answer is allowed); drop one", "ignore_eos")
    if sampling.min_tokens and grammar is not None:  # where the grammar allows only EOS, nothing would be left
        raise RequestError("min_tokens cannot be combined with response_format (a grammar may allow nothing but "
                           "the end of the answer); drop one", "min_tokens")
    if sampling.min_tokens > max_tokens:
        raise RequestError(f"min_tokens ({sampling.min_tokens}) is more than max_tokens ({max_tokens})",
                           "min_tokens")
    if sampling.ignore_eos and not engine.eos_token_ids:
        raise RequestError("this model has no end-of-sequence token, so ignore_eos has nothing to act on; drop it",
                           "ignore_eos")
    if sampling.min_tokens and not engine.eos_token_ids and not stop:
        raise RequestError("this model has no end-of-sequence token and the request no stop strings, so "
                           "min_tokens has nothing to hold back; drop it", "min_tokens")
    if sampling.logit_bias and max(sampling.logit_bias) >= engine.vocab_size:
        raise RequestError(f"logit_bias names token {max(sampling.logit_bias)}, outside the model's vocabulary "
                           f"of {engine.vocab_size}", "logit_bias")
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not 0 <= value <= MAX_LOGPROBS):
            raise RequestError(f"{name} must be an integer from 0 to {MAX_LOGPROBS} (the alternatives to list "
                               f"with each token), got {value!r}", name)
    if logprobs is not None and engine.step.tree_nodes is not None:
        raise RequestError("log probabilities are not reported with draft trees; drop logprobs", "logprobs")
    if (stop or grammar is not None) and engine.tokenizer is None:
        raise RequestError("stop strings and grammars need the engine's tokenizer; pass tokenizer= to "
                           "ServingEngine", "stop" if stop else "response_format")
    return max_tokens, sampling


def checked_grammar(engine, grammar) -> CheckedGrammar:
    """`grammar` compiled for `engine` and checked (`ServingEngine.compile_grammar`)."""
    if engine.tokenizer is None:
        raise RequestError("stop strings and grammars need the engine's tokenizer; pass tokenizer= to "
                           "ServingEngine", "response_format")
    if engine.step.constraints is None:
        raise RequestError("structured output needs xgrammar: pip install 'hf_specdec[structured]'",
                           "response_format")
    if not engine.eos_token_ids:  # as generate(grammar=, speculator=) refuses it
        raise RequestError("this model has no end-of-sequence token (its generation_config.eos_token_id is "
                           "unset), so a grammar's answer could not end: it would run on to max_tokens; "
                           "the server's operator should set model.generation_config.eos_token_id",
                           "response_format")
    try:
        compiled = grammar.compile(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    except ValueError as error:  # GrammarError: the library's own message
        raise RequestError(str(error), "response_format") from None
    if not first_position_spellable(compiled):
        raise RequestError("the model's tokenizer cannot spell the start of this grammar (it allows no token "
                           "of the vocabulary)", "response_format")
    return CheckedGrammar(compiled, engine)
