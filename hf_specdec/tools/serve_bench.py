"""`hf-specdec bench-serve`: requests with mixed answer lengths arriving at a fixed rate, served four ways in one run.

- `hf-specdec serve` with each speculator asked for (n-gram, the shipped EAGLE head, ...): a server process on a
  loopback port, driven over HTTP by streamed `/v1/completions` requests from this one, as a client would;
- the same server with speculation off (k = 0): our own continuous batching alone;
- transformers' continuous batching (`init_continuous_batching`, what `generate_batch` and `transformers serve` run),
  the same requests added at the same times.

Reported per configuration: total tokens/s (every generated token over the span from the first arrival to the last
completion), p50/p90 time to first token, p50/p90 per-token latency after the first, and how many answers equal
transformers' (greedy, so they should all). With `--repeats N` every configuration runs N times, the order rotating
by one each round so none always follows another; each figure is the median over the rounds, and the ratios to
transformers and to speculation off are medians of the per-round ratios (configurations of one round ran side by
side, so a slow spell of a shared host falls on all of them). The workload cycles through six prompts, so prefix
caching (ours and transformers' block sharing, both on by default) finds most of each prompt stored: the metrics say
how many prompt tokens were fed and how many were found.
"""

import asyncio
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import torch

from ..models import load_model, parse_dtype
from ..workloads import GROUNDED, OPEN_CHAT, chat_inputs

LENGTHS = (16, 48, 96, 160)  # max_tokens of the requests, cycled: short and long answers mixed
TRANSFORMERS = "transformers continuous batching"
SPECULATION_OFF = "hf_specdec serve, speculation off"


@dataclass
class Served:
    """One request's timings (seconds from its arrival) and answer."""

    ttft: float
    duration: float
    tokens: int
    text: str


@dataclass
class ServeResult:
    configuration: str
    tokens_per_s: float
    ttft_p50: float
    ttft_p90: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    requests: int
    identical: int = 0
    metrics: dict = field(default_factory=dict)


def workload(tokenizer, num_requests: int = 32) -> list[tuple[list[int], int]]:
    """`(prompt ids, max_tokens)` per request: grounded and open-chat prompts alternating, answer lengths mixed."""
    prompts = [p for pair in zip(GROUNDED.values(), OPEN_CHAT.values()) for p in pair]
    out = []
    for i in range(num_requests):
        ids = chat_inputs(tokenizer, [prompts[i % len(prompts)]])["input_ids"][0].tolist()
        out.append((ids, LENGTHS[(i * 3 + i // len(LENGTHS)) % len(LENGTHS)]))
    return out


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def summarize(name: str, served: list[Served], arrivals: list[float], start: float) -> ServeResult:
    end = max(a + s.duration for a, s in zip(arrivals, served))
    total = sum(s.tokens for s in served)
    tpots = [(s.duration - s.ttft) / (s.tokens - 1) for s in served if s.tokens > 1]
    ttfts = [s.ttft for s in served]
    return ServeResult(name, total / (end - start), _percentile(ttfts, 0.5), _percentile(ttfts, 0.9),
                       1000 * _percentile(tpots, 0.5), 1000 * _percentile(tpots, 0.9), len(served))


def run_server(model_name: str, spec: str, k: int | None, requests, rate: float, max_batch_size: int, name: str,
               threads: int | None = None, extra: tuple = ()) -> tuple[ServeResult, list[Served]]:
    """`hf-specdec serve` in its own process on a free loopback port; an async HTTP client in this one sends the
    requests on schedule (streamed completions, greedy), and reads the speculative counters from `/metrics`."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import tempfile

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "hf_specdec", "serve", "--model", model_name, "--speculator", spec,
               "--port", str(port), "--max-batch-size", str(max_batch_size), "--max-queue", str(len(requests)),
               "--log-level", "warning", *extra]
    if k is not None:
        command += ["-k", str(k)] + (["--schedule", "constant"] if k == 0 else [])
    if threads:
        command += ["--threads", str(threads)]
    # The server's log goes to a file: a pipe nobody reads while the requests run would fill and stall the server.
    with tempfile.NamedTemporaryFile("w", prefix="hf_specdec_serve_", suffix=".log", delete=False) as log:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)

    def log_tail() -> str:
        with open(log.name) as f:
            return f.read()[-2000:]

    url = f"http://127.0.0.1:{port}"

    async def one(client, delay: float, prompt: list[int], max_tokens: int) -> Served:
        await asyncio.sleep(delay)
        sent = time.perf_counter()
        first, text, tokens = None, [], 0
        async with client.stream("POST", url + "/v1/completions", json={
                "model": model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    if c.get("text"):
                        first = first or time.perf_counter()
                        text.append(c["text"])
        now = time.perf_counter()
        return Served((first or now) - sent, now - sent, tokens, "".join(text))

    async def drive():
        async with httpx.AsyncClient(timeout=600) as client:
            start = time.perf_counter()
            served = await asyncio.gather(*(one(client, i / rate, p, n) for i, (p, n) in enumerate(requests)))
        return start, served

    def counters() -> dict:
        values = {}
        for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
            if line.startswith("hf_specdec:") and "{" not in line:
                key, value = line.split()
                values[key[len("hf_specdec:"):]] = float(value)
        return values

    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"hf-specdec serve did not start: {log_tail()}")
            time.sleep(0.2)
        # Warm-up: one short request, so the first timed one does not pay for setup.
        httpx.post(url + "/v1/completions", json={"model": model_name, "prompt": requests[0][0], "max_tokens": 4,
                                                  "temperature": 0}, timeout=600)
        before = counters()
        start, served = asyncio.run(drive())
        after = counters()
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
    tail = log_tail()
    if "Traceback" in tail or "ERROR" in tail:  # a failed step ends its requests' streams early: say why
        print(f"{name}: the server logged errors ({log.name}):\n{tail}", file=sys.stderr)
    result = summarize(name, served, [start + i / rate for i in range(len(requests))], start)
    drafted = after["spec_decode_num_draft_tokens_total"] - before["spec_decode_num_draft_tokens_total"]
    accepted = after["spec_decode_num_accepted_tokens_total"] - before["spec_decode_num_accepted_tokens_total"]
    result.metrics = {"steps": after["num_steps_total"] - before["num_steps_total"], "draft_tokens": drafted,
                      "accepted_tokens": accepted, "acceptance": accepted / drafted if drafted else 0.0,
                      "prompt_tokens": after["prompt_tokens_total"] - before["prompt_tokens_total"],
                      "prefix_cache_hit_tokens": after.get("prefix_cache_hits_total", 0.0)
                      - before.get("prefix_cache_hits_total", 0.0)}
    return result, served


def run_transformers(model, tokenizer, requests, rate: float, max_batch_size: int) -> tuple[ServeResult, list[Served]]:
    """transformers' continuous batching manager, the requests added on the same schedule."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in requests),
                              eos_token_id=model.generation_config.eos_token_id,
                              pad_token_id=model.generation_config.pad_token_id)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        manager.add_request(requests[0][0], request_id="warmup", max_new_tokens=4)
        while (r := manager.get_result(timeout=600)) is not None and r.request_id != "warmup":
            pass
        start = time.perf_counter()
        sent = {}

        def feed():
            for i, (prompt, n) in enumerate(requests):
                delay = start + i / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                sent[f"r{i}"] = time.perf_counter()
                manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True)

        feeder = threading.Thread(target=feed)
        feeder.start()
        results = {}
        while len(results) < len(requests):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers' continuous batching stopped before every request finished")
            if result.is_finished() and result.request_id.startswith("r"):
                results[result.request_id] = (result, time.perf_counter())
        feeder.join()
    finally:
        manager.stop(block=True)
    served = []
    for i in range(len(requests)):
        result, done = results[f"r{i}"]
        stamps = result.timestamps or [done]
        served.append(Served(stamps[0] - sent[f"r{i}"], done - sent[f"r{i}"], len(result.generated_tokens),
                             tokenizer.decode(result.generated_tokens, skip_special_tokens=True)))
    return summarize(TRANSFORMERS, served,
                     [sent[f"r{i}"] for i in range(len(requests))], start), served


def run(model, tokenizer, model_name: str, speculators: dict, num_requests: int = 32, rate: float = 1.0,
        max_batch_size: int = 8, threads: int | None = None, extra: tuple = (), repeats: int = 1
        ) -> list[list[ServeResult]]:
    """`speculators`: configuration name -> (`--speculator` value, `-k` or `None`). Returns one list of results per
    round, transformers' first, then the configurations in the order given (each round ran them rotated)."""
    requests = workload(tokenizer, num_requests)
    names = [TRANSFORMERS, *speculators]
    reference = None
    rounds = []
    for round_index in range(repeats):
        shift = round_index % len(names)
        done = {}
        for name in names[shift:] + names[:shift]:
            if name == TRANSFORMERS:
                result, served = run_transformers(model, tokenizer, requests, rate, max_batch_size)
            else:
                spec, k = speculators[name]
                result, served = run_server(model_name, spec, k, requests, rate, max_batch_size, name, threads,
                                            extra)
            done[name] = (result, served)
        if reference is None:  # transformers' answers in the first round are the reference
            reference = [s.text for s in done[TRANSFORMERS][1]]
        for name, (result, served) in done.items():
            result.identical = sum(s.text == t for s, t in zip(served, reference))
        rounds.append([done[name][0] for name in names])
    return rounds


def summarize_rounds(rounds: list[list[ServeResult]]) -> list[dict]:
    """Per configuration: each figure's median over the rounds, and the medians of the per-round ratios of its
    tokens/s to transformers' and to speculation off's."""
    def ratios(i: int, j: int | None) -> float | None:
        if j is None:
            return None
        return statistics.median(r[i].tokens_per_s / r[j].tokens_per_s for r in rounds)

    names = [r.configuration for r in rounds[0]]
    off = names.index(SPECULATION_OFF) if SPECULATION_OFF in names else None
    rows = []
    for i, name in enumerate(names):
        runs = [r[i] for r in rounds]
        acceptances = [r.metrics["acceptance"] for r in runs if r.metrics.get("draft_tokens")]
        rows.append({
            "configuration": name, "rounds": len(runs),
            **{key: statistics.median(getattr(r, key) for r in runs)
               for key in ("tokens_per_s", "ttft_p50", "ttft_p90", "tpot_p50_ms", "tpot_p90_ms")},
            "vs_transformers": ratios(i, 0), "vs_speculation_off": ratios(i, off),
            "acceptance": statistics.median(acceptances) if acceptances else None,
            "identical": min(r.identical for r in runs), "requests": runs[0].requests,
            "tokens_per_s_each": [r.tokens_per_s for r in runs],
        })
    return rows


def table(rows: list[dict]) -> str:
    out = ["| configuration | tokens/s | vs transformers | vs speculation off | TTFT p50 s | TTFT p90 s "
           "| per-token p50 ms | per-token p90 ms | acceptance | identical |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        acceptance = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        off = f"{r['vs_speculation_off']:.2f}x" if r["vs_speculation_off"] is not None else "-"
        out.append(f"| {r['configuration']} | {r['tokens_per_s']:.1f} | {r['vs_transformers']:.2f}x | {off} | "
                   f"{r['ttft_p50']:.2f} | {r['ttft_p90']:.2f} | {r['tpot_p50_ms']:.0f} | {r['tpot_p90_ms']:.0f} | "
                   f"{acceptance} | {r['identical']}/{r['requests']} |")
    return "\n".join(out)


def cmd_bench_serve(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=args.device)
    speculators = {SPECULATION_OFF: ("ngram", 0)}
    for name in filter(None, args.speculators.split(",")):
        speculators[f"hf_specdec serve {name}"] = (name, None)
    extra = tuple(["--no-calibrate"] if args.no_calibrate else []) + tuple(
        option for flag, value in (("--device", args.device), ("--dtype", args.dtype)) if value
        for option in (flag, value))
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    rounds = run(model, tokenizer, args.model, speculators, args.requests, args.rate, args.max_batch_size,
                 args.threads, extra, args.repeats)
    summary = summarize_rounds(rounds)
    print(table(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"requests": args.requests, "rate": args.rate, "max_batch_size": args.max_batch_size,
                       "repeats": args.repeats, "command": " ".join(["hf-specdec", *sys.argv[1:]]),
                       "summary": summary, "results": [asdict(r) for r in rounds[0]],
                       "rounds": [[asdict(r) for r in results] for results in rounds]}, f, indent=2)
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--speculators", default="ngram,eagle", help="comma-separated, as for bench")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every configuration, order rotating; "
                        "figures are medians, ratios medians of per-round ratios")
    parser.add_argument("--out", default=None, help="JSON results file")
    parser.set_defaults(func=cmd_bench_serve)

