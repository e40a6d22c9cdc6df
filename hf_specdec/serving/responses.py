"""OpenAI's response bodies: a whole answer's choices and usage, and a streamed answer's server-sent events."""

from __future__ import annotations

import asyncio
import json
import time

from .logprobs import TokenLogprobs, echo_gap, join_logprobs


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
