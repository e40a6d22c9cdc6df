"""`hf-specdec serve`: an OpenAI-compatible HTTP server over `ServingEngine` (FastAPI on uvicorn).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as server-sent events),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). Errors are OpenAI's JSON error objects: 400 naming
the field, 401 for a missing or wrong API key, 404 for an unknown model, 503 when the queue is full.

This module owns the app, its routes and the server's run; a body's fields are checked in `protocol.py`, answers are
shaped in `responses.py` (log probabilities in `logprobs.py`) and `/metrics` is written in `prometheus.py`.
"""

import asyncio
import dataclasses
import json
import logging
import os
import secrets
import time
import uuid
from contextlib import asynccontextmanager

from ..tokenizers import token_bytes
from .engine import ServingEngine
from .prometheus import prometheus_text
from .protocol import parse_request
from .responses import choice, stream_events, usage_of
from .stream import QueueFullError, RequestError

logger = logging.getLogger(__name__)

# Routes answered without the API key (a load balancer's probe, a metrics scraper); everything else needs it.
_OPEN_PATHS = ("/health", "/metrics")


def create_app(engine: ServingEngine, model_name: str, api_key: str | None = None, shutdown_grace_s: float = 10.0):
    """The FastAPI app serving `engine` as `model_name`. `api_key`: required as `Authorization: Bearer KEY` on
    every route but `/health` and `/metrics` when set."""
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
