"""A long prompt arriving at a busy server, with and without chunked prefill (docs/benchmarks.md, "Serving").

Streams of the bench workload run (`--streams`, each up to `--stream-tokens` new tokens); once each has its first
token, a request whose prompt is `--prompt-tokens` long arrives (a document to summarise, 16 new tokens). Per
`prefill_chunk_tokens` setting: the running streams' longest wait between two tokens while the long prompt was
read, their p50 wait over the whole run, the long request's time to first token and the run's wall time. Every
configuration's outputs are checked equal to the first's.

    python benchmarks/long_prompt.py [--chunks 0,128,256,512] [--prompt-tokens 2000] [--speculator ngram]
        [--model NAME] [--dtype D] [--device D] [--threads 2]
"""

import argparse
import statistics
import threading
import time

import _common  # benchmarks/, this script's folder

from hf_specdec.tools.speculator_args import speculator_from_spec as _speculator
from hf_specdec.serving.engine import ServingEngine


def document(tokenizer, num_tokens: int) -> list[int]:
    """A chat asking for a summary of a document made of the bench's texts, `num_tokens` long."""
    texts = _common.prompt_texts("grounded") + _common.prompt_texts("open_chat")
    body, i = "", 0
    while True:
        ids = _common.chat_batch(tokenizer, ["Summarise this document in one sentence.\n\n" + body])["input_ids"][0]
        if len(ids) >= num_tokens:
            return ids[:num_tokens].tolist()
        body += texts[i % len(texts)] + "\n\n"
        i += 1


def run(engine, streams_plan, long_prompt) -> dict:
    arrivals = {}  # stream index -> [times of its deltas]
    outputs = {}

    def consume(i, stream):
        times = arrivals.setdefault(i, [])
        for delta in stream:
            if delta.token_ids:
                times.append(time.perf_counter())
        outputs[i] = stream.request.output_ids

    started = time.perf_counter()
    streams = [engine.submit(p, n) for p, n in streams_plan]
    threads = [threading.Thread(target=consume, args=(i, s)) for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    while any(len(arrivals.get(i, [])) < 1 for i in range(len(streams))):
        time.sleep(0.005)
    sent = time.perf_counter()
    long = engine.submit(long_prompt, 16)
    long_times = []
    for delta in long:
        if delta.token_ids:
            long_times.append(time.perf_counter())
    for t in threads:
        t.join()
    outputs["long"] = long.request.output_ids
    ttft = long_times[0] - sent
    gaps_during = [b - a for times in arrivals.values() for a, b in zip(times, times[1:]) if b > sent and a < sent + ttft]
    gaps = [b - a for times in arrivals.values() for a, b in zip(times, times[1:])]
    return {"ttft": ttft, "max_gap_during": max(gaps_during, default=0.0), "p50_gap": statistics.median(gaps),
            "wall": time.perf_counter() - started, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", default="0,128,256,512")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--speculator", default="ngram")
    _common.add_model_args(parser)
    args = parser.parse_args()
    model, tokenizer = _common.load(args)
    plan = [(p, args.stream_tokens) for p, _ in _common.serve_requests(tokenizer, args.streams)]
    long_prompt = document(tokenizer, args.prompt_tokens)
    reference = None
    print(f"{args.streams} streams of up to {args.stream_tokens} tokens, then a {len(long_prompt)}-token prompt; "
          f"speculator {args.speculator}", flush=True)
    for chunk in [int(c) for c in args.chunks.split(",")]:
        engine = ServingEngine(model, tokenizer, _speculator(args.speculator, model, tokenizer, model_name=args.model),
                               max_batch_size=16, max_queue=8, prefill_chunk_tokens=chunk).start()
        try:
            result = run(engine, plan, long_prompt)
        finally:
            engine.shutdown()
        same = reference is None or result["outputs"] == reference
        reference = reference or result["outputs"]
        print(f"prefill_chunk_tokens={chunk}: streams' longest wait while the prompt was read "
              f"{result['max_gap_during']:.2f} s, p50 wait {1e3 * result['p50_gap']:.0f} ms; long request's first "
              f"token {result['ttft']:.2f} s; wall {result['wall']:.1f} s; chunks {engine.scheduler.num_prefill_chunks}"
              f"; outputs {'identical' if same else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
