"""benchmarks/gpu_check.py, the one command that checks the GPU path: its dry run end to end on the CPU (so the
script cannot rot while no GPU is lent), its loud failures, the bundle that carries its packages to an offline GPU
machine; and the suite's GPU tests (`-m gpu`), which the check runs on the GPU and which skip without one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_model, ragged_batch, repetitive_prompt

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402
import gpu_check_bundle  # noqa: E402
import gpu_check_stages  # noqa: E402
from gpu_check_stages import Context, StageError, judge_tests, junit_counts, step_cost_literal  # noqa: E402


@pytest.mark.slow  # every stage of the GPU check
def test_dry_run_runs_every_stage_and_writes_the_report(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--dry-run", "--out", str(out),
                           "--work", str(work)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    stages = report["stages"]
    assert list(stages) == list(gpu_check.STAGE_NAMES)
    assert {name: entry["status"] for name, entry in stages.items()} == dict.fromkeys(gpu_check.STAGE_NAMES, "passed")
    assert report["meta"]["dry_run"] and "plan" in stages["install"]
    # tests: the GPU tests were collected (and skipped here), the kernel cases ran under the interpreter
    assert stages["tests"]["gpu"]["tests"] >= 4 and stages["tests"]["gpu"]["skipped"] == stages["tests"]["gpu"]["tests"]
    assert stages["tests"]["kernels"]["tests"] > stages["tests"]["kernels"]["skipped"] == 0
    assert {row["op"] for row in stages["kernels"]["rows"]} == {"rejection_sample", "sampling_params",
                                                               "paged_attention"}
    from hf_specdec.costs.step_cost import StepCost

    literal = stages["step_cost"]["literal"]
    assert isinstance(eval(literal.split(": ", 1)[1].rstrip(","), {"StepCost": StepCost}), StepCost)
    assert stages["train"]["steps"] == 3 and stages["train"]["steps_per_s"] > 0
    runs = stages["bench"]["runs"]
    assert set(runs) == {"ngram and head", "fp8 draft", "int8 draft"}
    configs = {row["config"] for rows in runs.values() for row in rows}
    assert {"plain generate", "hf_specdec ngram"} <= configs
    assert any("[fp8]" in c for c in configs) and any("[int8]" in c for c in configs)
    assert {row["batch"] for rows in runs.values() for row in rows} == {2}
    speculative = [row for rows in runs.values() for row in rows
                   if row["config"].startswith("hf_specdec") and row["config"] != "hf_specdec off"]
    assert len(speculative) == 4 and all(row["draft_ms_per_token"] is not None for row in speculative)  # drafted
    # float32 on the CPU: speculation must give plain generate's output, token for token
    assert all(row["identical"] for rows in runs.values() for row in rows)
    markdown = (out / "gpu_check.md").read_text()
    assert all(f"## {name}" in markdown for name in gpu_check.STAGE_NAMES) and "FAILED" not in markdown
    graphs = {row["config"]: row for row in stages["graphs"]["rows"]}  # compiled on the CPU, exact
    assert {"hf_specdec off compiled", "hf_specdec ngram compiled", "plain generate, static cache"} <= set(graphs)
    assert all(row["identical"] for row in graphs.values()) and "## graphs" in markdown
    for name in ("shape_1b", "shape_8b"):  # the shapes shrunk: every configuration, exact, priced against the ideal
        rows = stages[name]["rows"]
        assert [r["config"] for r in rows][:3] == ["plain generate", "plain generate, static cache", "hf_specdec off"]
        assert all(r["fraction_of_ideal"] > 0 for r in rows[3:]) and all(r["identical"] is not False for r in rows)


def test_a_failing_stage_is_named_and_the_run_exits_nonzero(tmp_path, capsys):
    def broken():
        raise RuntimeError("the kernels did not compile")

    code = gpu_check.run_stages(["install", "kernels"], tmp_path, tmp_path, dry_run=True,
                                functions={"install": lambda: {"plan": ["nothing"]}, "kernels": broken})
    assert code == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["stages"]["install"]["status"] == "passed"
    assert report["stages"]["kernels"]["status"] == "failed"
    assert "the kernels did not compile" in report["stages"]["kernels"]["error"]
    assert "FAILED: kernels" in capsys.readouterr().err
    assert "## kernels\n**FAILED**: RuntimeError: the kernels did not compile" in (tmp_path / "gpu_check.md").read_text()


def test_a_stage_past_its_budget_fails(tmp_path):
    def slow():
        import time

        time.sleep(5)
        return {}

    gpu_check.BUDGET_S["slow"] = 1
    try:
        code = gpu_check.run_stages(["slow"], tmp_path, tmp_path, dry_run=False, functions={"slow": slow})
    finally:
        del gpu_check.BUDGET_S["slow"]
    assert code == 1
    assert "ran past its 1 s budget" in json.loads((tmp_path / "gpu_check.json").read_text())["stages"]["slow"]["error"]


def save_bench_row(argv, batch_size: int) -> None:
    """What `hf-specdec bench` (called with `argv`) saves: one row, at `batch_size`."""
    row = {"workload": "grounded", "batch_size": batch_size, "config": "hf_specdec ngram", "tokens_per_s": 900.0,
           "speedup": 1.8, "acceptance_rate": 0.5, "mean_acceptance_length": 2.5, "draft_ms_per_token": 0.1,
           "identical": True}
    Path(argv[argv.index("--out") + 1]).write_text(json.dumps({"meta": {"partial": True}, "results": [row]}))


def test_bench_runs_the_gpu_commands_and_stops_at_its_budget(tmp_path, monkeypatch):
    """On a GPU the bench stage runs n-gram and the shipped head, then the FP8 and the int8 draft, with --device cuda
    --dtype bfloat16 at batch 1, 4, 16, 64; once its budget is spent no further run starts, and what ran is kept."""
    calls = []

    def fake_cli(argv):
        calls.append(argv)
        # the bench saves after each workload and batch size: the second run is stopped after its first group
        save_bench_row(argv, batch_size=64 // len(calls))
        if len(calls) == 2:
            raise TimeoutError("stage bench ran past its 240 s budget")

    monkeypatch.setattr(gpu_check_stages, "cli", fake_cli)
    with pytest.raises(StageError, match="fp8 draft: stage bench ran past its 240 s budget") as info:
        gpu_check_stages.run_bench(Context(out=tmp_path, work=tmp_path, dry_run=False))
    assert len(calls) == 2  # the int8 run never started
    first, second = (" ".join(argv) for argv in calls)
    assert "--device cuda" in first and "--dtype bfloat16" in first and "--batch-sizes 1,4,16,64" in first
    assert "--speculators ngram,eagle" in first and "--model smollm2-135m-instruct" in first
    assert "--speculators smollm2-135m-instruct --draft-quantization fp8" in second
    assert info.value.partial["runs"]["ngram and head"][0]["speedup"] == 1.8
    assert info.value.partial["runs"]["fp8 draft (stopped part-way)"][0]["batch"] == 32  # what it measured is kept
    code = gpu_check.run_stages(["bench"], tmp_path, tmp_path, dry_run=True,
                                functions={"bench": lambda: (_ for _ in ()).throw(info.value)})
    assert code == 1
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "**FAILED**: StageError: fp8 draft" in markdown and "| ngram and head | grounded | 64 |" in markdown


def test_a_bench_run_that_fails_part_way_keeps_its_rows_and_the_next_runs(tmp_path, monkeypatch):
    calls = []

    def fake_cli(argv):
        calls.append(argv)
        save_bench_row(argv, batch_size=16)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(gpu_check_stages, "cli", fake_cli)
    with pytest.raises(StageError, match="ngram and head: RuntimeError: CUDA out of memory") as info:
        gpu_check_stages.run_bench(Context(out=tmp_path, work=tmp_path, dry_run=False))
    assert len(calls) == 3  # not a timeout: the quantized drafts' runs still ran
    runs = info.value.partial["runs"]
    assert runs["ngram and head (stopped part-way)"][0]["batch"] == 16 and set(runs) >= {"fp8 draft", "int8 draft"}


def test_pytest_runs_are_judged_loudly(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text('<testsuites><testsuite tests="3" failures="0" errors="0" skipped="1">'
                      '<testcase name="a"/><testcase name="b"/>'
                      '<testcase name="c"><skipped message="needs torchao"/></testcase></testsuite></testsuites>')
    counts = junit_counts(report)
    assert counts["tests"] == 3 and counts["skipped"] == 1 and counts["skip_reasons"] == ["needs torchao"]
    assert judge_tests(0, counts, allow_skips=True) is None
    assert "1 skipped on the GPU: needs torchao" in judge_tests(0, counts, allow_skips=False)
    assert judge_tests(5, {**counts, "tests": 0, "skipped": 0}, allow_skips=True) == "collected no test"
    assert "1 failed" in judge_tests(1, {**counts, "failures": 1}, allow_skips=True)
    assert judge_tests(2, {}, allow_skips=True) == "no report (exit code 2)"
    assert counts["failed_tests"] == []
    report.write_text('<testsuite tests="2" failures="1" errors="1" skipped="0">'
                      '<testcase name="d[draft]"><failure message="assert 0 &gt; 0&#10;where 0 = ...">tb</failure>'
                      '</testcase><testcase name="e"><error message="">tb</error></testcase></testsuite>')
    assert junit_counts(report)["failed_tests"] == [("d[draft]", "assert 0 > 0"), ("e", "error")]


def test_bundle_parts_travel_and_reassemble(tmp_path):
    payload = tmp_path / "src" / "bundle"
    (payload / "wheels").mkdir(parents=True)
    (payload / "wheels" / "a.whl").write_bytes(bytes(range(256)) * 40)
    archive = tmp_path / "bundle.tar"
    import tarfile

    with tarfile.open(archive, "w") as tar:
        tar.add(payload, arcname="bundle")
    parts = gpu_check_bundle.split(archive, tmp_path / "parts", part_bytes=4096)
    assert len(parts) > 2
    staging = tmp_path / "staging"
    assert "still missing" in gpu_check_bundle.receive(parts[0], staging)
    with pytest.raises(RuntimeError, match=parts[-1].name):
        gpu_check_bundle.unpack(staging)
    for part in parts[1:]:
        line = gpu_check_bundle.receive(part, staging)
    assert line.endswith("all parts here")
    bundle = gpu_check_bundle.unpack(staging)
    assert (bundle / "wheels" / "a.whl").read_bytes() == bytes(range(256)) * 40
    corrupt = staging / "parts" / parts[1].name
    corrupt.write_bytes(b"x" + corrupt.read_bytes()[1:])
    with pytest.raises(RuntimeError, match="do not match their digest"):
        gpu_check_bundle.unpack(staging)


def test_packages_installed_during_the_run_become_importable(tmp_path, monkeypatch):
    """The install stage installs hf_specdec editable, found through a .pth file that Python reads at startup; the
    stages after it run in the same process."""
    site_dir, source = tmp_path / "site", tmp_path / "src"
    (source / "gpu_check_fresh_package").mkdir(parents=True)
    (source / "gpu_check_fresh_package" / "__init__.py").write_text("ANSWER = 42\n")
    site_dir.mkdir()
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(ImportError):
        import gpu_check_fresh_package  # noqa: F401
    (site_dir / "fresh.pth").write_text(f"{source}\n")
    gpu_check_bundle.refresh_import_paths([str(site_dir)])
    import gpu_check_fresh_package

    assert gpu_check_fresh_package.ANSWER == 42
    monkeypatch.delitem(sys.modules, "gpu_check_fresh_package")


def test_step_cost_literal_is_source_for_the_default():
    from hf_specdec.costs.step_cost import StepCost

    cost = StepCost(per_row=0.01, points=((1.0, 1.25), (1024.0, 6.5)), per_context_token=2e-5)
    literal = step_cost_literal("cuda", cost)
    assert literal.startswith('"cuda": StepCost(') and literal.endswith(",")
    assert eval(literal.split(": ", 1)[1].rstrip(","), {"StepCost": StepCost}) == cost


# --- GPU tests: run by the check on the GPU (`-m gpu`), skipped without one -----------------------------------------


def _cuda_model(seed: int = 0):
    # float32: the Triton kernels take fp32/bf16/fp16; a near-tie within float32 rounding is vanishingly unlikely
    # for these random-init logits over 16 tokens
    return make_model("llama", seed=seed, dtype=torch.float32).cuda()


@pytest.mark.parametrize("kind", ["ngram", "draft model"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_on_cuda_equals_generate(kind):
    """The engine on CUDA (paged cache, Triton verify kernels through backend "auto"): ragged batch, token for
    token equal to plain generate."""
    target = _cuda_model()
    input_ids, mask = ragged_batch()
    if kind == "ngram":
        input_ids, mask = repetitive_prompt(rows=3), torch.ones(3, 16, dtype=torch.long)
    input_ids, mask = input_ids.cuda(), mask.cuda()
    plain = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    speculator = "ngram" if kind == "ngram" else _cuda_model(seed=1)
    out = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                          speculator=speculator, num_speculative_tokens=4, return_dict_in_generate=True,
                          speculative_schedule="constant")  # adaptive k may rightly skip drafts a test needs
    assert torch.equal(out.sequences, plain)
    assert out.speculative_metrics.num_draft_tokens > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_sampling_on_cuda_is_reproducible():
    from conftest import assert_seeded_sampling_is_reproducible

    target, draft = _cuda_model(), _cuda_model(seed=1)
    input_ids, mask = ragged_batch()

    def run(**kwargs):
        return target.generate(input_ids=input_ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=12,
                               speculator=draft, num_speculative_tokens=3, return_dict_in_generate=True,
                               speculative_schedule="constant", **kwargs)

    assert_seeded_sampling_is_reproducible(run)


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_quantized_draft_on_cuda_is_lossless(quantization):
    """FP8 (torchao; FP8 matrix products on compute capability 8.9+) and int8 (bitsandbytes) drafts on the GPU:
    whatever the draft proposes, greedy output is the target's."""
    from hf_specdec import load_draft

    target = _cuda_model()
    draft = load_draft(make_model("llama", seed=1, dtype=torch.float32), quantization, dtype=torch.bfloat16,
                       device="cuda")
    input_ids, mask = ragged_batch()
    input_ids, mask = input_ids.cuda(), mask.cuda()
    plain = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                          speculator=draft, num_speculative_tokens=4)
    assert torch.equal(out, plain)


def test_pack_serve_bundles_the_serving_extra_and_the_models_loaders(monkeypatch):
    import re
    import tomllib

    calls = []
    monkeypatch.setattr(gpu_check, "pack", lambda *args: calls.append(args) or [])
    assert gpu_check.main(["--pack-serve"]) == 0
    out, part_bytes, packed = calls[0]
    assert out.name == ".gpu_serve" and part_bytes == gpu_check_bundle.SERVE_PART_BYTES
    extras = tomllib.loads((BENCHMARKS.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    needed = {re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0] for req in extras["serve"]} | {"transformers", "gguf"}
    assert needed <= set(packed)
    assert "bitsandbytes" not in packed  # the three-part bundle: the quantization wheels stay out
    calls.clear()
    assert gpu_check.main(["--pack"]) == 0
    assert calls == [()]
