"""Where a batch-1 speculative step's time goes on a GPU: plain `generate` against `generate(speculator="ngram")` on
the first grounded prompt, with the verify ops on their default backend (Triton on CUDA) and on PyTorch
(`HF_SPECDEC_KERNEL_BACKEND=torch`), interleaved after warm-up calls, then one n-gram call under cProfile (host time
per function; on a launch-bound GPU the host is the step).

    python benchmarks/gpu_step_breakdown.py [--device cuda] [--dtype float32] [--max-new-tokens 64] [--repeats 3]
        [--model NAME] [--threads N]
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import _common  # benchmarks/, this script's folder
import torch

import hf_specdec  # noqa: F401  (registers generate(speculator=...))


def main() -> None:
    parser = argparse.ArgumentParser()
    _common.add_model_args(parser, dtype="float32", device="cuda", threads=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = _common.load(args)
    inputs = _common.chat_batch(tokenizer, _common.prompt_texts("grounded")[:1], device=model.device)

    def call(backend: str | None, **kwargs):
        saved = os.environ.pop("HF_SPECDEC_KERNEL_BACKEND", None)
        if backend:
            os.environ["HF_SPECDEC_KERNEL_BACKEND"] = backend
        try:
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 return_dict_in_generate=True, **kwargs)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start, out
        finally:
            os.environ.pop("HF_SPECDEC_KERNEL_BACKEND", None)
            if saved is not None:
                os.environ["HF_SPECDEC_KERNEL_BACKEND"] = saved

    configs = {"plain": (None, {}), "ngram default backend": (None, {"speculator": "ngram"}),
               "ngram torch backend": ("torch", {"speculator": "ngram"}),
               "ngram constant k=4": (None, {"speculator": "ngram", "speculative_schedule": "constant",
                                             "num_speculative_tokens": 4})}
    times = {name: [] for name in configs}
    reference = None
    for round_ in range(args.repeats + 2):  # two warm-up rounds (compiles, calibration), then the timed ones
        for name, (backend, kwargs) in configs.items():
            seconds, out = call(backend, **kwargs)
            tokens = out.sequences[0, inputs["input_ids"].shape[1]:]
            if reference is None:
                reference = tokens
            same = torch.equal(tokens, reference)
            metrics = getattr(out, "speculative_metrics", None)
            steps = metrics.num_steps if metrics is not None else len(tokens)
            if round_ >= 2:
                times[name].append(seconds)
            print(f"round {round_} {name}: {seconds * 1000:.1f} ms, {len(tokens)} tokens, {steps} steps "
                  f"({seconds * 1000 / max(steps, 1):.2f} ms/step), identical {same}"
                  + (f", drafts {metrics.num_draft_tokens} accepted {metrics.num_accepted_tokens}" if metrics else ""),
                  flush=True)
    plain = statistics.median(times["plain"])
    for name, values in times.items():
        print(f"median {name}: {statistics.median(values) * 1000:.1f} ms ({plain / statistics.median(values):.2f}x)")
    profile = cProfile.Profile()
    profile.enable()
    call(None, speculator="ngram")
    profile.disable()
    for key in ("tottime", "cumulative"):
        stream = io.StringIO()
        pstats.Stats(profile, stream=stream).sort_stats(key).print_stats(30)
        print(stream.getvalue()[:7000])


if __name__ == "__main__":
    main()
