"""The server's warm-up, measured: each configuration in a fresh process with an empty Triton cache (so nothing
compiled by an earlier run helps), a `ServingEngine` started with and without `warmup`, then the same requests
twice: the first time (what a server's first clients see) and again once everything is warm (prefix caching off, so
both passes prefill alike). Reports the start time, each pass's time to first token (p50, max) and its wall time,
greedy and sampled requests mixed.

    python benchmarks/serve_warmup.py --device cuda --dtype bfloat16 [--speculator ngram] [--requests 8] --out F.json
        [--model NAME] [--threads 2]

On a CPU (nothing to compile) it runs the same way; there the warm-up is off by default.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _common  # benchmarks/, this script's folder


def child(args) -> dict:
    from hf_specdec.tools.speculator_args import speculator_from_spec as _speculator
    from hf_specdec.decode.requests import SamplingParams
    from hf_specdec.serving.engine import ServingEngine

    model, tokenizer = _common.load(args)
    requests = _common.serve_requests(tokenizer, args.requests)
    start = time.perf_counter()
    spec = _speculator(args.speculator, model, tokenizer, model_name=args.model)
    engine = ServingEngine(model, tokenizer, spec,
                           max_batch_size=args.requests, max_queue=2 * args.requests, warmup=args.child == "warm",
                           prefix_cache_tokens=0)  # the second pass must prefill as the first did
    engine.start()
    result = {"configuration": args.child, "start_s": time.perf_counter() - start,
              "warmup_report": engine.warmup_report}
    for name in ("first", "again"):
        streams, begin = [], time.perf_counter()
        for i, (prompt, max_tokens) in enumerate(requests):  # half greedy, half sampled
            sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=i) if i % 2 else None
            streams.append(engine.submit(prompt, min(max_tokens, args.max_tokens), sampling))
        for stream in streams:
            for _ in stream:
                pass
        ttft = [s.first_token_time - s.arrival_time for s in streams]
        result[name] = {"wall_s": time.perf_counter() - begin, "ttft_p50_s": statistics.median(ttft),
                        "ttft_max_s": max(ttft), "tokens": sum(len(s.request.output_ids) for s in streams)}
    engine.shutdown()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    _common.add_model_args(parser, device="cpu")
    parser.add_argument("--speculator", default="ngram")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", choices=["cold", "warm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    results = []
    for configuration in ("cold", "warm"):
        with tempfile.TemporaryDirectory() as cache:  # an empty Triton cache: every kernel compiles afresh
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            command = [sys.executable, __file__, "--child", configuration, "--device", args.device,
                       "--speculator", args.speculator, "--requests", str(args.requests),
                       "--max-tokens", str(args.max_tokens), "--threads", str(args.threads), "--model", args.model]
            if args.dtype:
                command += ["--dtype", args.dtype]
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{configuration} run failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(line[len("RESULT "):]))
    print("| warm-up | start s | first pass: TTFT p50 / max s, wall s | again: TTFT p50 / max s, wall s |")
    print("| --- | --- | --- | --- |")
    for r in results:
        first, again = r["first"], r["again"]
        print(f"| {'on' if r['configuration'] == 'warm' else 'off'} | {r['start_s']:.1f} | "
              f"{first['ttft_p50_s']:.2f} / {first['ttft_max_s']:.2f}, {first['wall_s']:.1f} | "
              f"{again['ttft_p50_s']:.2f} / {again['ttft_max_s']:.2f}, {again['wall_s']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
