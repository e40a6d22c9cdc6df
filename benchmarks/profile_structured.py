"""Where the time of one structured-output request goes: plain constrained `generate` vs n-gram + grammar, timed
side by side, then a cProfile of the speculative call (top functions by own time).

    python benchmarks/profile_structured.py [REQUEST_INDEX] [--model NAME] [--dtype D] [--device D] [--threads 2]

REQUEST_INDEX: one of hf_specdec/extraction.py's requests (default 0).
"""

import argparse
import cProfile
import pstats
import time

import _common  # benchmarks/, this script's folder
import torch

from hf_specdec import Grammar
from hf_specdec.extraction import PROMPTS, SCHEMAS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("index", nargs="?", type=int, default=0, metavar="REQUEST_INDEX")
    _common.add_model_args(parser)
    args = parser.parse_args()
    index = args.index
    model, tokenizer = _common.load(args)
    inputs = _common.chat_batch(tokenizer, [PROMPTS[index]], device=model.device)
    kwargs = dict(max_new_tokens=128, do_sample=False, grammar=Grammar.json_schema(SCHEMAS[index]),
                  tokenizer=tokenizer, return_dict_in_generate=True)
    model.generate(**inputs, speculator="ngram", **{**kwargs, "max_new_tokens": 8})  # warm-up
    start = time.perf_counter()
    plain = model.generate(**inputs, **kwargs)
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    fast = model.generate(**inputs, speculator="ngram", **kwargs)
    fast_s = time.perf_counter() - start
    m = fast.speculative_metrics
    print(f"plain {plain_s:.2f} s, ngram + grammar {fast_s:.2f} s ({plain_s / fast_s:.2f}x), identical: "
          f"{torch.equal(plain.sequences, fast.sequences)}")
    print(f"steps {m.num_steps}, emitted {m.num_emitted_tokens}, speculator drafted {m.num_draft_tokens} accepted "
          f"{m.num_accepted_tokens}, grammar drafted {m.num_grammar_draft_tokens} accepted {m.num_grammar_tokens}, "
          f"k per step {m.k_per_step}")
    profile = cProfile.Profile()
    profile.enable()
    model.generate(**inputs, speculator="ngram", **kwargs)
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
