"""`hf-specdec bench` end to end on a tiny model: every configuration runs, outputs compare, files are written."""

import json
import os

import pytest
import torch

from conftest import make_model, make_tokenizer


def test_bench_runs_every_configuration(tmp_path, capsys):
    from hf_specdec.cli import main

    model, tokenizer = make_model("llama", dtype=torch.float32), make_tokenizer()
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    model.save_pretrained(tmp_path / "draft")
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert main(["bench", "--model", str(tmp_path / "target"), "--speculators", f"ngram,{tmp_path / 'draft'}",
                 "--batch-sizes", "1,3", "--max-new-tokens", "8", "--repeats", "1", "-k", "3",
                 "--out", str(out), "--plot", str(png)]) == 0
    results = json.loads(out.read_text())["results"]
    configs = {(r["workload"], r["batch_size"], r["config"]) for r in results}
    assert ("grounded", 1, "transformers prompt lookup") in configs
    assert ("open_chat", 3, "hf_specdec ngram") in configs
    assert not any(b == 3 and c.startswith("transformers") for _, b, c in configs)  # refused there, so not run
    for r in results:
        assert r["tokens_per_s"] > 0 and r["identical"], r  # greedy: every configuration gives the same text
        if r["config"].startswith("hf_specdec"):
            assert r["ideal_speedup"] is not None and r["acceptance_rate"] is not None
    assert png.stat().st_size > 0
    assert "| grounded | 1 | plain generate |" in capsys.readouterr().out


def test_bench_takes_speculator_objects():
    """A `Speculator` (an EAGLE head, an n-gram instance) is benchmarked by hf_specdec only: transformers cannot
    assist with it, and its cost comes from `relative_cost`, not a parameter count."""
    from hf_specdec import NgramSpeculator
    from hf_specdec.tools.bench import run_bench

    model, tokenizer = make_model("llama", dtype=torch.float32), make_tokenizer()
    results = run_bench(model, tokenizer, {"ngram-object": NgramSpeculator()}, batch_sizes=(1,),
                        workloads=("grounded",), max_new_tokens=6, repeats=1, progress=False)
    configs = {r.config for r in results}
    assert "hf_specdec ngram-object" in configs
    assert not any("assisted" in c for c in configs)
    assert all(r.identical for r in results)


def test_bench_compares_the_packed_and_padded_layouts(monkeypatch):
    """`--compare-layout`: each hf_specdec configuration also runs with every step padded (HF_SPECDEC_PACKED=0 set
    for its calls only), and gives the same output."""
    from hf_specdec.runners import model_runner
    from hf_specdec.tools.bench import run_bench

    seen = []
    original = model_runner.ModelRunner.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.cache.manager.num_blocks >= 64:  # the calls' own runners, not the trial's (4 blocks)
            seen.append(self.packed)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", spy)
    model, tokenizer = make_model("llama", dtype=torch.float32), make_tokenizer()
    results = run_bench(model, tokenizer, {"ngram": "ngram"}, batch_sizes=(3,), workloads=("grounded",),
                        max_new_tokens=6, repeats=1, progress=False, padded=True)
    assert {r.config for r in results} == {"plain generate", "hf_specdec off", "hf_specdec ngram",
                                           "hf_specdec ngram padded"}
    assert all(r.identical for r in results)
    assert True in seen and False in seen  # both layouts ran
    assert "HF_SPECDEC_PACKED" not in os.environ


def test_bench_serve_rounds_report_medians_and_paired_ratios():
    """Three rounds of three configurations: figures are medians over the rounds, ratios the medians of each round's
    own ratio (a round where everything ran slow does not distort them), identical the fewest seen."""
    from hf_specdec.tools.serve_bench import SPECULATION_OFF, TRANSFORMERS, ServeResult, summarize_rounds, table

    def result(name, tps, identical=8):
        return ServeResult(name, tps, 0.1 * tps, 0.2 * tps, tps, 2 * tps, 8, identical,
                           {"draft_tokens": 10, "acceptance": tps / 100} if name == "ngram" else {})

    rounds = [[result(TRANSFORMERS, 50), result(SPECULATION_OFF, 80), result("ngram", 88)],
              [result(TRANSFORMERS, 25), result(SPECULATION_OFF, 40), result("ngram", 48, identical=7)],
              [result(TRANSFORMERS, 60), result(SPECULATION_OFF, 90), result("ngram", 90)]]
    rows = {r["configuration"]: r for r in summarize_rounds(rounds)}
    assert rows["ngram"]["tokens_per_s"] == 88
    assert rows["ngram"]["vs_speculation_off"] == pytest.approx(1.1)  # 1.1, 1.2, 1.0
    assert rows["ngram"]["vs_transformers"] == pytest.approx(1.76)  # 1.76, 1.92, 1.5
    assert rows[SPECULATION_OFF]["vs_speculation_off"] == pytest.approx(1.0)
    assert rows["ngram"]["identical"] == 7
    assert rows["ngram"]["acceptance"] == pytest.approx(0.88)
    assert rows[TRANSFORMERS]["acceptance"] is None
    assert "| ngram | 88.0 | 1.76x | 1.10x |" in table(list(rows.values()))


def test_a_decode_outweighed_by_noise_is_not_reported(monkeypatch, capsys):
    """Where the one-token calls (TTFT) took longer than the full calls, the host's noise outweighed the decode:
    TPOT and the draft's relative cost are left out (with a message), never reported below zero."""
    from hf_specdec.tools import bench

    model, tokenizer = make_model("llama", dtype=torch.float32), make_tokenizer()
    inputs = tokenizer(["the cat sat"], return_tensors="pt")
    clock = iter(range(10_000))
    # Every call takes 1 "second" except the one-token calls, which take 10: TTFT > latency.
    real_generate = model.generate

    def slow_first_token(**kwargs):
        if kwargs["max_new_tokens"] == 1:
            for _ in range(9):
                next(clock)
        return real_generate(**kwargs)

    monkeypatch.setattr(bench.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(model, "generate", slow_first_token)
    configs = [bench.Config("plain generate")]
    from tqdm import tqdm

    results = bench._measure(model, [(inputs, {})], configs, "grounded", 1, 4, 1, tqdm(disable=True))
    assert results[0].tpot_s is None and results[0].ttft_s > results[0].latency_s
    assert "TPOT not reported" in capsys.readouterr().out
    assert "| grounded | 1 | plain generate |" in bench.table(results)
    assert bench.table(results).splitlines()[-1].split(" | ")[7] == "-"  # TPOT


def test_bench_reports_speedups_over_the_engine_and_the_static_cache():
    """Every run has "hf_specdec off" (the engine without drafts) and, asked for (default on CUDA), transformers'
    static-cache `generate`; each row's speedup over both, and each configuration's first call timed apart."""
    from hf_specdec.tools.bench import OFF, STATIC, run_bench

    model, tokenizer = make_model("llama", dtype=torch.float32), make_tokenizer()
    results = run_bench(model, tokenizer, {"ngram": "ngram"}, batch_sizes=(2,), workloads=("grounded",),
                        max_new_tokens=6, repeats=2, progress=False, assisted=False, static=True)
    by_config = {r.config: r for r in results}
    assert list(by_config) == ["plain generate", STATIC, OFF, "hf_specdec ngram"]
    assert all(r.identical for r in results)
    assert by_config[OFF].speedup_over_off == 1.0 and by_config[STATIC].speedup_over_static == 1.0
    ngram = by_config["hf_specdec ngram"]
    assert ngram.speedup_over_off > 0 and ngram.speedup_over_static > 0
    assert all(r.first_call_s > 0 and r.second_call_s > 0 for r in results)
    assert by_config[OFF].first_measure_s is not None and by_config["plain generate"].first_measure_s is None


def test_a_row_that_ends_first_is_not_counted_in_the_steps_after():
    """`num_row_steps` sums the rows each step fed, so the bench's tokens per target forward counts a row only in the
    steps it took part in: speculation off emits one token per row and step at a batch whose rows end apart (before,
    steps x rows put it below 1 there)."""
    from conftest import ragged_batch

    model = make_model("llama", dtype=torch.float32)
    ids, mask = ragged_batch(rows=3)
    new = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)[:, ids.shape[1]:]
    # An end-of-sequence token that row 0 emits early and some other row never does: rows end apart.
    eos = next(t for t in new[0, 1:6].tolist() if any(t not in new[r].tolist() for r in (1, 2)))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, speculator="off",
                         eos_token_id=eos, return_dict_in_generate=True)
    m = out.speculative_metrics
    assert m.num_row_steps < 3 * m.num_steps
    assert m.num_emitted_tokens == m.num_row_steps
    assert m.to_dict()["num_row_steps"] == m.num_row_steps


def test_proposing_time_is_split_by_whether_the_step_drafted():
    """`drafting_time_s` keeps the proposing time of the steps that verified drafts only, so the bench's draft cost
    per token is not inflated by steps that drafted nothing (an n-gram lookup without a match); `draft_time_s` keeps
    all of it."""
    import time

    from hf_specdec.decode.speculator import Speculator
    from hf_specdec.types import DraftProposal

    idle_s = 0.02

    class EveryOtherStep(Speculator):
        """Drafts one token on even steps; on odd steps proposes nothing, after `idle_s` of work."""

        def begin(self, target, batch):
            self.steps = self.idle = 0

        def propose(self, batch, k):
            self.steps += 1
            rows = len(batch.active)
            if self.steps % 2:
                self.idle += 1
                time.sleep(idle_s)
                return DraftProposal.empty(rows, batch.device)
            return DraftProposal(torch.ones(rows, k, dtype=torch.long), torch.full((rows,), k))

    model, tokenizer = make_model("llama", dtype=torch.float32), make_tokenizer()
    inputs = tokenizer(["the cat sat"], return_tensors="pt")
    speculator = EveryOtherStep()
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, speculator=speculator,
                         num_speculative_tokens=1, speculative_schedule="constant", return_dict_in_generate=True)
    m = out.speculative_metrics
    assert m.num_drafts and speculator.idle
    assert m.drafting_time_s > 0  # the drafting steps' proposing is counted
    assert m.draft_time_s - m.drafting_time_s >= speculator.idle * idle_s  # the idle steps' (their sleeps) is not
    assert m.to_dict()["drafting_time_s"] == m.drafting_time_s


def test_bench_reports_the_spread_of_its_paired_ratios(monkeypatch):
    """Beside each paired median the lowest and highest ratio over the repeats, in the results and the table: how far
    the host's noise moved a cell, against which a floor near 1 is read."""
    from tqdm import tqdm

    from hf_specdec.tools import bench

    model, tokenizer = make_model("llama", dtype=torch.float32), make_tokenizer()
    inputs = tokenizer(["the cat sat"], return_tensors="pt")
    clock = [0.0]
    # Full calls (6 new tokens) of plain generate take 2 "seconds"; speculation off's first and second call 1, then
    # its three repeats 1, 2 and 4: paired ratios 2, 1 and 0.5.
    off_seconds = iter([1.0, 1.0, 1.0, 2.0, 4.0])
    real_generate = model.generate

    def scripted(**kwargs):
        if kwargs["max_new_tokens"] == 6:
            clock[0] += next(off_seconds) if kwargs.get("speculator") == "off" else 2.0
        return real_generate(**kwargs)

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(model, "generate", scripted)
    configs = [bench.Config("plain generate"), bench.Config(bench.OFF, dict(speculator="off"))]
    plain, off = bench._measure(model, [(inputs, {})], configs, "grounded", 1, 6, 3, tqdm(disable=True))
    assert off.speedup == 1.0 and off.speedup_range == (0.5, 2.0)
    assert plain.speedup_range == (1.0, 1.0) and plain.speedup_over_off_range == (0.5, 2.0)
    assert off.speedup_over_off_range == (1.0, 1.0)
    rows = {line.split(" | ")[2]: line.split(" | ") for line in bench.table([plain, off]).splitlines()[2:]}
    assert rows[bench.OFF][4] == "1.00x (0.50-2.00)" and rows[bench.OFF][5] == "1.00"
    assert rows["plain generate"][4] == "1.00x" and rows["plain generate"][5] == "1.00 (0.50-2.00)"
