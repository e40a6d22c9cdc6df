"""What a server's text costs per request and step: the whole answer decoded at every step (what `ServingEngine` did)
against `serving.detokenize.AnswerText` (a window of the last few tokens), on the embedded models' real tokenizers.

Answers are real text: the built-in prompts' own tokens (English, code, lists), then a multilingual passage
(accents, CJK, emoji: characters spanning several byte tokens), grown by 1 to 4 tokens a step as accepted drafts
arrive; every step's text is compared with the whole decode, and the time of each way is the median of `--repeats`
passes over the same steps, in microseconds per step, at the answer's last `--window` steps (where a long answer's
steps are).

    python benchmarks/detokenize_cost.py --models smollm2-135m-instruct,gemma-3-270m --lengths 64,256,1024
"""

import argparse
import random
import statistics
import time

from hf_specdec.models import load_tokenizer
from hf_specdec.serving.detokenize import AnswerText, decodes_locally
from hf_specdec.workloads import OPEN_CHAT, GROUNDED

PASSAGE = ("Caf\u00e9 cr\u00e8me, d\u00e9j\u00e0 vu, na\u00efve se\u00f1or. \u4e2d\u6587\u5b57\u7b26\u4e32\u6d4b\u8bd5\u3002 "
           "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3002 \U0001f642\U0001f680\U0001f389 "
           "\u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u0442\u0435\u043a\u0441\u0442. ")


def answer_ids(tokenizer, length: int) -> list[int]:
    text = " ".join(list(GROUNDED.values()) + list(OPEN_CHAT.values())) + " " + PASSAGE * 4
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def steps_of(length: int, seed: int) -> list[int]:
    rng, ends, n = random.Random(seed), [], 0
    while n < length:
        n = min(length, n + rng.choice((1, 1, 2, 3, 4)))
        ends.append(n)
    return ends


def measure(tokenizer, ids: list[int], ends: list[int], window: int, repeats: int) -> dict:
    whole_times, window_times = [], []
    for _ in range(repeats):
        answer = AnswerText(tokenizer)
        spent_whole = spent_window = 0.0
        for i, end in enumerate(ends):
            prefix = ids[:end]
            t0 = time.perf_counter()
            whole = tokenizer.decode(prefix, skip_special_tokens=True)
            t1 = time.perf_counter()
            text = answer.update(prefix)
            t2 = time.perf_counter()
            assert text == whole, (end, text[-40:], whole[-40:])
            if i >= len(ends) - window:
                spent_whole += t1 - t0
                spent_window += t2 - t1
        counted = min(window, len(ends))
        whole_times.append(spent_whole / counted * 1e6)
        window_times.append(spent_window / counted * 1e6)
    return {"whole_us": statistics.median(whole_times), "window_us": statistics.median(window_times),
            "whole_decodes": answer.whole_decodes, "steps": len(ends)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m-instruct")
    parser.add_argument("--lengths", default="64,256,1024")
    parser.add_argument("--window", type=int, default=20, help="steps at each answer's end that are timed")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| tokenizer | answer tokens | steps | whole decode per step (us) | window per step (us) | ratio | "
          "steps decoding whole |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        tokenizer = load_tokenizer(name)
        assert decodes_locally(tokenizer), f"{name}: its decoder is not one AnswerText takes"
        for length in (int(x) for x in args.lengths.split(",")):
            ids = answer_ids(tokenizer, length)
            r = measure(tokenizer, ids, steps_of(length, length), args.window, args.repeats)
            print(f"| {name} | {length} | {r['steps']} | {r['whole_us']:.1f} | {r['window_us']:.1f} | "
                  f"{r['whole_us'] / r['window_us']:.1f}x | {r['whole_decodes']} |", flush=True)


if __name__ == "__main__":
    main()
