"""`hf-specdec serve`: an OpenAI-compatible HTTP server over `ServingEngine` (FastAPI on uvicorn).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as server-sent events),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). Errors are OpenAI's JSON error objects: 400 naming
the field, 401 for a missing or wrong API key, 404 for an unknown model, 503 when the queue is full.
"""


import asyncio
import dataclasses
import inspect
import json
import logging
import os
import secrets
import time
import uuid

from ..decode.scheduler import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, SamplingParams
from .engine import MAX_LOGPROBS, QueueFullError, RequestError, ServingEngine
from ..tokenizers import token_bytes
from ..structured.grammar import Grammar

logger = logging.getLogger(__name__)

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
# Chat roles a template understands; `developer` (OpenAI's newer name for system instructions) is sent as `system`.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Routes answered without the API key (a load balancer's probe, a metrics scraper); everything else needs it.
_OPEN_PATHS = ("/health", "/metrics")


def _is_neutral(value, neutral: tuple) -> bool:
    return any(value == n and type(value) is type(n) for n in neutral)


def create_app(engine: ServingEngine, model_name: str, api_key: str | None = None, shutdown_grace_s: float = 10.0):
    """The FastAPI app serving `engine` as `model_name`. `api_key`: required as `Authorization: Bearer KEY` on
    every route but `/health` and `/metrics` when set."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse


    if engine.tokenizer is not None:  # read the tokenizer's byte spelling now, not on the first logprobs request
        token_bytes(engine.tokenizer)

    @asynccontextmanager
    async def lifespan(app):
        await asyncio.to_thread(engine.start)  # returns after the warm-up, if any; /health answers from then on
        yield
        await asyncio.to_thread(engine.shutdown, shutdown_grace_s)

    from starlette.exceptions import HTTPException

    app = FastAPI(title="hf_specdec", lifespan=lifespan)
    created = int(time.time())

    def error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                            status_code=status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, problem: HTTPException):  # unknown route, wrong method: OpenAI's shape
        kind = "invalid_request_error" if problem.status_code < 500 else "server_error"
        return error(problem.status_code, f"{request.method} {request.url.path}: {problem.detail}", kind)

    @app.exception_handler(Exception)
    async def server_error(request: Request, problem: Exception):  # the details go to the log, not the client
        logger.error(f"{request.method} {request.url.path} failed", exc_info=problem)
        return error(500, f"internal server error ({type(problem).__name__}); the server's log has the details",
                     "server_error")

    class Authenticate:
        """The API key check on every route but `/health` and `/metrics`, as plain ASGI middleware: Starlette's
        `BaseHTTPMiddleware` would wrap the requests' `receive`, and a handler could then no longer see its client
        disconnect."""

        def __init__(self, app):  # older Starlette builds middleware as cls(app=...)
            self.inner = app

        async def __call__(self, scope, receive, send):
            path, root = scope.get("path", ""), scope.get("root_path", "")
            if root and path.startswith(root):  # mounted under a prefix: the routes are what follows it
                path = path[len(root):]
            if api_key and scope["type"] == "http" and path not in _OPEN_PATHS:
                given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                token = given[7:] if given.lower().startswith("bearer ") else ""
                if not secrets.compare_digest(token.encode(), api_key.encode()):
                    refusal = error(401, "missing or wrong API key: send 'Authorization: Bearer KEY' with the "
                                    "server's --api-key", "authentication_error", code="invalid_api_key")
                    await refusal(scope, receive, send)
                    return
            await self.inner(scope, receive, send)

    app.add_middleware(Authenticate)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return error(503, "the engine is not running", "server_error")
        return {"status": "ok"}

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "hf_specdec"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return error(404, f"the model {model_id!r} does not exist; this server serves {model_name!r}",
                         "invalid_request_error", "model", "model_not_found")
        return model_card()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine), media_type="text/plain; version=0.0.4")

    async def handle(request: Request, chat: bool):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "the request body is not valid JSON", "invalid_request_error")
        try:
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            if body.get("model") not in (None, model_name):
                return error(404, f"the model {body.get('model')!r} does not exist; this server serves "
                             f"{model_name!r} (GET /v1/models)", "invalid_request_error", "model", "model_not_found")
            parsed = parse_request(body, chat, engine)
        except RequestError as bad:
            return error(400, str(bad), "invalid_request_error", bad.param)
        loop = asyncio.get_running_loop()
        streams = []
        try:
            if parsed["grammar"] is not None:  # compiled off the event loop (up to a second): the others stream on
                parsed["grammar"] = await asyncio.to_thread(engine.compile_grammar, parsed["grammar"])
            for i, prompt in enumerate(parsed["prompts"]):
                for j in range(parsed["n"]):
                    sampling = parsed["sampling"]
                    if sampling.seed is not None and parsed["n"] > 1:  # n different samples, each reproducible
                        sampling = dataclasses.replace(sampling, seed=sampling.seed + j)
                    streams.append(engine.submit(prompt, parsed["max_tokens"], sampling, parsed["stop"],
                                                 parsed["grammar"], loop=loop, logprobs=parsed["logprobs"],
                                                 prompt_logprobs=parsed["prompt_logprobs"]))
        except RequestError as bad:
            cancel_unfinished(streams)
            field = parsed["grammar_field"]
            if bad.param == "response_format" and field not in (None, "response_format"):  # vLLM's field asked
                return error(400, str(bad).replace("response_format", field), "invalid_request_error", field)
            return error(400, str(bad), "invalid_request_error", bad.param)
        except QueueFullError as full:
            cancel_unfinished(streams)
            return error(503, str(full), "server_error", code="queue_full")
        except RuntimeError as down:
            cancel_unfinished(streams)
            return error(503, str(down), "server_error")
        except BaseException:
            cancel_unfinished(streams)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        prompt_tokens = sum(len(p) for p in parsed["prompts"])
        # With `echo`, each choice's text starts with its prompt's (streams are prompt by prompt, n of each).
        echoes = [text for text in parsed["echo"] for _ in range(parsed["n"])] if parsed["echo"] else None
        if parsed["stream"]:  # the generator cancels what is unfinished when it ends or the client goes
            return StreamingResponse(stream_events(streams, rid, chat, model_name, parsed["include_usage"],
                                                   prompt_tokens, engine.tokenizer, echoes),
                                     media_type="text/event-stream")
        try:
            results = await asyncio.gather(*(collect(s, request) for s in streams))
        except RequestError as bad:
            return error(400, str(bad), "invalid_request_error", bad.param)
        except RuntimeError as failed:
            return error(500, str(failed), "server_error")
        finally:
            cancel_unfinished(streams)
        if any(reason is None for _, reason in results):  # the client went away
            return error(499, "client disconnected", "invalid_request_error")
        choices = [choice(i, text, reason, chat, stream.request, engine.tokenizer, echoes and echoes[i])
                   for i, ((text, reason), stream) in enumerate(zip(results, streams))]
        usage = usage_of(streams, prompt_tokens)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": model_name, "choices": choices, "usage": usage}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def cancel_unfinished(streams) -> None:
    for stream in streams:
        if stream.request.finish_reason is None:
            stream.cancel()


async def collect(stream, request) -> tuple[str, str | None]:
    """Waits for a stream's end; `(text, finish_reason)`, the reason `None` if the client disconnected first."""
    async for delta in _watch(stream, request):
        if delta.finish_reason is not None:
            return stream.text, delta.finish_reason
    return stream.text, None


async def _watch(stream, request, every_s: float = 0.5):
    """The stream's deltas; ends early (cancelling the request) when the HTTP client disconnects, which is checked
    at least every `every_s` seconds: while waiting for a delta, and between deltas (a request generating gives one
    every step, so a check only after a quiet spell would never come)."""
    iterator = stream.__aiter__()
    checked = time.monotonic()

    async def gone() -> bool:
        nonlocal checked
        checked = time.monotonic()
        if await request.is_disconnected():
            stream.cancel()
            return True
        return False

    while True:
        step = asyncio.ensure_future(iterator.__anext__())
        while not step.done():
            done, _ = await asyncio.wait({step}, timeout=every_s)
            if not done and await gone():
                step.cancel()
                return
        try:
            delta = step.result()
        except StopAsyncIteration:
            return
        yield delta
        if delta.finish_reason is None and time.monotonic() - checked >= every_s and await gone():
            return


def choice(index: int, text: str, reason: str, chat: bool, request=None, tokenizer=None,
           echo: str | None = None) -> dict:
    """One choice of a whole (not streamed) answer; `echo`: the prompt's text, which the completion's follows."""
    reason = "stop" if reason == "cancelled" else reason
    logprobs = None
    if request is not None and request.logprobs is not None:
        # An echoed prompt's tokens join into its text, and the answer's after it into the rest.
        if echo is not None:
            answer = TokenLogprobs(tokenizer, chat, len(echo), request.prompt_ids)
            logprobs = join_logprobs(TokenLogprobs(tokenizer, chat).prompt(request),
                                     answer.format(request.output_ids, request.output_logprobs))
        else:
            logprobs = TokenLogprobs(tokenizer, chat).format(request.output_ids, request.output_logprobs)
    if echo is not None:
        text = echo + echo_gap(tokenizer, request, text) + text
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


class TokenLogprobs:
    """OpenAI's `logprobs` object for a choice's tokens, built as they arrive (`format` for each delta in turn).

    A token's text is what it adds to the answer's text, so the tokens' texts join into it (streamed or not): special
    tokens add nothing, and a character whose bytes span several tokens shows in the token that completes it. For
    tokenizers whose tokens are bytes (`tokenizers.token_bytes`) the texts come from the tokens' bytes through one
    incremental UTF-8 decoder, and chat's `bytes` are each token's own, joining into the answer's UTF-8; for others,
    each token is decoded with the few before it (a tokenizer that drops a word's leading space when a token is
    decoded alone still shows it). An alternative's text is what it would have added in the token's place. The
    completions API's form lists `tokens`, `token_logprobs`, `top_logprobs` (per token, the alternatives and the token
    itself, text -> log probability) and `text_offset` (characters from the start of the choice's text); the chat
    API's lists `content`, one object per token with its `token`, `logprob`, `bytes` and `top_logprobs`."""

    CONTEXT = 4  # tokens decoded before each one, without a byte spelling

    def __init__(self, tokenizer, chat: bool, offset: int = 0, after: list[int] | None = None):
        """`offset`: characters of the choice's text before the first token's; `after`: the token ids of an echoed
        prompt the tokens follow, whose text theirs continues (a leading space is theirs, not dropped)."""
        import codecs


        self.tokenizer, self.chat = tokenizer, chat
        self.spelling = token_bytes(tokenizer) if tokenizer is not None else None
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        # Leading spaces still to drop (as the decoder drops them at the start of a text).
        self.strip = self.spelling.strip_start if self.spelling is not None and after is None else 0
        self.history: list[int] = list(after[len(after) - self.CONTEXT:]) if after else []
        self.offset = offset

    def _decoded(self, ids: list[int]) -> str:
        # Without the replacement marks of a character not complete yet: its token adds nothing until it is.
        return self.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd") if ids else ""

    def _spelled(self, token: int, commit: bool) -> tuple[str, bytes]:
        """The text and bytes `token` adds after the tokens so far (`commit`: it is the next token; else an
        alternative, and the decoder is left as it was)."""
        data = self.spelling.spell(token)
        state = self.utf8.getstate()
        text = self.utf8.decode(data)
        strip = self.strip
        if text and strip:  # the decoder drops leading spaces at the start of a text: so does the answer
            kept = text.lstrip(" ")
            dropped = min(strip, len(text) - len(kept))
            text, data = text[dropped:], data[dropped:] if data[:dropped] == b" " * dropped else data
            strip = 0
        if commit:
            self.strip = strip
        else:
            self.utf8.setstate(state)
        return text, data

    def _entry(self, context: list[int], before: str, token: int, commit: bool) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            return f"token_id:{token}", []
        if self.spelling is not None:
            text, data = self._spelled(token, commit)
            return text, list(data)
        text = self._decoded(context + [token])[len(before):]
        return text, list(text.encode("utf-8"))

    def prompt(self, request) -> dict:
        """The completions API's form for a request's prompt tokens (`echo`), to come before its answer's: the
        first token has no log probability (nothing comes before it), the others theirs given the tokens before
        them (`Request.prompt_token_logprobs`) when they were asked for, else none either."""
        entries = [None] + list(request.prompt_token_logprobs)
        return self.format(request.prompt_ids, entries + [None] * (len(request.prompt_ids) - len(entries)))

    def format(self, token_ids: list[int], entries: list) -> dict:
        """`entries`: one `(log probability, alternatives)` per token, or `None` for a token without (the first of
        an echoed prompt), whose log probability and alternatives are then `null`."""
        chosen, tops = [], []
        for token, entry in zip(token_ids, entries):
            alternatives = entry[1] if entry is not None else []
            context, before = [], ""
            if self.spelling is None and self.tokenizer is not None and self.history:
                context = self.history[len(self.history) - self.CONTEXT:]
                before = self._decoded(context)
            tops.append([(*self._entry(context, before, t, False), value) for t, value in alternatives])
            chosen.append(self._entry(context, before, token, True))
            self.history.append(token)
        if self.chat:
            return {"refusal": None, "content": [
                {"token": text, "logprob": value, "bytes": data,
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": b} for t, b, v in top]}
                for (text, data), (value, _), top in zip(chosen, entries, tops)]}
        offsets = []
        for text, _ in chosen:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": [text for text, _ in chosen],
                "token_logprobs": [entry[0] if entry is not None else None for entry in entries[:len(chosen)]],
                "top_logprobs": [{_key(t, b): v for t, b, v in top} | {text: entry[0]} if entry is not None else None
                                 for (text, _), entry, top in zip(chosen, entries, tops)],
                "text_offset": offsets}


def echo_gap(tokenizer, request, text: str) -> str:
    """The whitespace between an echoed prompt and its answer: what the answer's first tokens add after the prompt's
    last, that they do not show alone (a SentencePiece tokenizer drops a text's leading space: "... is" + "Paris"
    where the model wrote "... is Paris"); empty for byte-level tokenizers, which drop nothing."""
    if tokenizer is None or not text or not request.output_ids or not request.prompt_ids:
        return ""
    head, first = request.prompt_ids[-TokenLogprobs.CONTEXT:], request.output_ids[:TokenLogprobs.CONTEXT]
    before = tokenizer.decode(head, skip_special_tokens=True)
    joined = tokenizer.decode(head + first, skip_special_tokens=True)
    alone = tokenizer.decode(first, skip_special_tokens=True)
    if not joined.startswith(before) or not joined.endswith(alone):
        return ""
    gap = joined[len(before):len(joined) - len(alone)]
    return gap if gap.isspace() else ""


def join_logprobs(first: dict, then: dict) -> dict:
    """Two pieces of the completions API's `logprobs` one after the other (an echoed prompt's, then the answer's)."""
    return {key: first[key] + then[key] for key in first}


def _key(text: str, data: list[int]) -> str:
    """An alternative's name in the completions API's `top_logprobs`: its text, or, for one that adds no text yet
    (part of a character), its bytes as OpenAI writes them (`bytes:\\xe2\\x80`), so such alternatives stay apart."""
    return text if text or not data else "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def usage_of(streams, prompt_tokens: int) -> dict:
    completion = sum(s.request.num_generated for s in streams)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


async def stream_events(streams, rid: str, chat: bool, model_name: str, include_usage: bool, prompt_tokens: int,
                        tokenizer=None, echoes: list[str] | None = None):
    """Server-sent events: one chunk per delta of every choice, then `data: [DONE]`. A client that disconnects
    cancels every choice (their KV blocks are freed at the next step). With log probabilities, a chunk carries
    those of the tokens since the last chunk (a delta whose text is held back, say the start of a stop string,
    sends no chunk: its tokens' go with the next). With `echoes` (completions' `echo`), a choice's first chunk is
    its prompt's text (and its prompt tokens' log probabilities), sent with its first delta, when they are known."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    formatters = [TokenLogprobs(tokenizer, chat, *((len(echoes[i]), s.request.prompt_ids) if echoes else ()))
                  if s.request.logprobs is not None else None for i, s in enumerate(streams)]
    unsent = list(echoes) if echoes else [None] * len(streams)  # echoed prompts not sent yet
    gaps = [echoes is not None] * len(streams)  # choices whose text after the echo has not started yet
    held: list[tuple[list, list]] = [([], []) for _ in streams]  # per choice: tokens and entries not yet sent

    def chunk(index: int, text: str | None, reason: str | None, first: bool = False, logprobs=None) -> str:
        if formatters[index] is not None and not first and logprobs is None:
            logprobs = formatters[index].format(*held[index])
            held[index] = ([], [])
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            body = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            body = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        payload = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [body]}
        if include_usage:
            payload["usage"] = None
        return f"data: {json.dumps(payload)}\n\n"

    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index, stream):
        try:
            async for delta in stream:
                await merged.put((index, delta))
        except Exception as failure:  # noqa: BLE001 - reported to the client as an error event
            await merged.put((index, failure))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        if chat:
            for i in range(len(streams)):
                yield chunk(i, None, None, first=True)
        open_streams = len(streams)
        while open_streams:
            index, delta = await merged.get()
            if isinstance(delta, Exception):
                message = str(delta)
                yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"
                open_streams -= 1
                continue
            reason = delta.finish_reason
            text = delta.text
            if unsent[index] is not None:
                request = streams[index].request
                logprobs = TokenLogprobs(tokenizer, chat).prompt(request) if formatters[index] is not None else None
                yield chunk(index, unsent[index], None, logprobs=logprobs)
                unsent[index] = None
            if gaps[index] and text:
                text = echo_gap(tokenizer, streams[index].request, text) + text
                gaps[index] = False
            if delta.logprobs:
                held[index][0].extend(delta.token_ids)
                held[index][1].extend(delta.logprobs)
            if text or reason is not None:
                yield chunk(index, text, None if reason is None else ("stop" if reason == "cancelled" else reason))
            if reason is not None:
                open_streams -= 1
        if include_usage:
            payload = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [],
                       "usage": usage_of(streams, prompt_tokens)}
            yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # normal end, or the client went away (the generator is closed or cancelled)
        for stream, task in zip(streams, tasks):
            task.cancel()
            if stream.request.finish_reason is None:
                stream.cancel()


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


def chat_prompt(messages, tokenizer, add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...} objects", "messages")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a 'role' string", "messages")
        if message["role"] not in _ROLES:
            raise RequestError(f"messages[{i}].role {message['role']!r} is not supported; use one of "
                               f"{sorted(_ROLES)}", "messages")
        extra = sorted(k for k, v in message.items() if k not in ("role", "content") and v not in (None, [], ""))
        if extra:  # a name, tool calls, ...: the template would drop them without a word
            raise RequestError(f"messages[{i}].{extra[0]} is not supported by this server; drop it", "messages")
        content = message.get("content")
        if content is None and message["role"] == "assistant":  # an assistant turn with nothing said (vLLM: empty)
            content = ""
        if isinstance(content, list):  # content parts: only text
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported", "messages")
            content = "\n".join(p["text"] for p in content)  # as vLLM joins them
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts", "messages")
        plain.append({"role": _ROLES[message["role"]], "content": content})
    if continue_final_message and plain[-1]["role"] != "assistant":
        raise RequestError("continue_final_message needs the last message to be the assistant's",
                           "continue_final_message")
    # Only the template's own variables: none of apply_chat_template's parameters (a template of the client's, tools
    # the server refuses, tensors back, ...)
    reserved = {name for name, parameter in inspect.signature(tokenizer.apply_chat_template).parameters.items()
                if parameter.kind is not parameter.VAR_KEYWORD} | {"messages", "conversation"}
    if template_kwargs and reserved & set(template_kwargs):
        raise RequestError(f"chat_template_kwargs cannot set {sorted(reserved & set(template_kwargs))}",
                           "chat_template_kwargs")
    try:
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, tokenize=True,
                                            **(template_kwargs or {}))
    except Exception as bad:  # noqa: BLE001 - the template's own complaint (say, roles out of order)
        raise RequestError(f"messages: the chat template refused them ({bad})", "messages") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def completion_prompts(prompt, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer(prompt)["input_ids"]]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return [tokenizer(p)["input_ids"] for p in prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise RequestError("prompt must be a non-empty string, a list of strings, a list of token ids or a list of such "
                       "lists", "prompt")


def prometheus_text(engine: ServingEngine) -> str:
    """The server's state and counters in Prometheus' text format (the speculative ones as vLLM names them)."""
    m = engine.metrics
    lines = []

    def add(name: str, kind: str, help_text: str, samples):
        lines.append(f"# HELP hf_specdec:{name} {help_text}")
        lines.append(f"# TYPE hf_specdec:{name} {kind}")
        for labels, value in samples:
            lines.append(f"hf_specdec:{name}{labels} {value}")

    add("num_requests_running", "gauge", "Requests in the running batch.", [("", engine.num_running)])
    add("num_requests_waiting", "gauge", "Requests waiting in the queue.", [("", engine.num_waiting)])
    add("kv_cache_blocks_in_use", "gauge", "KV blocks held by running requests.", [("", engine.num_blocks_in_use)])
    add("generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
        [("", round(engine.tokens_per_second(), 3))])
    counters = dict(engine.counters)
    add("request_total", "counter", "Requests accepted.", [("", counters["requests"])])
    add("request_rejected_total", "counter", "Requests refused because the queue was full.",
        [("", counters["rejected"])])
    add("request_cancelled_total", "counter", "Requests cancelled (client gone, shutdown).",
        [("", counters["cancelled"])])
    add("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", [("", counters["prompt_tokens"])])
    add("generation_tokens_total", "counter", "Tokens generated.", [("", counters["generation_tokens"])])
    add("spec_decode_num_drafts_total", "counter", "Row-steps in which the speculator proposed drafts.",
        [("", m.num_drafts)])
    add("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", [("", m.num_draft_tokens)])
    add("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", [("", m.num_accepted_tokens)])
    add("spec_decode_num_accepted_tokens_per_pos_total", "counter",
        "Drafts with at least position + 1 tokens accepted.",
        [(f'{{position="{i}"}}', n) for i, n in enumerate(list(m.accepted_per_position))])
    add("num_steps_total", "counter", "Verify steps (target forwards).", [("", m.num_steps)])
    add("prefill_chunks_total", "counter", "Pieces of long prompts fed on their own (chunked prefill).",
        [("", engine.scheduler.num_prefill_chunks)])
    cache = engine.prefix_cache
    add("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
        [("", cache.num_queried_tokens if cache is not None else 0)])
    add("prefix_cache_hits_total", "counter", "Prompt tokens found there (not fed again).",
        [("", cache.num_hit_tokens if cache is not None else 0)])
    return "\n".join(lines) + "\n"


def serve(engine: ServingEngine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, shutdown_grace_s: float = 10.0, log_level: str = "info") -> None:
    """Runs the server until SIGINT/SIGTERM; then requests in flight get `shutdown_grace_s` seconds to finish and the
    rest are cancelled."""
    import uvicorn

    api_key = api_key or os.environ.get("HF_SPECDEC_API_KEY") or None
    app = create_app(engine, model_name, api_key, shutdown_grace_s)
    # The grace starts when the signal arrives: requests still running when it ends are cancelled while their
    # connections are open, so every stream ends with its finish reason; uvicorn waits a little longer than that for
    # the connections to close before it drops them.
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.begin_shutdown(shutdown_grace_s)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_grace_s + 5.0)
    Server(config).run()
