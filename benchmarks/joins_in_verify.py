"""EAGLE under continuous batching: newcomers fed inside the running rows' verify, or in a step of their own?

24 requests (the benchmark's grounded and open-chat prompts alternating, answers of 16 to 136 tokens) through
`ServingEngine` with the shipped SmolLM2 head and 12 slots, so requests keep joining a running batch. Timed in turn
in one process, `--repeats` pairs in the order old, new, new, old, ...: "new" as shipped (`joins_in_verify`, the
head's catch-up packed), "old" with both switched off on the classes (a prefill-only step per newcomer, padded
catch-ups). Prints each time, the medians, the paired ratios, and whether the outputs agree.

    python benchmarks/joins_in_verify.py [--repeats 3] [--threads 2]
"""

import argparse
import statistics
import time

import torch

from hf_specdec import ServingEngine
from hf_specdec.models import DEFAULT_MODEL, TRAINED_HEADS_DIR, load_model
from hf_specdec.speculators.eagle import EagleSpeculator
from hf_specdec.speculators.heads import EagleHead
from hf_specdec.workloads import GROUNDED, OPEN_CHAT


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(DEFAULT_MODEL)
    head = EagleSpeculator.from_pretrained(TRAINED_HEADS_DIR / "smollm2-135m-instruct-eagle3")
    texts = [p for pair in zip(GROUNDED.values(), OPEN_CHAT.values()) for p in pair]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  return_dict=False)) for t in texts]
    prompts = (prompts * 4)[:24]
    lengths = [16 + 40 * (i % 4) for i in range(len(prompts))]

    def run(new: bool) -> tuple[float, list[list[int]]]:
        EagleSpeculator.joins_in_verify = new
        EagleHead._hf_specdec_packable = new
        start = time.perf_counter()
        engine = ServingEngine(model, None, head, max_batch_size=12, max_queue=64).start()
        try:
            streams = [engine.submit(p, n) for p, n in zip(prompts, lengths)]
            for stream in streams:
                for _ in stream:
                    pass
        finally:
            engine.shutdown()
        return time.perf_counter() - start, [s.request.output_ids for s in streams]

    try:
        run(True)  # warm-up
        times, outputs = {True: [], False: []}, {}
        for new in [False, True, True, False] * (args.repeats // 2) + [False, True] * (args.repeats % 2):
            elapsed, outputs[new] = run(new)
            times[new].append(elapsed)
            print(f"{'inside the verify' if new else 'own prefill step '}  {elapsed:.2f} s", flush=True)
    finally:
        EagleSpeculator.joins_in_verify, EagleHead._hf_specdec_packable = True, True
    old, new = statistics.median(times[False]), statistics.median(times[True])
    print(f"median: own prefill step {old:.2f} s, inside the verify {new:.2f} s ({old / new:.2f}x); paired: "
          + ", ".join(f"{a / b:.2f}" for a, b in zip(times[False], times[True])))
    print(f"outputs identical: {outputs[True] == outputs[False]}")


if __name__ == "__main__":
    main()
