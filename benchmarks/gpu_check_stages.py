"""The stages of `gpu_check.py` after the install: each takes a `Context`, returns what it measured as a dict, and
raises `StageError` (or anything else) when it fails. On a GPU they run the embedded SmolLM2 model in bfloat16; in a
dry run, tiny random-init models on the CPU, so the same code paths run in CI in seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
EMBEDDED = "smollm2-135m-instruct"
BATCH_SIZES = "1,4,16,64"
# The kernels' targets (docs/kernels.md): rejection sampling at 60% or more of copy bandwidth and faster than the
# reference; attention at least as fast as SDPA over contiguous KV; the sampling warpers faster than the reference.
MIN_FRACTION_OF_COPY = 0.6
EAGLE_CONFIG_NAME = "eagle_config.json"  # hf_specdec.speculators.heads.CONFIG_NAME, read before hf_specdec imports


class StageError(RuntimeError):
    """A stage ran but what it checks failed; the message says what, `partial` holds what it measured before."""

    def __init__(self, message: str, partial: dict | None = None):
        super().__init__(message)
        self.partial = partial


@dataclass
class Context:
    out: Path  # what comes back: the JSON, the Markdown, the bench plot
    work: Path  # scratch: test reports, training sets, bench JSON
    dry_run: bool

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def target(self) -> str:
        """The target model: the embedded SmolLM2, or a tiny random-init model saved in `work`."""
        return str(tiny_models(self.work)[0]) if self.dry_run else EMBEDDED

    def draft(self) -> str:
        """The draft model for the quantized-draft runs: the target itself (SmolLM2 against its own quantized
        copies, as docs/benchmarks.md, "Quantized drafts"), or a second tiny model."""
        return str(tiny_models(self.work)[1]) if self.dry_run else EMBEDDED


# --- 1. tests ---------------------------------------------------------------------------------------------------------
def run_tests(ctx: Context) -> dict:
    """The suite's GPU tests (`-m gpu`) and the kernel tests, compiled on a GPU (TRITON_INTERPRET unset). A dry run
    runs the GPU tests of tests/test_gpu_check.py (they skip on a CPU) and the kernel tests' hand-written cases under
    the interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_SPECDEC_KERNEL_BACKEND")}
    if ctx.dry_run:
        env["TRITON_INTERPRET"] = "1"
        runs = {"gpu": ["-m", "gpu", "tests/test_gpu_check.py"],
                "kernels": ["tests/test_kernels.py", "-k", "greedy_cases"]}
    else:
        marked = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                        if "pytest.mark.gpu" in p.read_text())
        runs = {"gpu": ["-m", "gpu", *marked], "kernels": ["tests/test_kernels.py"]}
    procs = {}
    for name, args in runs.items():  # the two runs at once: on a GPU they share it, on a CPU its cores
        report = ctx.work / f"tests_{name}.xml"
        report.unlink(missing_ok=True)  # a report left by an earlier run must not stand in for this one
        procs[name] = (args, report, subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results, failures = {}, []
    try:
        outputs = {name: proc.communicate()[0] for name, (_, _, proc) in procs.items()}
    finally:  # past the stage's budget: no pytest left running into the next stages
        for _, _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    for name, (args, report, proc) in procs.items():
        output = outputs[name]
        counts = junit_counts(report) if report.is_file() else {}
        results[name] = {"args": args, "exit_code": proc.returncode, **counts,
                         "output_tail": output.strip().splitlines()[-15:]}
        problem = judge_tests(proc.returncode, counts, allow_skips=ctx.dry_run)
        if problem:
            # Which tests and why, so the report alone says what to fix (the first GPU run's said only how many).
            failed = "; ".join(f"{t}: {m}" for t, m in counts.get("failed_tests", []))
            failures.append(f"pytest {' '.join(args)}: {problem}" + (f" [{failed}]" if failed else ""))
    if failures:
        raise StageError("; ".join(failures), partial=results)
    return results


def junit_counts(report: Path) -> dict:
    """Test counts from a JUnit XML report, with the reason of every skip."""
    root = ElementTree.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    counts["skip_reasons"] = sorted({s.get("message", "") for s in root.iter("skipped")})
    counts["failed_tests"] = [(case.get("name", "?"), _first_line(problem.get("message")) or problem.tag)
                              for case in root.iter("testcase") for problem in case
                              if problem.tag in ("failure", "error")]
    return counts


def _first_line(text: str | None, limit: int = 300) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0][:limit] if lines else ""


def judge_tests(exit_code: int, counts: dict, allow_skips: bool) -> str | None:
    """Why a pytest run failed the stage, or None: an error exit, no test run, or (on a GPU) any test skipped."""
    if not counts:
        return f"no report (exit code {exit_code})"
    ran = counts["tests"] - counts["skipped"]
    if counts["tests"] == 0:
        return "collected no test"
    if exit_code != 0 or counts["failures"] or counts["errors"]:
        return f"{counts['failures']} failed, {counts['errors']} errors (exit code {exit_code})"
    if ran == 0 and not allow_skips:
        return "every test skipped"
    if counts["skipped"] and not allow_skips:
        return f"{counts['skipped']} skipped on the GPU: {'; '.join(counts['skip_reasons'])}"
    return None


# --- 2. kernels -------------------------------------------------------------------------------------------------------
def run_kernels(ctx: Context) -> dict:
    """Each kernel's benchmark at the target shapes (tiny shapes in a dry run), with the target each must meet."""
    from hf_specdec.kernels._backend import interpreting
    from hf_specdec.kernels.bench import run

    if not ctx.dry_run and interpreting():
        raise StageError("TRITON_INTERPRET is set: the kernels would run interpreted, not compiled")
    rows = run(smoke=ctx.dry_run)
    for row in rows:
        row["target"], row["meets_target"] = kernel_target(row)
    import triton

    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)",
            "triton": triton.__version__, "torch": torch.__version__, "rows": rows,
            "below_target": [f"{r['op']} ({r['case']})" for r in rows if not r["meets_target"]]}


def kernel_target(row: dict) -> tuple[str, bool]:
    if row["op"] == "rejection_sample":
        return (f">= {MIN_FRACTION_OF_COPY:.0%} of copy bandwidth, faster than the reference",
                row["fraction_of_copy"] >= MIN_FRACTION_OF_COPY and row["speedup"] >= 1)
    if row["op"] == "paged_attention":
        return "at least as fast as SDPA on contiguous KV", row["speedup_vs_sdpa"] >= 1
    return "faster than the sorting reference", row["speedup"] >= 1


# --- 3. step cost -----------------------------------------------------------------------------------------------------
def run_step_cost(ctx: Context) -> dict:
    """`StepCost.measure` on the target, printed as the `DEFAULT_STEP_COST` entry it should replace."""
    from _common import load  # benchmarks/: imports hf_specdec, so only once the install has run

    from hf_specdec.costs.step_cost import DEFAULT_STEP_COST, StepCost

    if ctx.dry_run:
        model, _ = load(model=ctx.target(), dtype="float32")
        cost = StepCost.measure(model, rows=(1, 2), tokens=(1, 2, 4), contexts=(8,), repeats=1)
    else:
        model, _ = load(model=EMBEDDED, dtype="bfloat16", device="cuda")
        cost = StepCost.measure(model, rows=(1, 4, 16, 64))
    key = "cpu" if ctx.dry_run else "cuda"
    literal = step_cost_literal(key, cost)
    print(literal)
    compare = {}
    for rows in (1, 16, 64):
        for tokens in (2, 6, 11):
            n = torch.tensor(float(tokens))
            compare[f"{rows}x{tokens}"] = {"measured": round(float(cost.relative(rows, n)), 3),
                                           "default": round(float(DEFAULT_STEP_COST[key].relative(rows, n)), 3)}
    return {"model": ctx.target(), "literal": literal, "relative_to_a_decode_step": compare}


def step_cost_literal(key: str, cost) -> str:
    """The `DEFAULT_STEP_COST` entry for `cost`, as Python source."""
    points = ", ".join(f"({n:g}, {t:.4g})" for n, t in cost.points)
    return (f'"{key}": StepCost(per_row={cost.per_row:.4g}, per_context_token={cost.per_context_token:.4g}, '
            f"points=({points},)),")


# --- 4. train-eagle ---------------------------------------------------------------------------------------------------
def run_train(ctx: Context) -> dict:
    """A short `hf-specdec train-eagle` run (on a GPU, its accelerate path), timing the training loop alone."""
    import hf_specdec.train_eagle.cli as train_cli

    out = ctx.work / "head"
    if ctx.dry_run:  # two short prompts: the built-in ones are long, and this only checks that the path runs
        prompts = ctx.work / "prompts.txt"
        prompts.write_text("w5 w6 w7 w8 w5 w6\nw9 w10 w11 w9 w10\n")
        args = ["--data", str(prompts), "--max-new-tokens", "8", "--samples-per-prompt", "1",
                "--generation-batch-size", "2", "--steps", "3",
                "--batch-size", "2", "--draft-vocab", "64", "--save-every", "3"]
    else:
        args = ["--self-distill", "32", "--max-new-tokens", "64", "--generation-batch-size", "32", "--steps", "100",
                "--batch-size", "16", "--mixed-precision", "bf16", "--data-dtype", "bfloat16", "--save-every", "100"]
    timing = {}
    original = train_cli.train_eagle_head

    def timed(*a, **kw):  # the CLI times data building and training together; steps/s needs the loop alone
        start = time.perf_counter()
        result = original(*a, **kw)
        timing.update(seconds=time.perf_counter() - start, steps=len(result.losses), losses=result.losses)
        return result

    train_cli.train_eagle_head = timed
    try:
        cli(["train-eagle", "--target", ctx.target(), "--out", str(out), "--no-resume", "--rebuild-data", *args])
    finally:
        train_cli.train_eagle_head = original
    if not timing.get("steps"):
        raise StageError("train-eagle trained no step")
    if not (out / EAGLE_CONFIG_NAME).is_file():
        raise StageError(f"train-eagle wrote no head in {out}")
    return {"args": args, "accelerate": torch.cuda.is_available(), "steps": timing["steps"],
            "train_seconds": timing["seconds"], "steps_per_s": timing["steps"] / timing["seconds"],
            "loss_first": timing["losses"][0], "loss_last": timing["losses"][-1], "head": str(out)}


# --- 5. hf-specdec bench ----------------------------------------------------------------------------------------------
# A dry run's bench: one ragged batch of 2 (batch 1 runs every prompt alone, three times the calls), a few tokens,
# constant k so that every step drafts: the path, not speed.
DRY_BENCH = ["--batch-sizes", "2", "--max-new-tokens", "4", "--workloads", "grounded", "--no-calibrate", "--schedule",
             "constant", "-k", "2"]


def run_bench(ctx: Context) -> dict:
    """`hf-specdec bench --device cuda --dtype bfloat16` at batch 1, 4, 16 and 64: n-gram and the shipped head in
    one run, then an FP8 and an int8 draft, each in its own run so one that cannot load does not hide the others."""
    common = ["--device", ctx.device, "--repeats", "1"]
    if ctx.dry_run:
        head = ctx.work / "head"
        if not (head / EAGLE_CONFIG_NAME).is_file():
            raise StageError(f"the dry run benches the head the train stage writes, and {head} has none")
        common += ["--dtype", "float32", *DRY_BENCH]
        heads = f"ngram,{head}"
    else:
        common += ["--dtype", "bfloat16", "--batch-sizes", BATCH_SIZES, "--max-new-tokens", "128"]
        heads = "ngram,eagle"
    runs = {"ngram and head": ["--speculators", heads, "--plot", str(ctx.out / "bench.png")]}
    for quantization in ("fp8", "int8"):
        runs[f"{quantization} draft"] = ["--speculators", ctx.draft(), "--draft-quantization", quantization,
                                         "--no-assisted", "--workloads", "grounded", "--plot", ""]
        if not ctx.dry_run:  # batch 1 and 16 only: the first GPU run spent 189 s of the stage before these
            runs[f"{quantization} draft"] += ["--batch-sizes", "1,16"]
    results, failures = {}, []
    for name, args in runs.items():
        path = ctx.work / f"bench_{name.split()[0]}.json"
        path.unlink(missing_ok=True)  # a file left by an earlier run must not stand in for this one
        start = time.perf_counter()
        try:
            cli(["bench", "--model", ctx.target(), *common, *args, "--out", str(path)])
            results[name] = bench_rows(path)
            print(f"gpu_check: bench {name}: {time.perf_counter() - start:.1f} s", flush=True)
        except (Exception, SystemExit) as error:  # noqa: BLE001  (every failure is reported, none skipped)
            stopped = isinstance(error, TimeoutError)  # the stage's budget is spent: no further run may start
            failures.append(f"{name}: {error}" if stopped else f"{name}: {type(error).__name__}: {error}")
            if path.is_file():  # the bench saves after each workload and batch size: keep what it measured
                try:
                    results[f"{name} (stopped part-way)"] = bench_rows(path)
                except (StageError, ValueError, KeyError):
                    pass
            if stopped:
                break
    if failures:
        raise StageError("; ".join(failures), partial={"runs": results})
    return {"runs": results,
            "not_identical": [f"{n}: {r['workload']} batch {r['batch']} {r['config']}" for n, rows in results.items()
                              for r in rows if r["identical"] is False]}


def run_graphs(ctx: Context) -> dict:
    """Compiled (graphed) steps against eager ones (`runners/graphed.py`): `hf-specdec bench --compare-compile
    --static-baseline` in float32 (answers compared with plain greedy bit for bit) at batch 1 and 16, speculation off,
    n-gram and the shipped head, each graphed (the CUDA default) and eager, beside plain `generate` eager and with
    its static cache (which transformers compiles). The first call, timed apart, holds the compile and capture time;
    the CUDA memory the run reserved is reported. A dry run compiles on the CPU (`--compare-compile` there adds the
    compiled configurations)."""
    path = ctx.work / "bench_graphs.json"
    path.unlink(missing_ok=True)
    if ctx.dry_run:
        head = ctx.work / "head"
        heads = f"ngram,{head}" if (head / EAGLE_CONFIG_NAME).is_file() else "ngram"
        args = [*DRY_BENCH, "--speculators", heads]
    else:
        args = ["--batch-sizes", "1,16", "--max-new-tokens", "128", "--speculators", "ngram,eagle"]
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    cli(["bench", "--model", ctx.target(), "--device", ctx.device, "--dtype", "float32", "--repeats", "1",
         "--no-assisted", "--compare-compile", "--static-baseline", "--plot", "", *args, "--out", str(path)])
    rows = bench_rows(path)
    report = {"rows": rows, "seconds": round(time.perf_counter() - start, 1),
              "not_identical": [f"{r['workload']} batch {r['batch']} {r['config']}" for r in rows
                                if r["identical"] is False]}
    if not ctx.dry_run:
        report["cuda_reserved_gib"] = round(torch.cuda.memory_reserved() / 2**30, 2)
        report["cuda_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if report["not_identical"]:
        raise StageError(f"answers differ from plain greedy: {report['not_identical']}", partial=report)
    return report


# A shape shrunk to a few layers and widths for the dry run: the same code path on the CPU in seconds.
DRY_SHAPE = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512)


def run_shape(name: str):
    """A stage: `hf-specdec bench --shape NAME` on the GPU in bfloat16, batch 1, 8 and 32, synthetic drafts at mean
    acceptance lengths 2, 3 and 4 with k = 4 (free, and priced by the shape's draft model), against plain `generate`
    eager and with its static cache (compiled by transformers on CUDA). A dry run shrinks the shape."""
    def stage(ctx: Context) -> dict:
        from dataclasses import asdict

        from hf_specdec.tools.shape_bench import run_shape_bench, shape_table

        if ctx.dry_run:
            results = run_shape_bench(name, "cpu", torch.float32, batch_sizes=(2,), lengths=(3.0,), k=4,
                                      prompt_tokens=8, max_new_tokens=8, repeats=1, static=True, **DRY_SHAPE)
        else:
            results = run_shape_bench(name, "cuda", torch.bfloat16, batch_sizes=(1, 8, 32), lengths=(2.0, 3.0, 4.0),
                                      k=4, max_new_tokens=128, repeats=3)
        return {"rows": [asdict(r) for r in results], "table": shape_table(results)}
    return stage


def bench_rows(path: Path) -> list[dict]:
    import json

    results = json.loads(path.read_text())["results"]
    if not results:
        raise StageError(f"{path} holds no results")
    return [{"workload": r["workload"], "batch": r["batch_size"], "config": r["config"],
             "tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"], "acceptance": r["acceptance_rate"],
             "mean_acceptance_length": r["mean_acceptance_length"], "draft_ms_per_token": r["draft_ms_per_token"],
             "identical": r["identical"], "first_call_s": r.get("first_call_s"),
             "second_call_s": r.get("second_call_s"), "speedup_over_off": r.get("speedup_over_off"),
             "speedup_over_static": r.get("speedup_over_static")} for r in results]


# --- helpers ----------------------------------------------------------------------------------------------------------
def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise StageError(f"torch {torch.__version__} sees no CUDA device (run the install stage first, or --dry-run "
                         "on a CPU)")


def cli(argv: list[str]) -> None:
    """Runs `hf-specdec ARGV` in this process (the check's one import of torch and transformers), raising on a
    non-zero exit."""
    from hf_specdec.cli import main

    saved = sys.argv
    sys.argv = ["hf-specdec", *argv]  # bench records its command line from sys.argv
    try:
        code = main(argv)
    finally:
        sys.argv = saved
    if code:
        raise StageError(f"hf-specdec {' '.join(argv)} exited with {code}")


def tiny_models(work: Path) -> tuple[Path, Path]:
    """A tiny random-init Llama target (4 layers, so an EAGLE-3 head has three distinct layers to read) and a
    2-layer draft, float32, saved with a word-level tokenizer and a chat template; built once per `work`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    target_dir, draft_dir = work / "tiny-target", work / "tiny-draft"
    if (draft_dir / "config.json").is_file():
        return target_dir, draft_dir
    tokenizer = _tiny_tokenizer()
    for directory, layers, seed in ((target_dir, 4, 0), (draft_dir, 2, 1)):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2)
        model = LlamaForCausalLM(config).eval()
        model.generation_config.pad_token_id = 0
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return target_dir, draft_dir


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(4, 96)}
    backend = Tokenizer(models.WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **words}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>", padding_side="left")
    # English prompts become mostly <unk>: enough for a dry run, which checks that every path runs, not speed.
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


STAGES = {"tests": run_tests, "kernels": run_kernels, "step_cost": run_step_cost, "train": run_train,
          "bench": run_bench, "graphs": run_graphs, "shape_1b": run_shape("llama-3.2-1b"), "shape_8b": run_shape("llama-3.1-8b")}
