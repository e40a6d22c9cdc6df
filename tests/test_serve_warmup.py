"""benchmarks/serve_warmup.py, the warm-up measurement prepared for a GPU: its whole path on a tiny model on the CPU,
so the script cannot rot while no GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import COMMON, make_tokenizer

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_warmup.py"


@pytest.mark.slow  # both server configurations
def test_serve_warmup_runs_both_configurations_on_a_tiny_model(tmp_path):
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    LlamaForCausalLM(LlamaConfig(**{**COMMON, "max_position_embeddings": 1024})).float().save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    out = tmp_path / "warmup.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model_dir), "--requests", "2", "--max-tokens",
                           "4", "--threads", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| warm-up | start s |" in proc.stdout
    results = {r["configuration"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"cold", "warm"}
    assert results["cold"]["warmup_report"] is None and results["warm"]["warmup_report"]["steps"] > 0
    for result in results.values():
        for name in ("first", "again"):
            assert result[name]["tokens"] > 0 and 0 < result[name]["ttft_p50_s"] <= result[name]["ttft_max_s"]
