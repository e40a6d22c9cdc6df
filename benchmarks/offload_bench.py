"""SmolLM2-135M-Instruct with most of its layers offloaded to disk (accelerate): plain `generate` against n-gram on
the grounded prompts and against the shipped EAGLE head on open chat, in one run, batch 1, greedy.

The embedded model loads from GGUF, which `save_pretrained` cannot write back, so its weights are written out by
accelerate itself: `dispatch_model(model, device_map, offload_dir=...)` stores every module mapped to "disk" in
`offload_dir` (one memory-mapped file per tensor) and leaves it on the `meta` device; each forward then streams
those weights back in, as for a model loaded with `device_map=..., offload_folder=...`.

    python benchmarks/offload_bench.py --disk-layers 24 --max-new-tokens 64 --repeats 3 [--model NAME] [--threads N]

`--model` another model with an EAGLE head shipped for it (`hf_specdec.models.trained_head`), Llama-like layer names.

Prints a table (tokens/s per prompt, speedup of the median) and writes bench_offload.json. Every speculative output
is checked against plain `generate`'s (token for token). Per prompt it also gives the speedup's ceiling: tokens per
target forward when every step drafts k (`speculative_schedule="constant"`), which bounds the speedup even where a
verify costs no more than a plain step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import _common  # benchmarks/, this script's folder
import torch
from accelerate import dispatch_model

import hf_specdec
from hf_specdec.costs.calibration import calibrate, describe
from hf_specdec.models import trained_head


def offload(model, disk_layers: int, folder: str):
    """Keeps the embeddings (tied to the head), the first layers, the norm and the head in memory; the last
    `disk_layers` decoder layers go to disk."""
    layers = model.config.num_hidden_layers
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" if i >= layers - disk_layers else "cpu" for i in range(layers)})
    return dispatch_model(model, device_map=device_map, offload_dir=folder), device_map


def timed(model, inputs, max_new_tokens, **kwargs):
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True,
                         **kwargs)
    return out, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--disk-layers", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-k", type=int, default=8, help="num_speculative_tokens (most drafts per step)")
    parser.add_argument("--calibrate", action="store_true", help="measure the offloaded model's step cost first "
                        "(cached per placement; `hf-specdec calibrate` does the same for an in-memory model)")
    parser.add_argument("--out", default="bench_offload.json")
    _common.add_model_args(parser, threads=None, options=("model", "dtype", "threads"))  # on the CPU and the disk
    args = parser.parse_args()

    model, tokenizer = _common.load(args)
    folder = tempfile.mkdtemp(prefix="hf_specdec_offload_")
    model, device_map = offload(model, args.disk_layers, folder)
    on_disk = sum(p.numel() for p in model.parameters() if p.device.type == "meta")
    print(f"{args.disk_layers} of {model.config.num_hidden_layers} layers on disk ({on_disk / 1e6:.1f}M of "
          f"{model.num_parameters() / 1e6:.1f}M parameters) in {folder}")
    eagle = hf_specdec.EagleSpeculator.from_pretrained(trained_head(args.model))
    if args.calibrate:
        profile = calibrate(model, speculators=[eagle], progress=print)
        print(describe(profile))
    one = _common.chat_batch(tokenizer, ["Hi"])
    probe = {}
    with torch.no_grad():  # what a forward of 1 and of 9 tokens costs at this placement
        for q in (1, 9):
            ids = one["input_ids"][:, :1].repeat(1, q)
            model(ids)
            start = time.perf_counter()
            for _ in range(3):
                model(ids)
            probe[q] = 1000 * (time.perf_counter() - start) / 3
    print(f"one forward (no cache): 1 token {probe[1]:.0f} ms, 9 tokens {probe[9]:.0f} ms")

    rows = []
    for workload, name, speculator in (("grounded", "ngram", "ngram"), ("open_chat", "eagle", eagle)):
        for key, prompt in _common.WORKLOADS[workload].items():
            inputs = _common.chat_batch(tokenizer, [prompt])
            plain_times, spec_times, metrics = [], [], None
            timed(model, inputs, 4)  # warm-up: the prompt's first forward, the page cache of the offloaded files
            timed(model, inputs, 4, speculator=speculator, num_speculative_tokens=args.k)
            for _ in range(args.repeats):
                plain, seconds = timed(model, inputs, args.max_new_tokens)
                plain_times.append(seconds)
                out, seconds = timed(model, inputs, args.max_new_tokens, speculator=speculator,
                                     num_speculative_tokens=args.k)
                spec_times.append(seconds)
                metrics = out.speculative_metrics
                assert torch.equal(out.sequences, plain.sequences), f"{key}: output differs from plain generate"
            # The ceiling: target forwards when every step drafts k (greedy, so the same output): even with a verify
            # as cheap as a plain step, the speedup is at most tokens per forward.
            ceiling = timed(model, inputs, args.max_new_tokens, speculator=speculator, num_speculative_tokens=args.k,
                            speculative_schedule="constant")[0].speculative_metrics
            tokens = plain.sequences.shape[1] - inputs["input_ids"].shape[1]
            rows.append({"workload": workload, "prompt": key, "speculator": name, "new_tokens": tokens,
                         "plain_tok_s": tokens / statistics.median(plain_times),
                         "spec_tok_s": tokens / statistics.median(spec_times),
                         "speedup": statistics.median(plain_times) / statistics.median(spec_times),
                         "mean_acceptance_length": metrics.mean_acceptance_length,
                         "mean_k": statistics.mean(metrics.k_per_step) if metrics.k_per_step else 0.0,
                         "tokens_per_forward": metrics.num_emitted_tokens / metrics.num_steps,
                         "ceiling_tokens_per_forward": ceiling.num_emitted_tokens / ceiling.num_steps,
                         "identical": True})
            r = rows[-1]
            print(f"{workload:9} {key:17} {name:5} plain {r['plain_tok_s']:5.2f} tok/s  {name} "
                  f"{r['spec_tok_s']:5.2f} tok/s  {r['speedup']:.2f}x  acceptance length "
                  f"{r['mean_acceptance_length']:.2f}  mean k {r['mean_k']:.1f}  tokens per forward "
                  f"{r['tokens_per_forward']:.2f} (drafting {args.k} every step: {r['ceiling_tokens_per_forward']:.2f})",
                  flush=True)
    for workload in ("grounded", "open_chat"):
        speedups = [r["speedup"] for r in rows if r["workload"] == workload]
        print(f"{workload}: median speedup {statistics.median(speedups):.2f}x over {len(speedups)} prompts")
    meta = {"model": args.model, "dtype": args.dtype, "disk_layers": args.disk_layers, "device_map": device_map,
            "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "k": args.k, "calibrated": args.calibrate, "forward_ms": probe,
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
