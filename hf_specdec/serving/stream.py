"""What a client holds of a submitted request: the `RequestStream` it reads `Delta`s from, and the errors
`ServingEngine.submit` raises."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..decode.requests import Request
from .detokenize import AnswerText


class QueueFullError(RuntimeError):
    """The server's queue is full; the client should retry later (HTTP 503)."""


class RequestError(ValueError):
    """A request that cannot be served as given (HTTP 400); the message names the field and the fix."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class Delta:
    """What one step added to a request: token ids, the text they complete, and whether the request ended. With
    `logprobs` asked for, `logprobs` holds one `(log probability, [(token id, log probability), ...])` per token of
    `token_ids` (`Request.output_logprobs`)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list | None = None


@dataclass(eq=False)
class RequestStream:
    """A submitted request's output, as it arrives. Iterate it (`for delta in stream`), or in async code
    `async for delta in stream` when it was submitted with a running event loop."""

    request: Request
    stop: tuple[str, ...] = ()
    _engine: object = None  # the `ServingEngine` serving it (`cancel`)
    _loop: asyncio.AbstractEventLoop | None = None
    _queue: object = None
    _decoded: str = ""
    _sent: int = 0  # characters of `_decoded` already delivered
    prompt_tokens: int = 0
    _ended: bool = False
    first_token_time: float | None = None
    _stop_floor: int | None = None  # characters of the first min_tokens tokens (stop strings count past them)
    _answer: AnswerText | None = None  # the answer's text, decoded a few tokens at a time
    arrival_time: float = field(default_factory=time.perf_counter)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def text(self) -> str:
        return self._decoded[: self._sent]

    def cancel(self) -> None:
        if self._engine is not None:
            self._engine.cancel(self)

    def __iter__(self):
        while not self._ended:
            yield self._received(self._queue.get())

    def __aiter__(self):
        return self._aiter()

    async def _aiter(self):
        while not self._ended:
            yield self._received(await self._queue.get())

    def _received(self, delta):
        # Once the last delta (or an error) has been read, iterating again ends at once.
        if isinstance(delta, BaseException):
            self._ended = True
            raise delta
        self._ended = delta.finish_reason is not None
        return delta

    def _put(self, item) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
            except RuntimeError:  # the client's event loop has closed: nobody is listening any more
                pass
        else:
            self._queue.put(item)
