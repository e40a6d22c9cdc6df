"""Continuous batching for a server: one thread runs the scheduler, requests come and go from any other.

`ServingEngine.submit` validates a request, queues it and returns a `RequestStream`; the engine thread admits it into
the running batch when a slot frees, and pushes `Delta`s (new token ids and text) into the stream as steps finish it.
`RequestStream.cancel()` (a client that went away) frees the request's KV blocks at the next step.

This module owns the engine's life (start, warm-up, shutdown), its queue and the thread's loop; what it is built from
is in `build.py`, the checks a request passes in `admission.py`, the warm-up's requests in `warmup.py`, and stop
strings in `stops.py`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from contextlib import ExitStack

import torch

from ..costs.calibration import ensure_profile, host_linear
from ..decode.engine import compile_steps, compiled
from ..decode.requests import Request, SamplingParams
from ..decode.scheduler import Scheduler
from ..decode.step import Step
from ..decode.stopping import StopRules
from ..generation import DEFAULT_GRAMMAR_TOKENS
from ..metrics import SpeculativeMetrics, logger
from ..runners.dense import make_runner, runner_attention
from ..runners.support import check_model_supported, exact_context
from ..speculators.grammar import GrammarSpeculator
from ..speculators.resolve import resolve_speculator
from .admission import CheckedGrammar, check_request, checked_grammar
from .build import (
    adaptive_policy,
    bound_catch_up,
    capped_model_len,
    check_options,
    make_batch,
    make_prefix_cache,
    prefill_chunk,
    row_constraints,
)
from .detokenize import AnswerText, decodes_locally
from .stops import drop_tokens_past, find_stop, safe_length, stop_floor
from .stream import Delta, QueueFullError, RequestError, RequestStream
from .warmup import warm_up


class ServingEngine:
    """Serves generation requests with speculative decoding and continuous batching.

    Args:
        model (`PreTrainedModel`): the target.
        tokenizer: the target's tokenizer (text, stop strings, grammars); `None` for token ids only.
        speculator: as `generate(speculator=...)`: `"ngram"`, `"grammar"`, a draft model or a `Speculator`.
        num_speculative_tokens (`int`): k, the most drafts per row and step.
        max_batch_size (`int`): requests running at once; the rest wait in the queue.
        max_queue (`int`): requests waiting at most; beyond that `submit` raises `QueueFullError`.
        max_model_len (`int`, *optional*): prompt + max_tokens limit (default: the model's context, or less where
            speculative decoding is exact only up to less, `support.exact_context`; at most what one request can hold
            under `max_num_blocks`).
        schedule (`str`): `"adaptive"` or `"constant"` k.
        max_num_blocks (`int`, *optional*): cap on the target's KV pool (default: enough for every running request's
            worst case); requests wait until their worst case fits.
        calibration (`bool`): use this host's cost profile, measured when the engine is built if none is cached.
        kv_region_tokens (`int`, *optional*): KV room each slot holds from the start, in one region of the pool, the
            slots' regions one after another: where attention gathers each row's context (the PyTorch path), rows
            in consecutive slots are read in place instead (requests take the lowest free slot, so at full load the
            running rows are consecutive). A request needing more takes blocks as it grows. Memory: slots x this
            many tokens' keys and values, held while the server runs. 0: none (every request takes blocks as it
            grows). Default: 1024, or none with `max_num_blocks` (the two cannot be combined).
        prefix_cache_tokens (`int`, *optional*): room for this many prompt tokens' keys and values (and the target's
            hidden states there, for a speculator that reads them) kept after their requests end, in a store of their
            own: a request whose prompt starts with a stored prefix (whole KV blocks: a shared system prompt, a
            document asked about again) copies it into its blocks and feeds only the rest
            (`prefix.PrefixCache`). The least recently used blocks go when it is full. Default: 8192 where the
            target runs on the paged cache, else none; 0: none. Refused for targets outside the paged cache (models
            with recurrent layers or outside the attention interface).
        warmup (`bool`, *optional*): before serving, run a few synthetic requests through the engine (greedy and
            sampled, every draft count up to k, together and alone), so that kernels compile and memory pools
            grow then rather than inside the first clients' requests; `start` returns once they are done. Nothing
            they do is kept: metrics, adaptive k's statistics and the prefix cache start empty. Default: on where
            the model runs on CUDA (where the Triton kernels compile a variant per query-length bucket: on an H200
            the first speculative call of a fresh process took 9 s against 0.9 s warm); elsewhere one short request
            instead (`warmup_report["kind"] == "short"`), which allocates the KV pools and pays the first forward's
            one-off costs before `start` returns (on a CPU they made a server's first request take seconds more
            than the next ones). `False`: neither.
        prefill_chunk_tokens (`int`, *optional*): a prompt longer than this is fed this many tokens a step
            (chunked prefill), each piece in a forward next to the running requests' step, so they keep streaming
            while it is read and requests arriving meanwhile start at once; the request itself waits a little
            longer for its first token. While requests run, newcomers' prompts share the same budget per step.
            Default: 256 on a CPU, 2048 elsewhere (rounded up to whole KV blocks), and off for targets outside the
            plain paged cache (recurrent layers, the masked dense cache), where pieces cost more; 0: every prompt
            whole in one step (a long one stalls every running request until it is read).
    """

    def __init__(self, model, tokenizer, speculator="ngram", num_speculative_tokens: int | None = None,
                 max_batch_size: int = 8, max_queue: int = 64, max_model_len: int | None = None,
                 schedule: str = "adaptive", block_size: int = 16, max_num_blocks: int | None = None,
                 calibration: bool = True, kv_region_tokens: int | None = None,
                 prefix_cache_tokens: int | None = None, warmup: bool | None = None,
                 prefill_chunk_tokens: int | None = None):
        if max_batch_size < 1 or max_queue < 0:
            raise ValueError(f"max_batch_size must be >= 1 and max_queue >= 0, got {max_batch_size}, {max_queue}")
        if schedule not in ("adaptive", "constant"):
            raise ValueError(f"schedule must be 'adaptive' or 'constant', got {schedule!r}")
        self.model = model
        self.tokenizer = tokenizer
        # Answers' texts decoded a few tokens a step (`detokenize.AnswerText`); off once a tokenizer proved it inexact.
        self.incremental_text = tokenizer is not None and decodes_locally(tokenizer)
        self.speculator = resolve_speculator(speculator)
        check_model_supported(model, role="target model")
        self.speculator.validate(model)
        if num_speculative_tokens is None:
            num_speculative_tokens = DEFAULT_GRAMMAR_TOKENS if isinstance(self.speculator, GrammarSpeculator) else 10
        self.k = num_speculative_tokens
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        context, why = exact_context(model)
        context = context or 2048
        if why is not None and (max_model_len is None or max_model_len > context):
            logger.warning(f"hf_specdec: serving prompt + max_tokens up to {context} tokens: {why}")
        self.max_model_len = min(max_model_len or context, context)
        eos = model.generation_config.eos_token_id
        self.eos_token_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        pad = model.generation_config.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        self.vocab_size = model.config.get_text_config().vocab_size
        self.metrics = SpeculativeMetrics()
        self.counters = {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0, "rejected": 0, "cancelled": 0}
        self._recent = deque(maxlen=256)  # (time, tokens) per step: tokens/s over the last seconds
        self._incoming: list[RequestStream] = []
        self._cancels: list[RequestStream] = []
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._draining: threading.Thread | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        kv_region_tokens = check_options(kv_region_tokens, max_num_blocks, prefix_cache_tokens, prefill_chunk_tokens)
        self._build(block_size, max_num_blocks, schedule, calibration, kv_region_tokens, prefix_cache_tokens)
        self.max_model_len = capped_model_len(self.scheduler.max_request_tokens(), self.max_model_len,
                                              max_num_blocks, block_size)
        self.scheduler.prefill_chunk = prefill_chunk(prefill_chunk_tokens, self.target, self.batch.device)
        bound_catch_up(self.speculator, self.scheduler.prefill_chunk, block_size)
        self.warmup = self.batch.device.type == "cuda" if warmup is None else bool(warmup)
        self.short_warmup = warmup is None and not self.warmup  # one request: pools and first-call costs
        self.warmup_report: dict | None = None  # what the warm-up ran: steps, draft tokens, seconds
        self._ready = threading.Event()

    # --- setup ---------------------------------------------------------------------------------------------------

    def _build(self, block_size, max_num_blocks, schedule, calibration, kv_region_tokens, prefix_cache_tokens) -> None:
        slots, device = self.max_batch_size, self.model.get_input_embeddings().weight.device
        width = self.max_model_len + self.k + 2
        self.batch = make_batch(slots, width, device, self.pad_token_id, self.vocab_size, self.eos_token_ids)
        # This host's profile, measured now if it has none (a server's first request should not wait for it)
        ensure_profile(self.model, self.speculator, calibration)
        self.target = make_runner(self.model, block_size=block_size, max_num_blocks=max_num_blocks)
        compile_steps(self.model, self.target, self.speculator, self.model.generation_config)  # at the warm-up
        if kv_region_tokens and hasattr(self.target, "give_regions"):
            self.target.give_regions(list(range(slots)), min(kv_region_tokens, width))
        policy = None
        if schedule == "adaptive":
            policy = adaptive_policy(self.model, self.speculator, self.target, slots, self.k, calibration)
        constraints = row_constraints(self.tokenizer, slots, self.vocab_size)
        self.step = Step(self.speculator, self.k, constraints=constraints, policy=policy)
        eos = torch.tensor(self.eos_token_ids, device=device) if self.eos_token_ids else None
        self.prefix_cache = make_prefix_cache(prefix_cache_tokens, block_size, self.model, self.target,
                                              self.speculator)
        self.scheduler = Scheduler(self.batch, self.target, self.step, StopRules(None, eos), self.pad_token_id,
                                   self.metrics, max_num_blocks=max_num_blocks, prefix_cache=self.prefix_cache,
                                   weigh_rows=True)
        self.calibration = calibration

    # --- lifecycle -----------------------------------------------------------------------------------------------

    def start(self) -> ServingEngine:
        """Starts the engine thread; returns once it serves (after the warm-up, when there is one)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hf_specdec-engine", daemon=True)
            self._thread.start()
            self._ready.wait()
            if self._error is not None:
                raise RuntimeError(f"the engine failed to start: {type(self._error).__name__}: {self._error}") \
                    from self._error
        return self

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Stops taking requests; lets those in flight finish for up to `grace_s` seconds, cancels the rest, and
        stops the engine thread."""
        self.begin_shutdown(grace_s)
        self._draining.join()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def begin_shutdown(self, grace_s: float = 0.0) -> None:
        """`shutdown` without waiting: stops taking requests now, and cancels what is still in flight after
        `grace_s` seconds, from a thread of its own (a server calls this when the signal arrives, so that cancelled
        streams still end properly while their connections are open). Later calls change nothing."""
        with self._lock:
            if self._draining is not None:
                return
            self._stopping = True
            self._draining = threading.Thread(target=self._drain, args=(time.monotonic() + grace_s,),
                                              name="hf_specdec-drain", daemon=True)
        self._draining.start()

    def _drain(self, deadline: float) -> None:
        while time.monotonic() < deadline and self.num_running + self.num_waiting > 0 and self.alive:
            time.sleep(0.02)
        with self._lock:
            for stream in list(self._streams.values()):
                self._cancels.append(stream)
            self._wake.notify_all()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._incoming)

    @property
    def num_blocks_in_use(self) -> int:
        return self.scheduler.num_blocks_in_use

    def tokens_per_second(self, window_s: float = 10.0) -> float:
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= window_s]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span

    # --- requests ------------------------------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], max_tokens: int | None = None, sampling: SamplingParams | None = None,
               stop: list[str] | None = None, grammar=None, loop: asyncio.AbstractEventLoop | None = None,
               request_id: str | None = None, logprobs: int | None = None,
               prompt_logprobs: int | None = None) -> RequestStream:
        """Queues a request. `grammar` is an `hf_specdec.Grammar` (compiled here, so a bad one fails now), or what
        `compile_grammar` made of one. With
        `loop`, the stream is consumed with `async for` on that loop; without, with a plain `for`. `logprobs`: report
        each token's log probability and that many likeliest alternatives (0 to `admission.MAX_LOGPROBS`; see
        `Request.logprobs`), in every `Delta` and in `stream.request.output_logprobs`. `prompt_logprobs`: the same for
        each prompt token after the first (`Request.prompt_logprobs`), in `stream.request.prompt_token_logprobs`
        once the first delta arrives; with `max_tokens=0` the prompt alone is scored.

        Raises `RequestError` for a request that cannot be served (the field named), `QueueFullError` when the queue
        is full, `RuntimeError` when the engine is shutting down or has failed."""
        if self._error is not None:
            raise RuntimeError(f"the engine stopped after an error: {self._error}")
        max_tokens, sampling = check_request(self, prompt_ids, max_tokens, sampling, stop, grammar, logprobs,
                                             prompt_logprobs)
        if grammar is not None and not (isinstance(grammar, CheckedGrammar) and grammar.engine is self):
            grammar = self.compile_grammar(grammar)
        compiled = None if grammar is None else grammar.compiled
        request = Request(list(prompt_ids), max_tokens, sampling, compiled, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs, **(
            {"request_id": request_id} if request_id else {}))
        if loop is not None:
            stream = RequestStream(request, tuple(stop or ()), self, loop, asyncio.Queue())
        else:
            stream = RequestStream(request, tuple(stop or ()), self, None, queue.Queue())
        stream.prompt_tokens = len(prompt_ids)
        with self._lock:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            if self.num_waiting >= self.max_queue + max(self.max_batch_size - self.num_running, 0):
                self.counters["rejected"] += 1
                raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting); retry later")
            self._incoming.append(stream)
            self._streams[request.request_id] = stream
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(prompt_ids)
            self._wake.notify_all()
        return stream

    def compile_grammar(self, grammar) -> CheckedGrammar:
        """`grammar` (an `hf_specdec.Grammar`) compiled against the model's tokenizer and checked, for `submit` to
        take as it is: compiling a large schema takes up to a second, which a server does off its event loop.
        Raises `RequestError` (on `response_format`) for a grammar this engine cannot serve."""
        return checked_grammar(self, grammar)

    def cancel(self, stream: RequestStream) -> None:
        """Ends a request; its KV blocks return to the pool at the next step."""
        with self._lock:
            self._cancels.append(stream)
            self._wake.notify_all()

    def generate(self, prompt_ids: list[int], **kwargs) -> RequestStream:
        """Submits and waits (for offline use and tests): returns the finished stream."""
        stream = self.submit(prompt_ids, **kwargs)
        for _ in stream:
            pass
        return stream

    # --- the engine thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with ExitStack() as stack:
                stack.enter_context(torch.no_grad())
                stack.enter_context(runner_attention(self.model))
                stack.enter_context(host_linear(self.model, self.speculator, self.calibration,
                                                compiled(self.target)))
                self.speculator.begin(self.model, self.batch)
                stack.callback(self.speculator.end)
                if self.warmup or self.short_warmup:
                    warm_up(self, short=not self.warmup)
                self._ready.set()
                while True:
                    with self._lock:
                        for stream in self._incoming:
                            self.scheduler.add(stream.request)
                        self._incoming.clear()
                        for stream in self._cancels:
                            self.scheduler.cancel(stream.request)
                        self._cancels.clear()
                        if not self.scheduler.has_work():
                            if self._stopping:
                                return
                            self._wake.wait(timeout=0.5)
                            continue
                    try:
                        events = self.scheduler.step()
                    except Exception as error:  # noqa: BLE001 - the step's requests fail; the server runs on
                        events = self._fail_running(error)
                    self._recent.append((time.perf_counter(), sum(len(t) for _, t, _ in events)))
                    for request, tokens, finished in events:
                        self._deliver(request, tokens, finished)
        except BaseException as error:  # noqa: BLE001 - every waiting client hears of it, then the thread ends
            logger.exception("hf_specdec serving engine failed")
            self._error = error
            self._ready.set()
            with self._lock:
                streams = list(self._streams.values()) + list(self._incoming)
                self._streams.clear()
                self._incoming.clear()
            for stream in streams:
                stream._put(RuntimeError(f"the engine failed: {type(error).__name__}: {error}"))

    def _fail_running(self, error: Exception) -> list:
        """A step raised: the requests it ran get the error (their state may be half-updated) and leave the batch,
        their blocks freed; requests waiting, and later ones, are served as usual."""
        logger.exception("hf_specdec serving: a step failed; its requests get the error")
        running = sorted(self.scheduler.running)
        failed = [self.scheduler.running[row] for row in running]
        self.scheduler._retire(running)
        self.batch.active = []
        for request in failed:
            request.finish_reason = "error"
            with self._lock:
                stream = self._streams.pop(request.request_id, None)
            if stream is not None:
                stream._put(RuntimeError(f"generation failed: {type(error).__name__}: {error}"))
        return []

    def _deliver(self, request: Request, tokens: list[int], finished: bool) -> None:
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        if request.finish_reason == "error":  # refused as it joined the batch, or its grammar ran dry; others run on
            with self._lock:
                self._streams.pop(request.request_id, None)
            stream._put(RequestError(request.error, "response_format" if request.error_field == "grammar" else None))
            return
        if tokens and stream.first_token_time is None:
            stream.first_token_time = time.perf_counter()
        self.counters["generation_tokens"] += len(tokens)
        text = self._answer_text(stream, request)
        if finished:
            text = self._checked_text(stream, request, text)
        reason = request.finish_reason if finished else None
        floor = stop_floor(stream, request, self.tokenizer)
        hit = None if floor is None else find_stop(text, stream.stop, stream._sent, floor)
        if hit is not None and not finished:  # the text it ends on is checked too
            checked = self._checked_text(stream, request, text)
            if checked != text:
                text, hit = checked, find_stop(checked, stream.stop, stream._sent, floor)
        if hit is not None:  # a stop string: the text ends before it, and so does the request
            excess = drop_tokens_past(self.tokenizer, request, len(tokens), text, hit, stream.stop)
            tokens = tokens[:len(tokens) - excess]
            self.counters["generation_tokens"] -= excess
            text, reason = text[:hit], "stop"
            if not finished:
                self.scheduler.cancel(request)
                finished = True
        stream._decoded = text
        # Hold back what may still change: an incomplete character, or the start of a stop string.
        ready = len(text) if finished else safe_length(text, stream.stop)
        delta = text[stream._sent: max(ready, stream._sent)]
        stream._sent = max(ready, stream._sent)
        if reason == "cancelled":
            self.counters["cancelled"] += 1
        if finished:
            with self._lock:
                self._streams.pop(request.request_id, None)
        if delta or tokens or finished:
            logprobs = None
            if request.logprobs is not None:
                logprobs = request.output_logprobs[len(request.output_logprobs) - len(tokens):] if tokens else []
            stream._put(Delta(tokens, delta, reason, logprobs))

    def _answer_text(self, stream: RequestStream, request: Request) -> str:
        """The text of the request's tokens so far, decoded a few tokens at a time (`AnswerText`)."""
        if self.tokenizer is None:
            return ""
        if not self.incremental_text:
            return self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
        if stream._answer is None:
            stream._answer = AnswerText(self.tokenizer)
        return stream._answer.update(request.output_ids)

    def _checked_text(self, stream: RequestStream, request: Request, text: str) -> str:
        """The answer's final `text`, checked against the whole answer decoded at once; if they differ, the whole
        decode, and whole answers are decoded from then on."""
        if stream._answer is None or not self.incremental_text or stream._answer.finish(request.output_ids):
            return text
        logger.warning("hf_specdec: the tokenizer's text of a few tokens did not join into the whole answer's text; "
                       "decoding whole answers from now on (slower, exact)")
        self.incremental_text = False
        return stream._answer.text
