"""A fresh serving engine's first requests, with and without the short warm-up that runs by default where the full
one is off (docs/benchmarks.md, "A fresh server's first request"): per configuration, the seconds `start` took and
the time to first token of three requests sent one after another (4 new tokens each).

    python benchmarks/first_request.py [--speculators ngram,eagle]
"""

import argparse
import time

import torch

from hf_specdec.tools.speculator_args import speculator_from_spec as _speculator
from hf_specdec.models import DEFAULT_MODEL, load_model
from hf_specdec.tools.serve_bench import workload
from hf_specdec.serving.engine import ServingEngine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--speculators", default="ngram")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(DEFAULT_MODEL)
    requests = workload(tokenizer, 3)
    for name in args.speculators.split(","):
        for warmup in (False, None):  # none, then the default (the short one on a CPU)
            started = time.perf_counter()
            engine = ServingEngine(model, tokenizer, _speculator(name, model, tokenizer, model_name=DEFAULT_MODEL),
                                   max_batch_size=32, max_queue=8, warmup=warmup).start()
            startup = time.perf_counter() - started
            ttft = []
            try:
                for prompt, _ in requests:
                    sent = time.perf_counter()
                    stream = iter(engine.submit(prompt, 4))
                    next(stream)
                    ttft.append(time.perf_counter() - sent)
                    for _ in stream:
                        pass
            finally:
                engine.shutdown()
            kind = (engine.warmup_report or {}).get("kind", "none")
            print(f"{name}, warm-up {kind}: start {startup:.2f} s, time to first token "
                  + ", ".join(f"{1e3 * t:.0f}" for t in ttft) + " ms", flush=True)


if __name__ == "__main__":
    main()
