"""The OpenAI request bodies this server takes: which fields, at which values, checked into what
`ServingEngine.submit` needs (`parse_request`); a bad field raises `RequestError` naming it."""

from __future__ import annotations

from ..decode.requests import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, SamplingParams
from ..structured.grammar import Grammar
from .admission import MAX_LOGPROBS
from .engine import ServingEngine
from .prompts import chat_prompt, completion_prompts
from .stream import RequestError

# Fields of OpenAI's API this server takes; anything else with a non-default value is refused (400), never ignored.
_IGNORED = {"model", "user", "stream_options", "metadata", "store", "service_tier", "parallel_tool_calls",
            "prompt_cache_key", "safety_identifier"}
# vLLM's structured-output fields: the older top-level ones (what each asks for), and `structured_outputs`' keys.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object")
_COMMON = {"max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "top_k", "response_format",
           # vLLM's extra fields
           "repetition_penalty", "min_tokens", "ignore_eos", "structured_outputs", *_GUIDED,
           # vLLM's, taken at their neutral values (what this server does anyway)
           "min_p", "skip_special_tokens", "include_stop_str_in_output", "use_beam_search"}
_COMPLETIONS = _COMMON | {"prompt", "echo", "logprobs", "best_of", "presence_penalty", "frequency_penalty",
                          "suffix", "logit_bias"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "presence_penalty",
                   "frequency_penalty", "tools", "tool_choice", "logit_bias",
                   # taken at their neutral values: a text answer, no functions (the older name of tools)
                   "modalities", "audio", "functions", "function_call", "verbosity",
                   # the chat template's own switches, as vLLM's server takes them
                   "add_generation_prompt", "continue_final_message", "chat_template_kwargs"}
# Accepted only at their neutral values (compared by type too: `0 == False` in Python). Empty `logit_bias` and
# `tools` are what some SDKs send by default.
_NEUTRAL = {"best_of": (1, None), "suffix": (None, ""), "tools": (None, []),
            "tool_choice": (None, "none"), "modalities": (None, ["text"]), "audio": (None,),
            "functions": (None, []), "function_call": (None, "none"), "verbosity": (None,),
            "min_p": (None, 0, 0.0), "skip_special_tokens": (None, True), "include_stop_str_in_output": (None, False),
            "use_beam_search": (None, False)}
# Stop strings a request may give: OpenAI's API takes 4, vLLM's any number (lm-eval's code tasks send 6 or more).
MAX_STOP_STRINGS = 32


def _is_neutral(value, neutral: tuple) -> bool:
    return any(value == n and type(value) is type(n) for n in neutral)


def parse_request(body: dict, chat: bool, engine: ServingEngine) -> dict:
    """Validates an OpenAI request body; raises `RequestError` naming the first bad field."""
    known = (_CHAT if chat else _COMPLETIONS) | _IGNORED
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unsupported field {unknown[0]!r}; supported: {sorted(known)}", unknown[0])
    for name, neutral in _NEUTRAL.items():
        if name in body and not _is_neutral(body[name], neutral):
            raise RequestError(f"{name}={body[name]!r} is not supported by this server; drop it", name)
    tokenizer = engine.tokenizer
    if chat:
        prompts = [chat_prompt(body.get("messages"), tokenizer, **_template_options(body))]
    else:
        prompts = completion_prompts(body.get("prompt"), tokenizer)
    echo = False if chat else body.get("echo", False)
    if echo is not None and not isinstance(echo, bool):
        raise RequestError(f"echo must be true or false, got {echo!r}", "echo")
    # An explicit null is no value (the openai client sends `max_completion_tokens: null` beside `max_tokens`)
    param = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(param) if chat else body.get("max_tokens", 16)
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                   or max_tokens < (0 if echo else 1)):
        raise RequestError(f"{param} must be a positive integer (0 only with echo: the prompt alone), got "
                           f"{max_tokens!r}", param)
    for prompt in prompts:
        room = engine.max_model_len - len(prompt)
        if room < (0 if max_tokens == 0 else 1):  # the prompt alone fills the context
            field = "messages" if chat else "prompt"
            raise RequestError(f"this model's context is {engine.max_model_len} tokens and the prompt has "
                               f"{len(prompt)}, which leaves no room for an answer; shorten the prompt", field)
        if (1 if max_tokens is None else max_tokens) > room:
            raise RequestError(
                f"this model's context is {engine.max_model_len} tokens, but the prompt has {len(prompt)} and "
                f"{param} asks for {max_tokens} more; shorten the prompt or lower {param}", param)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise RequestError("top_p must be in (0, 1]", "top_p")
    top_k = body.get("top_k", 0)
    if top_k is None or (type(top_k) is int and top_k == -1):  # vLLM's "off", as 0 (its clients' older default)
        top_k = 0
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise RequestError(f"top_k must be a non-negative integer, or -1 (0 and -1: off), got {top_k!r}", "top_k")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RequestError(f"seed must be an integer, got {seed!r}", "seed")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
        raise RequestError(f"n must be an integer from 1 to 16, got {n!r}", "n")
    capacity = engine.max_queue + engine.max_batch_size  # an idle server's free slots and its queue
    if len(prompts) * n > capacity:  # more than the server can ever take at once: no retry would help
        field = "n" if n > 1 else "prompt"
        raise RequestError(f"{len(prompts)} prompt(s) x n={n} make {len(prompts) * n} sequences, more than this "
                           f"server takes at once ({capacity}: --max-batch-size plus --max-queue); send fewer per "
                           "request", field)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or
                             not all(isinstance(s, str) and s for s in stop)):
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
                options.get("include_usage", False), bool):
            raise RequestError(f"stream_options must be an object with at most include_usage (true or false), got "
                               f"{options!r}", "stream_options")
    logprobs = _logprobs(body, chat)
    texts = None
    if echo:  # the text each choice starts with: the prompt as sent, or its tokens' text
        raw = body.get("prompt")
        texts = [raw] if isinstance(raw, str) else list(raw) if all(isinstance(p, str) for p in raw) else [
            tokenizer.decode(p, skip_special_tokens=True) if tokenizer is not None else "" for p in prompts]
    grammar, grammar_field = _grammar(body)
    return {"prompts": prompts, "max_tokens": max_tokens, "n": n, "stop": stop, "stream": bool(stream),
            "include_usage": bool(options and options.get("include_usage")), "logprobs": logprobs,
            "echo": texts, "prompt_logprobs": logprobs if echo else None, "grammar_field": grammar_field,
            "grammar": grammar, "sampling": SamplingParams(
                temperature, top_p, top_k, seed, _number(body, "presence_penalty", 0.0, -2.0, 2.0),
                _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                _number(body, "repetition_penalty", 1.0, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
                _logit_bias(body, engine.vocab_size), _min_tokens(body, max_tokens), _flag(body, "ignore_eos"))}


def _grammar(body: dict):
    """`(grammar, the field that asked for it)` from OpenAI's `response_format` or vLLM's structured-output fields
    (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, or `structured_outputs` with one of `json`,
    `regex`, `choice`, `grammar`, `json_object`); `(None, None)` for free text. At most one may be given."""

    asked = []
    for name in ("response_format", *_GUIDED):
        if body.get(name) is None:
            continue
        try:
            grammar = (Grammar.from_response_format(body[name]) if name == "response_format"
                       else _vllm_grammar(_GUIDED[name], body[name]))
        except (ValueError, TypeError) as bad:
            raise RequestError(f"{name}: {bad}", name) from None
        if grammar is not None:
            asked.append((name, grammar))
    options = body.get("structured_outputs")
    if options is not None:
        if not isinstance(options, dict):
            raise RequestError(f"structured_outputs must be an object, got {options!r}", "structured_outputs")
        unknown = sorted(k for k, v in options.items() if k not in _STRUCTURED_OUTPUTS and not _absent(v))
        if unknown:
            raise RequestError(f"structured_outputs.{unknown[0]} is not supported; give one of "
                               f"{list(_STRUCTURED_OUTPUTS)}", "structured_outputs")
        given = [k for k in _STRUCTURED_OUTPUTS if not _absent(options.get(k))]
        if len(given) != 1:
            raise RequestError(f"structured_outputs takes exactly one of {list(_STRUCTURED_OUTPUTS)}, got "
                               f"{given or 'none'}", "structured_outputs")
        try:
            asked.append(("structured_outputs", _vllm_grammar(given[0], options[given[0]])))
        except (ValueError, TypeError) as bad:
            raise RequestError(f"structured_outputs.{given[0]}: {bad}", "structured_outputs") from None
    if len(asked) > 1:
        raise RequestError(f"give one way to constrain the output, not {[name for name, _ in asked]}", asked[1][0])
    return asked[0][::-1] if asked else (None, None)


def _absent(value) -> bool:
    return value is None or value is False  # (not `0`, which `in (None, False)` would take for False)


def _vllm_grammar(kind: str, value):
    if kind == "json":
        return Grammar.json_schema(value)
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"json_object must be true, got {value!r}")
        return Grammar.json_schema({"type": "object"})
    if kind == "choice":
        return Grammar.choice(value)
    return Grammar.regex(value) if kind == "regex" else Grammar.ebnf(value)


def _logprobs(body: dict, chat: bool) -> int | None:
    """The alternatives to list with each token's log probability, or `None` for no log probabilities: the
    completions API's `logprobs` (an integer), the chat API's `logprobs` (true or false) with `top_logprobs`."""
    def count(name: str) -> int:
        value = body[name]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
            raise RequestError(f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {value!r}", name)
        return value

    if not chat:  # `false` is what some clients send for none
        return None if body.get("logprobs") is None or body.get("logprobs") is False else count("logprobs")
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise RequestError(f"logprobs must be true or false, got {wanted!r}", "logprobs")
    if body.get("top_logprobs") is not None:
        top = count("top_logprobs")
        if top and not wanted:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return top if wanted else None
    return 0 if wanted else None


def _min_tokens(body: dict, max_tokens: int | None) -> int:
    value = body.get("min_tokens")
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError(f"min_tokens must be a non-negative integer, got {value!r}", "min_tokens")
    if max_tokens is not None and value > max_tokens:
        raise RequestError(f"min_tokens ({value}) is more than the most tokens asked for ({max_tokens})", "min_tokens")
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", name)
    return bool(value)


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: token ids (as strings, JSON keys) -> biases from -100 to 100."""
    bias = body.get("logit_bias")
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise RequestError("logit_bias must be an object mapping token ids to biases from -100 to 100", "logit_bias")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias: {key!r} is not a token id of this model (0 to {vocab_size - 1})",
                               "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise RequestError(f"logit_bias: the bias of token {key} must be a number from -100 to 100, got "
                               f"{value!r}", "logit_bias")
        out[token] = float(value)
    return out


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"{name} must be a number from {low} to {high}, got {value!r}", name)
    return float(value)


def _template_options(body: dict) -> dict:
    """`add_generation_prompt` (default true), `continue_final_message` (default false: the answer continues the
    last message, an assistant's, instead of starting a new turn) and `chat_template_kwargs` (the template's own
    variables), checked."""
    add = body.get("add_generation_prompt", True)
    cont = body.get("continue_final_message", False)
    extra = body.get("chat_template_kwargs")
    for name, value in (("add_generation_prompt", add), ("continue_final_message", cont)):
        if not isinstance(value, bool):
            raise RequestError(f"{name} must be true or false, got {value!r}", name)
    if cont and add and "add_generation_prompt" in body:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true",
                           "continue_final_message")
    if extra is not None and (not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra)):
        raise RequestError("chat_template_kwargs must be an object of the template's variables",
                           "chat_template_kwargs")
    return {"add_generation_prompt": add and not cont, "continue_final_message": cont, "template_kwargs": extra}
