"""Where the time of one structured-output request goes: plain constrained `generate` vs n-gram + grammar, timed
side by side, then a cProfile of the speculative call (top functions by own time).

    python benchmarks/profile_structured.py [REQUEST_INDEX]   # one of hf_specdec/extraction.py's requests
"""

import cProfile
import pstats
import sys
import time

import torch

from hf_specdec import Grammar
from hf_specdec.extraction import PROMPTS, SCHEMAS
from hf_specdec.models import DEFAULT_MODEL, load_model
from hf_specdec.workloads import chat_inputs


def main(index: int = 0) -> None:
    torch.set_num_threads(2)
    model, tokenizer = load_model(DEFAULT_MODEL)
    inputs = chat_inputs(tokenizer, [PROMPTS[index]])
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
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
