"""Two or more calibration profiles of one model, paired in one process: speculation off and a speculator under each.

A change to what a profile holds (the step cost's grid, the linear forms) is judged by the calls it changes, and a
2-core host's bench cells move by about 0.1x run to run. This times `generate` (greedy, `--max-new-tokens`) over a
workload's prompts with `HF_SPECDEC_CACHE` switched per call between the directories given, speculation off under
the first and the speculator under each, every configuration once per round, the order reversed every other round,
and prints each one's times and its median speedup over speculation off, paired by round. A directory without a
profile for the model gets one measured on its first call (the first-call grid), before the rounds.

    python benchmarks/paired_profiles.py --dirs /tmp/a,/tmp/b --speculator ngram --workload grounded --batch 1
"""

import argparse
import os
import statistics
import time

import _common
import torch

from hf_specdec.tools.speculator_args import speculator_from_spec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_model_args(parser)
    parser.add_argument("--dirs", required=True, help="comma-separated cache directories (HF_SPECDEC_CACHE), each "
                        "holding (or to hold) a profile of the model")
    parser.add_argument("--speculator", default="ngram", help="as `hf-specdec bench --speculators` takes one")
    parser.add_argument("--workload", default="grounded", choices=sorted(_common.WORKLOADS))
    parser.add_argument("--batch", type=int, default=1, help="1: each prompt its own call; more: one call of this "
                        "many rows, the prompts cycled")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    dirs = args.dirs.split(",")
    os.environ["HF_SPECDEC_CACHE"] = dirs[0]  # where the embedded model's weights are fetched to, once
    model, tokenizer = _common.load(args)
    speculator = speculator_from_spec(args.speculator, model, tokenizer, model_name=args.model)
    texts = _common.prompt_texts(args.workload)
    calls = ([_common.chat_batch(tokenizer, [text]) for text in texts] if args.batch == 1
             else [_common.chat_batch(tokenizer, texts, rows=args.batch)])
    configurations = [("off", dirs[0])] + [(args.speculator, d) for d in dirs]

    def run(name: str, directory: str) -> float:
        os.environ["HF_SPECDEC_CACHE"] = directory
        start = time.perf_counter()
        for inputs in calls:
            model.generate(**inputs.to(model.device), max_new_tokens=args.max_new_tokens, do_sample=False,
                           speculator="off" if name == "off" else speculator)
        return time.perf_counter() - start

    times = {c: [] for c in configurations}
    with torch.no_grad():
        for configuration in configurations:  # first calls: profiles measured where missing, warm-up
            run(*configuration)
        for i in range(args.rounds):
            for configuration in configurations if i % 2 == 0 else configurations[::-1]:
                times[configuration].append(run(*configuration))
    off = times[configurations[0]]
    for (name, directory), values in times.items():
        ratio = statistics.median(o / t for o, t in zip(off, values))
        print(f"{name:>12} {directory}: {', '.join(f'{t:.2f}' for t in values)} s; {ratio:.3f}x speculation off")


if __name__ == "__main__":
    main()
