"""Host time per decode step: hf_specdec's step over a model too small to cost anything, against transformers'.

A 1-layer Llama of hidden size 32 makes a forward's arithmetic negligible, so a step's time is what the host spends
on it: Python, the step's plan, small tensor ops and their dispatch (on a GPU, also the kernel launches that CUDA
graphs remove). `--rows` prompts repeating a short phrase (so n-gram drafts), `--max-new-tokens` greedy tokens: plain
`generate`, then hf_specdec with speculation off, with n-gram (adaptive k: the random model follows no phrase, so after
its first verify it drafts nothing and, once acceptance is that low, skips the lookup too) and with n-gram verifying 4
drafts every step (a constant schedule: the drafting step's own host time), each eager and with compiled steps
(`HF_SPECDEC_COMPILE=1`, compiled once before timing), medians of `--repeats` calls, one thread, no calibration.
"Outside the forward" is the step's time less the target forward's own (the model's call, eager or compiled, timed
around it): what stays on the host when the forward is a CUDA graph replayed on a GPU. "Ops outside the forward"
counts the tensor operations a step dispatches there, views left out, in one more call: on a GPU each is a kernel
launch or a host-side tensor op, some microseconds of host time however small the tensors.

    python benchmarks/host_time.py [--rows 32] [--max-new-tokens 128] [--repeats 5] [--no-compile]
"""

import argparse
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

import hf_specdec  # noqa: F401  (registers generate(speculator=...))
from hf_specdec.runners.graphed import GraphedSteps
from hf_specdec.runners.model_runner import ModelRunner

FORWARD_S = [0.0]  # seconds spent inside target forwards (eager `_call` or compiled `GraphedSteps.run`)
INSIDE = [0]  # forwards under way (their operations are not counted)


def timed_forwards() -> None:
    """Adds each forward's time to `FORWARD_S`."""
    for owner, name in ((ModelRunner, "_call"), (GraphedSteps, "run")):
        inner = getattr(owner, name)

        def timed(*args, _inner=inner, **kwargs):
            start = time.perf_counter()
            INSIDE[0] += 1
            try:
                return _inner(*args, **kwargs)
            finally:
                INSIDE[0] -= 1
                FORWARD_S[0] += time.perf_counter() - start
        setattr(owner, name, timed)


class OpsOutside(TorchDispatchMode):
    """Counts the tensor operations dispatched outside target forwards, views and Python numbers wrapped as tensors
    (`torch.where(mask, x, -1)`'s -1: neither launches anything) left out."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not INSIDE[0] and not func.is_view and func is not torch.ops.aten.scalar_tensor.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled configurations")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ["HF_SPECDEC_CALIBRATION"] = "off"
    timed_forwards()
    model = tiny_model()
    phrase = torch.randint(2, 512, (args.rows, 7), generator=torch.Generator().manual_seed(1))
    input_ids = phrase.repeat(1, 10)[:, :64]
    configs = [("plain generate", {}, None)]
    for compiled in ((False, True) if not args.no_compile else (False,)):
        for name, kwargs in (("off", {"speculator": "off"}), ("ngram", {"speculator": "ngram"}),
                             ("ngram, 4 drafts every step", {"speculator": "ngram", "num_speculative_tokens": 4,
                                                             "speculative_schedule": "constant"})):
            configs.append((f"hf_specdec {name}" + (" compiled" if compiled else ""), kwargs,
                            "1" if compiled else "0"))
    print(f"{args.rows} rows, {args.max_new_tokens} new tokens, 1 thread; ms per step = call time / target forwards")
    print("| configuration | call ms | steps | ms per step | ms per step outside the forward | ops outside the forward "
          "per step | ms per token of a row |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, kwargs, compile_switch in configs:
        if compile_switch is not None:
            os.environ["HF_SPECDEC_COMPILE"] = compile_switch

        def call(kwargs=kwargs):
            FORWARD_S[0] = 0.0
            start = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                     return_dict_in_generate=True, **kwargs)
            metrics = getattr(out, "speculative_metrics", None)
            seconds = time.perf_counter() - start
            steps = metrics.num_steps if metrics is not None else args.max_new_tokens
            return seconds, steps, seconds - FORWARD_S[0] if metrics is not None else None

        call()  # warm-up (and, compiled, the compile)
        samples = [call() for _ in range(args.repeats)]
        seconds, steps = statistics.median(s[0] for s in samples), samples[0][1]
        outside = ops = "-"
        if samples[0][2] is not None:
            outside = f"{1000 * statistics.median(s[2] for s in samples) / steps:.2f}"
            with OpsOutside() as counted:
                call()
            ops = f"{counted.count / steps:.0f}"
        print(f"| {name} | {1000 * seconds:.1f} | {steps} | {1000 * seconds / steps:.2f} | {outside} | {ops} | "
              f"{1000 * seconds / args.max_new_tokens:.2f} |", flush=True)


if __name__ == "__main__":
    main()
