"""One command that checks the whole GPU path and writes one JSON file plus a short Markdown summary.

Stages, in order (each fails loudly: the run exits non-zero and names every failed stage; none is skipped):
  install    a CUDA build of torch and triton, transformers, gguf, torchao, bitsandbytes (gptqmodel if it installs),
             the embedded model, hf_specdec itself
  tests      `pytest -m gpu` over the suite's GPU tests, and tests/test_kernels.py with the Triton kernels compiled
  kernels    each kernel's benchmark against its reference and its target, with the GPU's name
  step_cost  `StepCost.measure` on the GPU, printed as the `DEFAULT_STEP_COST["cuda"]` entry to replace
  train      a short `hf-specdec train-eagle` (its accelerate path), reporting steps/s
  bench      `hf-specdec bench --device cuda --dtype bfloat16` at batch 1, 4, 16, 64: n-gram, the shipped head, an FP8
             and an int8 draft: speedup, acceptance, identical output
  graphs     compiled (graphed) steps against eager ones: `hf-specdec bench --compare-compile --static-baseline`,
             float32, batch 1 and 16, speculation off, n-gram and the head; identical output, first-call (compile and
             capture) time, CUDA memory
  shape_1b   `hf-specdec bench --shape llama-3.2-1b`: random-init Llama-3.2-1B, synthetic drafts at L = 2, 3, 4 (k = 4),
             batch 1, 8, 32, against plain generate eager and static-cache (compiled); fraction of the ideal speedup
  shape_8b   the same for Llama-3.1-8B, its drafts free and priced by a Llama-3.2-1B-shaped draft model
             (each shape stage is one device call: `--stages shape_1b`, then `--stages shape_8b`)

Usage (docs/benchmarks.md, "Running the GPU check" under "GPU runs", says how to run it through the device tool):
  python benchmarks/gpu_check.py --pack                       # where PyPI is reachable: the offline GPU machine's bundle
  python3 benchmarks/gpu_check.py --receive PART --no-check   # on the GPU machine, once per part
  python3 benchmarks/gpu_check.py --receive PART --out $OUT    # the last part, then the check
  python benchmarks/gpu_check.py --dry-run --out DIR          # every stage on tiny models on a CPU; installs nothing
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_bundle import BUNDLE_DIR, SERVE_PACKED, SERVE_PART_BYTES, install, pack, receive  # noqa: E402

STAGE_NAMES = ("install", "tests", "kernels", "step_cost", "train", "bench", "graphs", "shape_1b", "shape_8b")
# Seconds per stage, caps rather than plans: the first run (H200, 2026-11-26, results/gpu_h200) took install 39, tests
# 65, kernels 14, step_cost 29, train 25 and bench 189 for n-gram and the head alone, 372 s in all; the second ran
# past 50 s in install (a cold import probe) and 80 s in tests on a fresh machine, 75 s warm. A stage past its budget
# fails (named) and the next one starts; the report is written after each stage, so a command the device tool stops
# at its 10 minutes still returns the stages before. `--stages` reruns any subset. The fifth run (H200, 2026-11-27)
# found a slower host: step_cost past 40 s and bench 42 of its 52 calls in 320 s; so both have more, and the stages
# no longer fit one call: `--stages install,tests,kernels,step_cost`, then `--stages bench` on the warm machine.
BUDGET_S = {"install": 120, "tests": 180, "kernels": 25, "step_cost": 75, "train": 35, "bench": 480, "graphs": 540,
            "shape_1b": 480, "shape_8b": 540}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="every stage on tiny random-init models on the CPU; "
                        "installs nothing")
    parser.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "hf_specdec_gpu_check" / "out"),
                        help="folder for gpu_check.json, gpu_check.md and bench.png (on the device: $OUT)")
    parser.add_argument("--work", default=None, help="scratch folder (default: a new temporary one)")
    parser.add_argument("--stages", default=",".join(STAGE_NAMES), help="comma-separated subset, run in order")
    parser.add_argument("--pack", action="store_true", help="write the GPU machine's bundle (wheels and the embedded "
                        "model, in parts of at most 40 MiB) into .gpu_check/ and exit")
    parser.add_argument("--pack-serve", action="store_true", help="write the serving path's smaller bundle (the "
                        "model's loaders, the serving extra's wheels and the embedded model) into .gpu_serve/ for "
                        "benchmarks/gpu_serve_run.sh, and exit")
    parser.add_argument("--receive", action="append", default=[], metavar="PART", help="keep a bundle part on this "
                        "machine (outside the working tree) before the check")
    parser.add_argument("--no-check", action="store_true", help="with --receive: only keep the part")
    args = parser.parse_args(argv)
    if args.pack or args.pack_serve:
        parts = (pack(BUNDLE_DIR.parent / ".gpu_serve", SERVE_PART_BYTES, SERVE_PACKED) if args.pack_serve
                 else pack())
        print("\n".join(str(p) for p in parts))
        print(f"{len(parts)} parts: send each with the device tool (see docs/benchmarks.md, 'GPU runs')")
        return 0
    for part in args.receive:
        print(receive(Path(part)))
    if args.no_check:
        return 0
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGE_NAMES]
    if unknown:
        parser.error(f"unknown stages {unknown}; choose from {', '.join(STAGE_NAMES)}")
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernels run interpreted
        os.environ.setdefault("HF_SPECDEC_CALIBRATION", "off")  # never touch this host's calibration profiles
        # one thread per process: the tiny models gain nothing from more, and on a shared CPU spinning threads
        # made the same dry run take anywhere from 50 to 100 s
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    return run_stages(stages, out, work, args.dry_run)


def run_stages(stages: list[str], out: Path, work: Path, dry_run: bool, functions: dict | None = None) -> int:
    """Runs `stages` in order, writing the report after each; returns 1 if any failed, else 0. `functions` maps a
    stage name to its function (default: install, then gpu_check_stages.STAGES, imported after the install)."""
    report = {"meta": {"dry_run": dry_run, "stages": stages, "python": platform.python_version(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, "stages": {}}
    for name in stages:
        start = time.perf_counter()
        print(f"gpu_check: stage {name} ...", flush=True)
        try:
            with budget(None if dry_run else BUDGET_S.get(name), name):
                if functions is not None:
                    result = functions[name]()
                elif name == "install":
                    result = install(dry_run)
                else:
                    from gpu_check_stages import STAGES, Context, require_cuda

                    if not dry_run:
                        require_cuda()
                    result = STAGES[name](Context(out=out, work=work, dry_run=dry_run))
            entry = {"status": "passed", **result}
        except (Exception, SystemExit) as error:  # noqa: BLE001  (a failed stage is reported, and the rest still run)
            entry = {"status": "failed", "error": f"{type(error).__name__}: {error}",
                     "traceback": traceback.format_exc()[-4000:], **(getattr(error, "partial", None) or {})}
            print(f"gpu_check: stage {name} FAILED: {entry['error']}", file=sys.stderr, flush=True)
        entry["seconds"] = round(time.perf_counter() - start, 1)
        report["stages"][name] = entry
        report["meta"].update(_device())
        write_report(report, out)
    failed = [n for n, e in report["stages"].items() if e["status"] == "failed"]
    print(f"gpu_check: {len(stages) - len(failed)} of {len(stages)} stages passed"
          + (f"; FAILED: {', '.join(failed)}" if failed else "") + f"; wrote {out / 'gpu_check.json'} and "
          f"{out / 'gpu_check.md'}", file=sys.stderr if failed else sys.stdout)
    return 1 if failed else 0


@contextmanager
def budget(seconds: float | None, name: str):
    """Raises TimeoutError in the stage once it has run `seconds` (None: no limit)."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"stage {name} ran past its {seconds} s budget")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _device() -> dict:
    torch = sys.modules.get("torch")  # only once a stage has imported it: the install must come first
    if torch is None:
        return {}
    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else None,
            "cuda": torch.version.cuda if cuda else None}


def write_report(report: dict, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "gpu_check.md").write_text(summary(report))


def summary(report: dict) -> str:
    """The Markdown summary: each stage's status and its headline numbers."""
    meta, stages = report["meta"], report["stages"]
    lines = [f"# GPU check{' (dry run, CPU)' if meta['dry_run'] else ''}", "",
             f"Device: {meta.get('gpu') or 'no GPU'}; torch {meta.get('torch', '?')}, CUDA {meta.get('cuda')}; "
             f"started {meta['started']}.", "", "| stage | status | seconds |", "| --- | --- | --- |"]
    lines += [f"| {n} | {'**FAILED**' if e['status'] == 'failed' else 'passed'} | {e['seconds']} |"
              for n, e in stages.items()]
    for name, entry in stages.items():
        lines += ["", f"## {name}"]
        if entry["status"] == "failed":
            lines.append(f"**FAILED**: {entry['error']}"[:3000])
            if name != "bench" or not entry.get("runs"):
                continue
            lines += ["", "What ran before it failed:", ""]
        lines += _stage_lines(name, entry)
    return "\n".join(lines) + "\n"


def _stage_lines(name: str, entry: dict) -> list[str]:
    if name == "install":
        return [f"- {note}" for note in entry.get("notes", entry.get("plan", []))] + (
            [f"- versions: {entry['versions']}"] if "versions" in entry else [])
    if name == "tests":
        return [f"- {run}: {r['tests']} tests, {r['failures']} failed, {r['errors']} errors, {r['skipped']} skipped"
                for run, r in entry.items() if isinstance(r, dict) and "tests" in r]
    if name == "kernels":
        lines = [f"Device: {entry['device']}, triton {entry['triton']}.", "",
                 "| op | case | triton ms | reference ms | target | met |", "| --- | --- | --- | --- | --- | --- |"]
        for r in entry["rows"]:
            reference = r.get("torch_ms", r.get("sdpa_contiguous_ms"))
            lines.append(f"| {r['op']} | {r['case']} | {r['triton_ms']:.3f} | {reference:.3f} | {r['target']} | "
                         f"{'yes' if r['meets_target'] else '**no**'} |")
        return lines
    if name == "step_cost":
        return ["```python", entry["literal"], "```"]
    if name == "train":
        return [f"{entry['steps']} steps in {entry['train_seconds']:.1f} s: {entry['steps_per_s']:.2f} steps/s "
                f"(accelerate: {entry['accelerate']}); loss {entry['loss_first']:.3f} -> {entry['loss_last']:.3f}"]
    if name.startswith("shape_"):
        return entry["table"].splitlines()
    if name == "graphs":
        def num(value, suffix=""):
            return "-" if value is None else f"{value:.2f}{suffix}"

        lines = [f"CUDA memory: {entry.get('cuda_reserved_gib', '-')} GiB reserved, "
                 f"{entry.get('cuda_peak_allocated_gib', '-')} GiB peak allocated.", "",
                 "| workload | batch | configuration | speedup | vs off | vs static | first call s | second call s "
                 "| identical |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in entry["rows"]:
            lines.append(f"| {r['workload']} | {r['batch']} | {r['config']} | {num(r['speedup'], 'x')} | "
                         f"{num(r['speedup_over_off'], 'x')} | {num(r['speedup_over_static'], 'x')} | "
                         f"{num(r['first_call_s'])} | {num(r['second_call_s'])} | "
                         f"{'yes' if r['identical'] else '**no**'} |")
        return lines
    lines = ["| run | workload | batch | configuration | speedup | acceptance | identical |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for run, rows in entry["runs"].items():
        for r in rows:
            acceptance = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
            lines.append(f"| {run} | {r['workload']} | {r['batch']} | {r['config']} | {r['speedup']:.2f}x | "
                         f"{acceptance} | {'yes' if r['identical'] else '**no**'} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
