"""`hf-specdec`: the command line. `run` is the main job; `generate` streams one prompt; `demo` serves the app."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from dataclasses import asdict

import torch

from .costs.calibration import calibrate, describe
from .costs.profile import load_profile, profile_path
from .demo import launch
from .demo.app import add_arguments as add_demo_arguments
from .models import DEFAULT_MODEL, load_model, parse_dtype
from .quantization import QUANTIZATIONS
from .serving import ServingEngine
from .serving.server import serve
from .speculators.convert_eagle import convert_eagle
from .speculators.convert_head import convert_head
from .speculators.resolve import resolve_speculator
from .tools.bench import environment, run_bench, save, table
from .tools.serve_bench import add_arguments as add_serve_bench_arguments
from .tools.shape_bench import run_shape_bench, shape_table
from .tools.shapes import SHAPES
from .tools.speculator_args import (
    grammar_from_args,
    quantizations_for,
    run_speculators,
    speculator_from_spec,
    tree_shapes,
)
from .train_eagle import add_arguments as add_train_eagle_arguments
from .train_eagle import cmd_train_eagle
from .workloads import GROUNDED, OPEN_CHAT, chat_inputs


def _first_call_measuring(args) -> None:
    """`--no-calibrate`: the command's calls measure nothing and use the static default costs (as with
    `HF_SPECDEC_CALIBRATION=off`); otherwise the first call on this host, model, dtype and thread count measures a
    profile before its first step and caches it."""
    if getattr(args, "no_calibrate", False):
        os.environ["HF_SPECDEC_CALIBRATION"] = "off"


def cmd_calibrate(args) -> int:
    """Measures and caches this host's step cost, small-row linear form and draft costs for a model."""

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=args.device)
    speculators = {}
    for name in filter(None, args.speculators.split(",")):
        for quantization in quantizations_for(args.draft_quantization) if name not in ("ngram", "eagle") else [None]:
            speculators[name, quantization] = speculator_from_spec(name, model, tokenizer, quantization, model_name=args.model)
    profile = calibrate(model, [resolve_speculator(s) for s in speculators.values() if not isinstance(s, str)],
                        force=args.force, progress=lambda message: print(f"hf_specdec calibrate: {message}",
                                                                           file=sys.stderr))
    print(f"hf_specdec calibrate: profile {profile_path(model)}" if profile is not None else
          "hf_specdec calibrate: no profile cached (see above); the static default costs apply", file=sys.stderr)
    print(describe(load_profile(model)))
    return 0


def cmd_run(args) -> int:
    """Speculative generation on the embedded default model, timed against plain generate in the same run: each
    speculator on a grounded and an open-chat prompt (or on `--prompt`), and which one is best on each."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=args.device)
    speculators = run_speculators(args, model, tokenizer)
    _first_call_measuring(args)
    tree = {}
    if args.tree:
        if not any(getattr(s, "supports_trees", False) for s in speculators.values()):
            raise SystemExit(f"--tree needs an EAGLE head ('eagle' or a head directory) in --speculator; "
                             f"{args.speculator!r} drafts chains only (drop --tree)")
        shapes = tree_shapes(args.tree, "--tree")
        if len(shapes) != 1:
            raise SystemExit(f"--tree {args.tree!r}: give one shape NODESxBRANCHING, e.g. 16x4")
        (nodes, branching), = shapes
        tree = dict(speculative_tree_nodes=nodes, speculative_tree_branching=branching)
    prompts = {"your prompt": args.prompt} if args.prompt else {
        "grounded prompt (repeat a report, then summarise it)": GROUNDED["repeat_summarise"],
        "open-chat prompt (a short story)": OPEN_CHAT["story"]}
    options = {"off": dict(speculator="off")} | {
        name: dict(speculator=spec, num_speculative_tokens=args.k, **(tree if getattr(spec, "supports_trees", False)
                                                                       else {}))
        for name, spec in speculators.items() if spec != "off"}

    def timed(inputs, **kwargs):
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
        return time.perf_counter() - start, out

    best = {}
    for title, prompt in prompts.items():
        inputs = chat_inputs(tokenizer, [prompt]).to(model.device)
        model.generate(**inputs, max_new_tokens=8, do_sample=False)  # warm-up, every path
        for name, kwargs in options.items():
            start = time.perf_counter()
            metrics = model.generate(**inputs, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                                     **kwargs).speculative_metrics
            if metrics.measure_time_s > 0.5:  # the first call on this host, model, dtype and thread count
                print(f"hf_specdec: the first {name} call measured this host's costs in {metrics.measure_time_s:.1f} "
                      f"s (cached; the call took {time.perf_counter() - start:.1f} s in all)", file=sys.stderr)
        times = {name: [] for name in ["plain", *options]}
        outputs = {}
        for _ in range(args.repeats):  # interleaved, so every path sees the same machine load
            t, plain = timed(inputs)
            times["plain"].append(t)
            for name, kwargs in options.items():
                t, outputs[name] = timed(inputs, return_dict_in_generate=True, **kwargs)
                times[name].append(t)
        new_tokens = plain.shape[1] - inputs["input_ids"].shape[1]
        plain_tps = new_tokens / statistics.median(times["plain"])
        print(f"=== {title}")
        print(tokenizer.decode(plain[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
        print("-" * 80)
        print(f"model {args.model}, {new_tokens} new tokens, median of {args.repeats}")
        print(f"plain generate:       {plain_tps:6.1f} tokens/s")
        speedups = {}
        off_tps = None
        for name, out in outputs.items():
            tokens = out.sequences.shape[1] - inputs["input_ids"].shape[1]
            spec_tps = tokens / statistics.median(times[name])
            metrics = out.speculative_metrics
            if name == "off":
                off_tps = spec_tps
                print(f"hf_specdec, speculation off: {spec_tps:6.1f} tokens/s   the engine's own gain "
                      f"{spec_tps / plain_tps:.2f}x plain")
                print(f"  output identical to plain greedy generate: {torch.equal(out.sequences, plain)}")
                continue
            speedups[name] = spec_tps / plain_tps
            shape = f", tree {args.tree}" if "speculative_tree_nodes" in options[name] else ""
            print(f"speculator {name}, k={args.k}{shape}: {spec_tps:6.1f} tokens/s   speedup {speedups[name]:.2f}x "
                  f"plain = engine {off_tps / plain_tps:.2f}x x speculation {spec_tps / off_tps:.2f}x")
            print(f"  output identical to plain greedy generate: {torch.equal(out.sequences, plain)}")
            print(f"  acceptance rate {metrics.acceptance_rate:.3f}, mean acceptance length "
                  f"{metrics.mean_acceptance_length:.2f}, target forwards {metrics.num_steps} for {tokens} tokens")
        if not speedups:
            continue
        fastest = max(speedups, key=speedups.get)
        best[title] = f"{fastest} ({speedups[fastest]:.2f}x)"
        print()
    if len(speculators) > 1:
        print("best speculator: " + "; ".join(f"{title.split(' (')[0]}: {name}" for title, name in best.items()))
    return 0


def cmd_generate(args) -> int:
    """Streams one prompt's speculative generation, then prints the metrics line."""
    from transformers import TextStreamer

    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=args.device)
    inputs = chat_inputs(tokenizer, [args.prompt]).to(model.device)
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k) \
        if args.sample else dict(do_sample=False)
    grammar = grammar_from_args(args)
    if args.speculator == "grammar" and grammar is None:
        raise SystemExit("--speculator grammar drafts the tokens a grammar forces: give --json-schema, --json, "
                         "--regex or --grammar")
    if grammar is not None:
        try:  # refuse an invalid schema, regex or grammar before loading anything else
            eos = model.generation_config.eos_token_id
            grammar.compile(tokenizer, model.config.get_text_config().vocab_size,
                            None if eos is None else [eos] if isinstance(eos, int) else list(eos))
        except ValueError as error:
            raise SystemExit(f"hf-specdec generate: {error}") from None
        sampling.update(grammar=grammar, tokenizer=tokenizer)
    speculator = speculator_from_spec(args.speculator, model, tokenizer, quantizations_for(args.draft_quantization)[0],
                             model_name=args.model)
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, speculator=speculator,
                         num_speculative_tokens=args.k, return_dict_in_generate=True,
                         streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True), **sampling)
    elapsed = time.perf_counter() - start
    m = out.speculative_metrics
    print(f"\n[acceptance rate {m.acceptance_rate:.3f}, mean acceptance length {m.mean_acceptance_length:.2f}, "
          f"{m.num_emitted_tokens / elapsed:.1f} tokens/s]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    """Plain generate vs transformers' assisted generation vs hf_specdec, on built-in workloads."""

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.shape:
        return _bench_shape(args)
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=args.device)
    speculators = {}
    for name in args.speculators.split(","):
        for quantization in quantizations_for(args.draft_quantization) if name not in ("ngram", "eagle") else [None]:
            label = name if quantization is None else f"{name} [{quantization}]"
            speculators[label] = speculator_from_spec(name, model, tokenizer, quantization, model_name=args.model)
    trees = tree_shapes(args.trees)
    if trees and not any(getattr(s, "supports_trees", False) for s in speculators.values()):
        raise SystemExit("--trees needs a speculator that drafts trees (an EAGLE head directory in --speculators)")
    _first_call_measuring(args)
    meta = {"model": args.model, "speculators": list(speculators), "k": args.k, "trees": args.trees,
            "tree_depth": args.tree_depth, "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats, "schedule": args.schedule, "command": "hf-specdec bench " + " ".join(sys.argv[2:]),
            **environment()}
    results = run_bench(model, tokenizer, speculators, [int(b) for b in args.batch_sizes.split(",")],
                        args.workloads.split(","), args.max_new_tokens, args.k, args.repeats,
                        schedule=args.schedule, assisted=not args.no_assisted, trees=trees,
                        tree_depth=args.tree_depth, uncalibrated=args.compare_calibration,
                        padded=args.compare_layout,
                        on_group=lambda so_far: save(so_far, args.out, None, {**meta, "partial": True}),
                        static=True if args.static_baseline else None, compare_compile=args.compare_compile)
    save(results, args.out, args.plot, meta)
    print(table(results))
    print(f"\nwrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _bench_shape(args) -> int:
    """`bench --shape NAME`: a random-init model of a published shape, synthetic drafts at set acceptance lengths."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = run_shape_bench(args.shape, device, parse_dtype(args.dtype) or torch.bfloat16,
                              [int(b) for b in args.batch_sizes.split(",")],
                              [float(x) for x in args.acceptance_lengths.split(",")], args.k,
                              max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    meta = {"shape": args.shape, "command": "hf-specdec bench " + " ".join(sys.argv[2:]), **environment()}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=2)
    print(shape_table(results))
    print(f"\nwrote {args.out}")
    return 0


def cmd_serve(args) -> int:
    """Serves the model behind an OpenAI-compatible API with speculative decoding and continuous batching."""
    if not all(importlib.util.find_spec(name) for name in ("fastapi", "uvicorn")):
        raise SystemExit("hf-specdec serve needs the serve extra: pip install 'hf_specdec[serve]'")

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=parse_dtype(args.dtype), device=args.device)
    speculator = speculator_from_spec(args.speculator, model, tokenizer, model_name=args.model)
    _first_call_measuring(args)
    engine = ServingEngine(model, tokenizer, speculator, num_speculative_tokens=args.k,
                           max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                           max_model_len=args.max_model_len, schedule=args.schedule,
                           calibration=not args.no_calibrate, kv_region_tokens=args.kv_region_tokens,
                           prefix_cache_tokens=args.prefix_cache_tokens, warmup=args.warm_up,
                           prefill_chunk_tokens=args.prefill_chunk_tokens)
    name = args.served_model_name or args.model
    print(f"hf-specdec serve: {name} with speculator {args.speculator!r} on http://{args.host}:{args.port}/v1",
          file=sys.stderr)
    serve(engine, name, host=args.host, port=args.port, api_key=args.api_key, log_level=args.log_level)
    return 0


def cmd_demo(args) -> int:
    """Serves the Gradio demo app (plain vs speculative generation, side by side)."""

    return launch(args)


def cmd_convert_eagle(args) -> int:
    """Converts a published EAGLE-1/2 or EAGLE-3 head into hf_specdec's format."""

    aux_layers = [int(i) for i in args.aux_layers.split(",")] if args.aux_layers else None
    dtype = getattr(torch, args.dtype) if args.dtype else None
    dst = convert_eagle(args.src, args.dst, target=args.target, aux_layers=aux_layers,
                        aux_layer_convention=args.aux_layer_convention, dtype=dtype)
    print(f"wrote {dst}; use it with EagleSpeculator.from_pretrained({str(dst)!r}) or --speculator {dst}")
    return 0


def cmd_convert_head(args) -> int:
    """Converts a published EAGLE head, MLP speculator or Medusa heads into hf_specdec's format (layout detected)."""

    options = {}
    if args.aux_layers:
        options = dict(aux_layers=[int(i) for i in args.aux_layers.split(",")],
                       aux_layer_convention=args.aux_layer_convention)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    dst = convert_head(args.src, args.dst, target=args.target, dtype=dtype, **options)
    print(f"wrote {dst}; use it with --speculator {dst} or the pipeline's assistant={str(dst)!r}")
    return 0


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name, hub id or path")
    parser.add_argument("--device", default=None, help="where to run the model, e.g. cuda (default: cpu)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="model dtype (default: float32 for the embedded models, else the checkpoint's)")


def _add_convert_arguments(parser, files: str, eagle3: str) -> None:
    parser.add_argument("src", help=f"the head: a directory or hub id ({files})")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--target", required=True, help="the target model (hub id or path) the head was trained for")
    parser.add_argument("--aux-layers", default=None, help=f"{eagle3}: comma-separated target layers fc reads "
                        "(default: the head config's, else 2,L//2,L-3)")
    parser.add_argument("--aux-layer-convention", default="input", choices=["input", "output"],
                        help=f"{eagle3}: the ids name each layer's input (vLLM, EAGLE) or output (SGLang)")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                        help="cast the weights (default: keep the checkpoint's)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-specdec", description="Speculative decoding for transformers models.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="speculative generation on the default model, with speedup and acceptance")
    _add_model_arguments(run)
    run.add_argument("--speculator", default="auto", help="'auto' (n-gram and, where one ships for --model, the "
                     "trained EAGLE head and the two combined, side by side), 'ngram', 'eagle', 'ngram+eagle' (lookup "
                     "where the text repeats, the head elsewhere), an EAGLE head directory, 'ngram+HEAD_DIR' or a "
                     "draft model (name, id or path)")
    run.add_argument("-k", type=int, default=10, help="num_speculative_tokens")
    run.add_argument("--max-new-tokens", type=int, default=128)
    run.add_argument("--repeats", type=int, default=3, help="timed repeats; medians are reported")
    run.add_argument("--prompt", default=None, help="user prompt (default: a repeat-then-summarise task)")
    run.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    run.add_argument("--tree", default=None, metavar="NODESxBRANCHING",
                     help="draft trees of this shape (EAGLE heads), -k deep, e.g. 16x4")
    run.add_argument("--no-calibrate", action="store_true", help="measure nothing and use the static default costs "
                     "(HF_SPECDEC_CALIBRATION=off)")
    run.set_defaults(func=cmd_run)

    bench = sub.add_parser("bench", help="benchmark plain, transformers-assisted and hf_specdec generation")
    _add_model_arguments(bench)
    bench.add_argument("--speculators", default="ngram", help="comma-separated: 'ngram', 'eagle' (the trained head "
                       "shipped for --model), EAGLE head directories, 'ngram+eagle' or 'ngram+HEAD_DIR' (lookup where "
                       "the text repeats, the head elsewhere) and/or draft models")
    bench.add_argument("--batch-sizes", default="1,4,16")
    bench.add_argument("--shape", default=None, choices=sorted(SHAPES), help="instead of --model: a random-init "
                       "model of this published shape on --device (bfloat16 unless --dtype), synthetic drafts at "
                       "--acceptance-lengths with -k drafts (free, and priced by the shape's draft model), against "
                       "plain generate eager and with its static cache")
    bench.add_argument("--acceptance-lengths", default="2,3,4", help="with --shape: mean acceptance lengths")
    bench.add_argument("--static-baseline", action="store_true", help="also time plain generate with a static cache "
                       "(always on CUDA, where transformers compiles it)")
    bench.add_argument("--workloads", default="grounded,open_chat", help="comma-separated: grounded, open_chat, json "
                       "(extraction under a JSON schema per request; plain generate runs with xgrammar's processor)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("-k", type=int, default=10, help="num_speculative_tokens (the most per step)")
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats; medians are reported")
    bench.add_argument("--out", default="bench.json", help="JSON results file")
    bench.add_argument("--plot", default="bench.png", help="PNG plot of speedups ('' for none)")
    bench.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    bench.add_argument("--draft-quantization", default="none", help="comma-separated, a benchmark dimension for "
                       f"draft models: 'none' and/or {', '.join(QUANTIZATIONS)}")
    bench.add_argument("--schedule", default="adaptive", choices=["adaptive", "constant"],
                       help="speculative_schedule: choose k per step, or always draft k")
    bench.add_argument("--no-assisted", action="store_true", help="leave out transformers' own assisted generation")
    bench.add_argument("--trees", default="", help="draft-tree shapes NODESxBRANCHING, comma-separated (e.g. "
                       "16x4,32x4): each also runs with every speculator that drafts trees (EAGLE heads)")
    bench.add_argument("--tree-depth", type=int, default=5, help="num_speculative_tokens (the depth) of --trees runs")
    bench.add_argument("--no-calibrate", action="store_true", help="measure nothing and use the static default costs "
                     "(HF_SPECDEC_CALIBRATION=off)")
    bench.add_argument("--compare-calibration", action="store_true", help="also run each hf_specdec configuration "
                       "with speculative_calibration=False (static default costs, stock linear layers)")
    bench.add_argument("--compare-layout", action="store_true", help="also run each hf_specdec configuration with "
                       "every step padded to its widest row (HF_SPECDEC_PACKED=0) instead of packed")
    bench.add_argument("--compare-compile", action="store_true", help="also run speculation off and each speculator "
                       "with compiled steps on a CPU (eager on CUDA, where compiled is the default)")
    bench.set_defaults(func=cmd_bench)

    gen = sub.add_parser("generate", help="stream one prompt's speculative generation")
    gen.add_argument("prompt")
    _add_model_arguments(gen)
    gen.add_argument("--speculator", default="ngram", help="'ngram', 'grammar' (only the tokens a --json-schema/"
                     "--regex/--grammar forces), 'eagle' (the trained head shipped for --model), "
                     "an EAGLE head directory, 'ngram+eagle' or 'ngram+HEAD_DIR' (lookup where the text repeats, the "
                     "head elsewhere) or a draft model (name, id or path)")
    gen.add_argument("-k", type=int, default=5, help="num_speculative_tokens")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--draft-quantization", default="none", choices=["none", *QUANTIZATIONS],
                     help="quantize the draft model as it loads (see hf_specdec.load_draft)")
    structured = gen.add_argument_group("structured output (needs the structured extra; see docs/structured.md)")
    structured.add_argument("--json-schema", metavar="FILE", help="the output is JSON following this JSON schema")
    structured.add_argument("--json", action="store_true", help="the output is any JSON value")
    structured.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    structured.add_argument("--grammar", metavar="FILE", help="the output follows this EBNF grammar (root rule: root)")
    gen.set_defaults(func=cmd_generate)

    cal = sub.add_parser("calibrate", help="measure and cache this host's costs for a model (adaptive k, drafts, "
                         "linear layers); run, bench and the demo do it at start")
    _add_model_arguments(cal)
    cal.add_argument("--speculators", default="", help="comma-separated draft models or heads whose draft cost to "
                     "measure too: 'eagle', 'ngram+eagle', head directories, draft models")
    cal.add_argument("--draft-quantization", default="none", help="comma-separated: 'none' and/or "
                     f"{', '.join(QUANTIZATIONS)} (draft models)")
    cal.add_argument("--threads", type=int, default=None, help="torch CPU threads (part of the profile's key)")
    cal.add_argument("--force", action="store_true", help="measure again even where a profile is cached")
    cal.set_defaults(func=cmd_calibrate)

    convert = sub.add_parser("convert-eagle", help="convert a published EAGLE-1/2 or EAGLE-3 head (see docs/eagle.md)")
    _add_convert_arguments(convert, "model.safetensors or pytorch_model.bin", "EAGLE-3")
    convert.set_defaults(func=cmd_convert_eagle)

    head = sub.add_parser("convert-head", help="convert a published draft head, layout detected: EAGLE, MLP "
                          "speculator (ibm-fms accelerator) or Medusa (see docs/eagle.md)")
    _add_convert_arguments(head, "*.safetensors, pytorch_model.bin or *.pt", "EAGLE-3 only")
    head.set_defaults(func=cmd_convert_head)

    train = sub.add_parser("train-eagle", help="train an EAGLE head for a target on its own generations "
                           "(see docs/eagle.md)")
    add_train_eagle_arguments(train)
    train.set_defaults(func=cmd_train_eagle)

    srv = sub.add_parser("serve", help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions) with "
                         "speculative decoding and continuous batching")
    _add_model_arguments(srv)
    srv.add_argument("--speculator", default="ngram",
                     help="'ngram', 'grammar', 'eagle' (the head shipped for --model), a head directory or a draft "
                     "model (default: ngram)")
    srv.add_argument("-k", type=int, default=None, help="num_speculative_tokens, the most drafts per step")
    srv.add_argument("--schedule", choices=["adaptive", "constant"], default="adaptive")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1 (default: $HF_SPECDEC_API_KEY, else none)")
    srv.add_argument("--max-batch-size", type=int, default=8, help="requests running at once")
    srv.add_argument("--max-queue", type=int, default=64, help="requests waiting at most; beyond, 503")
    srv.add_argument("--max-model-len", type=int, default=None, help="prompt + max_tokens limit (default: the "
                     "model's context)")
    srv.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    srv.add_argument("--kv-region-tokens", type=int, default=None,
                     help="KV room each slot holds from the start, in one region of the pool: on the PyTorch path "
                     "rows in consecutive slots are then read in place instead of gathered each step (memory: "
                     "--max-batch-size x this many tokens; 0 for none; default 1024)")
    srv.add_argument("--prefix-cache-tokens", type=int, default=None,
                     help="prompt tokens whose keys and values are kept after their requests end, so that a request "
                     "starting with a stored prefix (whole KV blocks) feeds only the rest; least recently used go "
                     "first (default 8192; 0 for none)")
    srv.add_argument("--prefill-chunk-tokens", type=int, default=None,
                     help="feed a longer prompt this many tokens a step (chunked prefill), so running requests keep "
                     "streaming while it is read (default 256 on a CPU, 2048 on a GPU; 0: whole prompts)")
    srv.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                     help="run a few synthetic requests before serving, so kernels compile then and not inside the "
                     "first clients' requests (default: on for CUDA; elsewhere one short request, which allocates the "
                     "KV pools before serving; --no-warm-up: none)")
    srv.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    srv.add_argument("--no-calibrate", action="store_true", help="measure nothing and use the static default costs "
                     "(HF_SPECDEC_CALIBRATION=off)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    srv.set_defaults(func=cmd_serve)

    sbench = sub.add_parser("bench-serve", help="requests arriving at a fixed rate: hf-specdec serve (each "
                            "speculator, and speculation off) vs transformers' continuous batching")
    _add_model_arguments(sbench)
    add_serve_bench_arguments(sbench)
    demo = sub.add_parser("demo", help="serve the demo app: plain vs speculative generation, side by side")
    add_demo_arguments(demo)
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
