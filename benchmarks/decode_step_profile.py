"""hf_specdec's decode step against transformers' at batch 16, with drafting forced off.

The benchmark's open-chat prompts (cycled to `--batch` rows), `--max-new-tokens` greedy tokens: plain `generate`
and `generate(speculator="ngram")` with a step cost under which no draft pays (so every step is a plain decode step
through hf_specdec's engine), timed in turn after a warm-up, then each once under `cProfile`. Finally one call with
adaptive k as `hf-specdec bench` runs it, with its drafting counts.

    python benchmarks/decode_step_profile.py [--batch 16] [--max-new-tokens 128] [--repeats 2] [--threads 2]
        [--model NAME] [--dtype bfloat16] [--device cuda]
"""

import argparse
import cProfile
import io
import pstats
import time

import _common  # benchmarks/, this script's folder
import torch

import hf_specdec  # noqa: F401  (registers generate(speculator=...))
from hf_specdec import StepCost


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    _common.add_model_args(parser)
    args = parser.parse_args()
    model, tokenizer = _common.load(args)
    inputs = _common.chat_batch(tokenizer, "open_chat", args.batch, device=model.device)
    never_drafts = StepCost(per_row=0.0, points=((1, 10.0), (2, 20.0), (64, 640.0)))  # a draft costs a whole step
    plain, ours = {}, dict(speculator="ngram", speculative_step_cost=never_drafts)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    for extra in (plain, ours):
        model.generate(**inputs, max_new_tokens=4, do_sample=False, **extra)  # warm-up
    for _ in range(args.repeats):
        start = time.perf_counter()
        expected = model.generate(**inputs, **kwargs)
        plain_s = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(**inputs, **kwargs, **ours, return_dict_in_generate=True)
        ours_s = time.perf_counter() - start
        m = out.speculative_metrics
        print(f"plain generate {plain_s:.2f} s, hf_specdec without drafts {ours_s:.2f} s ({m.num_steps} steps, "
              f"{m.num_draft_tokens} drafts), identical: {torch.equal(out.sequences, expected)}")
    for name, extra in (("hf_specdec without drafts", ours), ("plain generate", plain)):
        profile = cProfile.Profile()
        profile.enable()
        model.generate(**inputs, **kwargs, **extra)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
        print(f"--- {name}\n{text.getvalue()}")
    m = model.generate(**inputs, **kwargs, speculator="ngram", return_dict_in_generate=True).speculative_metrics
    print(f"adaptive k: {m.total_time_s:.2f} s, drafting {m.draft_time_s:.2f} s, drafted in "
          f"{sum(k > 0 for k in m.k_per_step)} of {m.num_steps} steps, {m.num_draft_tokens} drafts, "
          f"{m.num_accepted_tokens} accepted")


if __name__ == "__main__":
    main()
