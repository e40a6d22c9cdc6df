"""The demo without a browser: input checks, the streamed runs and their colouring, HTML, launch and the Space."""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import hf_specdec
import hf_specdec.cli
from conftest import make_model, make_tokenizer, word_prompt
from hf_specdec.demo import NGRAM_LABEL, DemoInputError, DemoLimits, DemoSession
from hf_specdec.demo import app as demo_app
from hf_specdec.demo.render import batch_html, chart_html, metrics_html, pane_html
from hf_specdec.demo.session import _num_new_tokens, load_speculators
from hf_specdec.demo.stream import Pane
from hf_specdec.workloads import chat_inputs

REPO = Path(__file__).resolve().parents[1]
SELF_DRAFT = "draft model: self"


@pytest.fixture(scope="module")
def session():
    target = make_model("llama", dtype=torch.float32)
    speculators = {NGRAM_LABEL: "ngram", SELF_DRAFT: make_model("llama", dtype=torch.float32)}
    return DemoSession(target, make_tokenizer(), speculators, DemoLimits(max_prompt_chars=400, max_prompt_tokens=60,
                                                                         max_new_tokens=64, max_batch_prompts=3),
                       model_name="tiny")


def _run(session, prompt, **settings):
    *_, last = session.compare(prompt, session.check_settings(**settings))
    return last


# Checks: every refusal names the problem and the fix ------------------------------------------------------------
@pytest.mark.parametrize("prompt, message", [
    ("", "The prompt is empty: type a prompt"), ("   \n ", "The prompt is empty"), (None, "The prompt is empty"),
    ("w5 " * 200, "over this demo's limit of 400: shorten it"),
    ("w5 " * 90, "tokens long, over this demo's limit of 60: shorten it"),
])
def test_bad_prompts_are_refused_with_a_clear_message(session, prompt, message):
    with pytest.raises(DemoInputError, match=re.escape(message)):
        session.check_prompt(prompt)


def test_good_prompt_is_stripped(session):
    assert session.check_prompt("  w5 w6 \n") == "w5 w6"


@pytest.mark.parametrize("overrides, message", [
    (dict(k=0), "k (drafts per step) is 0: use a whole number from 1 to 16"),
    (dict(k=17), "k (drafts per step) is 17: use a whole number from 1 to 16"),
    (dict(k=2.5), "use a whole number from 1 to 16"),
    (dict(k="five"), "k (drafts per step) must be a number, got 'five'"),
    (dict(k=float("inf")), "must be a finite number"),
    (dict(k=None), "must be a number, got None"),
    (dict(max_new_tokens=65), "max new tokens is 65: use a whole number from 1 to 64"),
    (dict(max_new_tokens=0), "max new tokens is 0"),
    (dict(speculator="medusa"), "Unknown speculator 'medusa': choose one of"),
    (dict(do_sample=True, temperature=0), "Temperature 0 is out of range"),
    (dict(do_sample=True, top_p=1.5), "Top-p 1.5 is out of range"),
    (dict(seed=-1), "seed is -1"),
    (dict(schedule="sometimes"), "choose 'adaptive' or 'constant'"),
])
def test_bad_settings_are_refused_with_a_clear_message(session, overrides, message):
    settings = dict(speculator=NGRAM_LABEL, k=5, max_new_tokens=16) | overrides
    with pytest.raises(DemoInputError, match=re.escape(message)):
        session.check_settings(**settings)


def test_sampling_settings_only_checked_when_sampling(session):
    settings = session.check_settings(NGRAM_LABEL, 3.0, 16, do_sample=False, temperature=None, top_p=None)
    assert settings.k == 3 and not settings.do_sample
    assert settings.generate_kwargs() == dict(max_new_tokens=16, do_sample=False)


def test_prompt_plus_new_tokens_over_the_context_is_refused(session):
    session.limits = DemoLimits(max_prompt_tokens=250, max_prompt_chars=4000, max_new_tokens=200)
    try:
        with pytest.raises(DemoInputError, match="exceeds the model's context of 256 tokens: lower max new tokens"):
            _run(session, word_prompt(1, 100), speculator=NGRAM_LABEL, k=4, max_new_tokens=200)
    finally:
        session.limits = DemoLimits(max_prompt_chars=400, max_prompt_tokens=60, max_new_tokens=64,
                                    max_batch_prompts=3)


@pytest.mark.parametrize("text, message", [
    ("", "No prompts"), ("\n---\n  \n", "No prompts"), ("a\n---\nb\n---\nc\n---\nd", "4 prompts is over"),
    ("w5\n---\n" + "w6 " * 90, "Prompt 2: The prompt is"),
])
def test_bad_batches_are_refused(session, text, message):
    with pytest.raises(DemoInputError, match=re.escape(message)):
        session.check_batch(text)


def test_batch_text_is_split_on_separator_lines(session):
    assert session.check_batch("w5 w6\nw7\n---\nw8\n --- \nw9") == ["w5 w6\nw7", "w8", "w9"]


# Runs ---------------------------------------------------------------------------------------------------------
def test_compare_ngram_is_lossless_and_colours_each_step(session):
    prompt = word_prompt(5, 12)
    snapshots = list(session.compare(prompt, session.check_settings(NGRAM_LABEL, 4, 40, schedule="constant")))
    last = snapshots[-1]
    assert last.done and last.metrics is not None and all(s is last for s in snapshots)
    inputs = chat_inputs(session.tokenizer, [prompt])
    reference = session.model.generate(**inputs, max_new_tokens=40, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    assert last.plain.token_ids == reference.tolist() == last.speculative.token_ids
    assert last.identical and last.plain.text == last.speculative.text
    assert last.plain.step_sizes == [1] * 40  # plain generate streams one token per step
    # Per step: all but the last token are accepted drafts, so the colouring matches the engine's own count.
    spec = last.speculative
    assert sum(spec.step_sizes) == 40 and len(spec.step_sizes) == last.metrics.num_steps
    assert spec.num_accepted == sum(n - 1 for n in spec.step_sizes) == last.metrics.num_accepted_tokens > 0
    assert [p.kind for p in spec.pieces if p.step == 0][-1] == "target"
    assert spec.tokens_per_s > 0 and last.plain.tokens_per_s > 0 and last.speedup > 0


def test_compare_self_draft_accepts_every_draft(session):
    last = _run(session, word_prompt(6, 10), speculator=SELF_DRAFT, k=5, max_new_tokens=30, schedule="constant")
    metrics = last.metrics
    assert last.identical and metrics.num_draft_tokens > 0
    assert metrics.num_accepted_tokens == metrics.num_draft_tokens == last.speculative.num_accepted
    assert len(last.speculative.step_sizes) < 30  # fewer target forwards than tokens
    html = chart_html(metrics)
    assert html.count('class="sd-bar-row"') == len(metrics.accepted_per_position) == 5
    assert 'style="width: 100.0%"' in html


def test_compare_sampling_is_seeded(session):
    kwargs = dict(speculator=NGRAM_LABEL, k=4, max_new_tokens=20, do_sample=True, temperature=0.9, top_p=0.9)
    first = _run(session, word_prompt(7, 10), seed=3, **kwargs)
    again = _run(session, word_prompt(7, 10), seed=3, **kwargs)
    assert first.speculative.token_ids == again.speculative.token_ids
    assert first.plain.token_ids == again.plain.token_ids
    assert "not compared (sampling" in metrics_html(first)


def test_generation_errors_reach_the_caller(session, monkeypatch):
    def broken(*args, **kwargs):
        raise FloatingPointError("the target model produced NaN or inf logits")

    monkeypatch.setattr(session.model, "generate", broken)
    with pytest.raises(FloatingPointError, match="NaN"):
        _run(session, "w5 w6", speculator=NGRAM_LABEL, k=4, max_new_tokens=8)


def test_run_batch_matches_plain_batched_generate(session):
    prompts = session.check_batch(f"{word_prompt(1, 9)}\n---\n{word_prompt(2, 4)}\n---\n{word_prompt(3, 13)}")
    result = session.run_batch(prompts, session.check_settings(NGRAM_LABEL, 4, 12))
    assert result.identical and result.num_new_tokens == [12, 12, 12]
    inputs = chat_inputs(session.tokenizer, prompts)
    plain = session.model.generate(**inputs, max_new_tokens=12, do_sample=False)[:, inputs["input_ids"].shape[1]:]
    assert result.outputs == [session.tokenizer.decode(row, skip_special_tokens=True) for row in plain]
    assert result.plain_tokens_per_s > 0 and result.speculative_tokens_per_s > 0
    html = batch_html(result)
    assert "3 prompts, 36 new tokens" in html and "yes, every row" in html
    assert html.count("<tr>") == 8 + 1 + 3  # summary rows, header, one row per prompt


def test_num_new_tokens_stops_at_the_first_eos():
    generated = torch.tensor([[5, 6, 2, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert _num_new_tokens(generated, 2) == [3, 4, 1]
    assert _num_new_tokens(generated, [9, 2]) == [3, 4, 1]
    assert _num_new_tokens(generated, None) == [4, 4, 4]


# HTML ---------------------------------------------------------------------------------------------------------
class _BytePairTokenizer:
    """Decodes ids 10/11 as the two halves of one two-byte character, as a byte-level tokenizer would."""

    def decode(self, ids, skip_special_tokens=True):
        text, pending = "", False
        for i in ids:
            if i == 10:
                pending = True
            elif i == 11 and pending:
                text, pending = text + "é", False
            else:
                text += f"<{i}>" if i == 99 else "x"
        return text + ("\ufffd" if pending else "")


def test_pane_defers_a_split_character_and_escapes_html():
    pane = Pane(speculative=True)
    pane.add_step([1, 10], _BytePairTokenizer())
    pane.add_step([11, 99], _BytePairTokenizer())
    assert [(p.text, p.kind, p.step) for p in pane.pieces] == [
        ("x", "accepted", 0), ("", "target", 0), ("é", "accepted", 1), ("<99>", "target", 1)]
    html = pane_html(pane, "speculative <b>")
    assert "&lt;99&gt;" in html and "<99>" not in html and "speculative &lt;b&gt;" in html
    assert html.count('data-kind="accepted"') == 2 and 'class="sd-acc1"' in html


def test_plain_pane_has_no_accepted_tokens():
    pane = Pane(speculative=False)
    pane.add_step([1], _BytePairTokenizer())
    pane.add_step([1], _BytePairTokenizer())
    assert {p.kind for p in pane.pieces} == {"target"} and 'data-kind="accepted"' not in pane_html(pane, "plain")


# Speculators on offer -----------------------------------------------------------------------------------------
def test_draft_with_another_tokenizer_is_refused(tmp_path):
    make_model("llama", dtype=torch.float32).save_pretrained(tmp_path)
    make_tokenizer(shuffle_seed=1).save_pretrained(tmp_path)
    target = make_model("llama", dtype=torch.float32)
    with pytest.raises(hf_specdec.TokenizerMismatchError, match="does not match"):
        load_speculators(target, make_tokenizer(), [str(tmp_path)])


def test_draft_and_eagle_options(tmp_path):
    make_model("llama", dtype=torch.float32).save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    target = make_model("llama", dtype=torch.float32)
    offered = load_speculators(target, make_tokenizer(), [str(tmp_path)])
    assert list(offered) == [NGRAM_LABEL, f"draft model: {tmp_path}"]
    assert offered[f"draft model: {tmp_path}"].dtype == target.dtype
    if not hasattr(hf_specdec, "EagleSpeculator"):  # never a dead option
        with pytest.raises(ValueError, match="needs a version of hf_specdec with EagleSpeculator; drop --eagle"):
            load_speculators(target, make_tokenizer(), [], eagle="some/head")


# Launch: localhost unless told otherwise ----------------------------------------------------------------------
class _FakeApp:
    def __init__(self):
        self.launched = None

    def queue(self, **kwargs):
        self.queued = kwargs

    def launch(self, **kwargs):
        self.launched = kwargs


@pytest.mark.parametrize("argv, host", [([], "127.0.0.1"), (["--host", "0.0.0.0"], "0.0.0.0")])
def test_launch_binds_localhost_unless_a_host_is_given(monkeypatch, session, argv, host):
    pytest.importorskip("gradio")
    app = _FakeApp()
    loaded = {}

    def fake_load(model, drafts, eagle, device=None, limits=None):
        loaded.update(model=model, drafts=drafts, limits=limits)
        return session

    monkeypatch.setattr(DemoSession, "load", staticmethod(fake_load))
    monkeypatch.setattr(demo_app, "build_app", lambda s, gpu=None: app)
    args = hf_specdec.cli.build_parser().parse_args(["demo", "--no-warm-up", "--max-new-tokens", "99", *argv])
    assert args.func(args) == 0
    assert app.launched["server_name"] == host and app.launched["server_port"] == 7860
    assert app.queued["default_concurrency_limit"] == 1
    assert loaded["model"] == "smollm2-135m-instruct" and loaded["limits"].max_new_tokens == 99


def test_build_app_offers_only_what_exists(session):
    gr = pytest.importorskip("gradio")
    app = demo_app.build_app(session)
    assert isinstance(app, gr.Blocks)
    dropdowns = [b for b in app.blocks.values() if isinstance(b, gr.Dropdown) and b.label == "Speculator"]
    assert [choice[0] for choice in dropdowns[0].choices] == [NGRAM_LABEL, SELF_DRAFT]


# The Space folder -----------------------------------------------------------------------------------------------
def _load_space_app():
    spec = importlib.util.spec_from_file_location("space_app", REPO / "demos" / "space" / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_space_front_matter_and_requirements():
    readme = (REPO / "demos" / "space" / "README.md").read_text()
    front = readme.split("---\n")[1]
    fields = dict(line.split(": ", 1) for line in front.strip().splitlines())
    assert fields["sdk"] == "gradio" and fields["app_file"] == "app.py" and fields["sdk_version"]
    requirements = (REPO / "demos" / "space" / "requirements.txt").read_text()
    assert "transformers" in requirements and "torch" in requirements
    for path in (REPO / "demos").rglob("*"):
        if path.is_file() and path.suffix in (".py", ".md", ".txt"):
            assert not re.search(r"hf_[A-Za-z0-9]{30,}", path.read_text()), f"{path} looks like it holds a token"


def test_space_settings_for_cpu_and_zero_gpu(monkeypatch):
    space = _load_space_app()
    cpu = space.space_arguments({})
    assert cpu.host is None and cpu.device is None and cpu.warm_up and cpu.max_new_tokens == 256
    zero = space.space_arguments({"SPACES_ZERO_GPU": "true", "GRADIO_SERVER_NAME": "0.0.0.0",
                                  "HF_SPECDEC_MAX_NEW_TOKENS": "64"})
    assert zero.host == "0.0.0.0" and zero.device == "cuda" and not zero.warm_up and zero.max_new_tokens == 64
    assert isinstance(cpu, argparse.Namespace)

    monkeypatch.setitem(sys.modules, "spaces", None)  # not importable
    assert space.gpu_decorator() is None
    fake = types.ModuleType("spaces")
    fake.GPU = lambda duration: ("gpu decorator", duration)
    monkeypatch.setitem(sys.modules, "spaces", fake)
    assert space.gpu_decorator(90) == ("gpu decorator", 90)


def test_space_build_vendors_the_package(tmp_path):
    out = tmp_path / "space"
    subprocess.run([sys.executable, str(REPO / "demos" / "space" / "build.py"), str(out)], check=True)
    assert {"README.md", "app.py", "requirements.txt", "hf_specdec"} <= {p.name for p in out.iterdir()}
    assert (out / "hf_specdec" / "demo" / "app.py").exists() and (out / "hf_specdec" / "kernels").is_dir()
    assert not list(out.rglob("__pycache__"))
    # From the Space's folder, `import hf_specdec` finds the vendored copy (found, not imported: no torch start-up).
    found = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec("
                            "'hf_specdec').origin)"], cwd=out, capture_output=True, text=True, check=True)
    assert found.stdout.strip().startswith(str(out))
    with pytest.raises(subprocess.CalledProcessError):
        subprocess.run([sys.executable, str(REPO / "demos" / "space" / "build.py"), str(REPO / "demos" / "space")],
                       check=True, capture_output=True)


def test_eagle_head_is_offered_when_available_and_checked_against_the_target(monkeypatch):
    eagle_class = getattr(hf_specdec, "EagleSpeculator", None)
    if eagle_class is None:
        pytest.skip("this build of hf_specdec has no EagleSpeculator")
    checked = []

    class Head(hf_specdec.Speculator):
        def validate(self, target):
            checked.append(target)

    monkeypatch.setattr(eagle_class, "from_pretrained", classmethod(lambda cls, path: Head()))
    target = make_model("llama", dtype=torch.float32)
    offered = load_speculators(target, make_tokenizer(), [], eagle="heads/tiny")
    assert list(offered) == [NGRAM_LABEL, "EAGLE head: heads/tiny"] and checked == [target]


def test_a_head_is_offered_alone_and_combined_with_ngram(tmp_path):
    """A real head: offered as it is and inside a `HybridSpeculator` sharing its weights, not its per-call state;
    the combined option runs losslessly in the demo."""
    from test_eagle import convert, make_target

    target = make_target(num_layers=4, dtype=torch.float32)
    offered = load_speculators(target, make_tokenizer(), [], eagle=str(convert(tmp_path, target, 3)),
                               eagle_label="EAGLE head")
    assert list(offered) == [NGRAM_LABEL, "EAGLE head", "n-gram + EAGLE head"]
    hybrid = offered["n-gram + EAGLE head"]
    assert isinstance(hybrid, hf_specdec.HybridSpeculator)
    assert hybrid.head is not offered["EAGLE head"] and hybrid.head.head is offered["EAGLE head"].head
    session = DemoSession(target, make_tokenizer(), offered, DemoLimits(max_new_tokens=32), model_name="tiny")
    last = _run(session, word_prompt(5, 12), speculator="n-gram + EAGLE head", k=4, max_new_tokens=24)
    assert last.done and last.identical and last.metrics.num_draft_tokens > 0


def test_the_head_shipped_for_the_model_is_offered_by_default(monkeypatch):
    """`DemoSession.load` of the default model offers its shipped head (checked against the target); a model that
    ships none, or an explicit `--eagle`, gets no second head."""
    from hf_specdec.demo import session as session_module

    loaded, checked = [], []

    class Head(hf_specdec.Speculator):
        def validate(self, target):
            checked.append(target)

    monkeypatch.setattr(hf_specdec.EagleSpeculator, "from_pretrained",
                        classmethod(lambda cls, path: loaded.append(str(path)) or Head()))
    target = make_model("llama", dtype=torch.float32)
    monkeypatch.setattr(session_module, "load_model", lambda name, device=None: (target, make_tokenizer()))
    offered = DemoSession.load("smollm2-135m-instruct").speculators
    assert list(offered) == [NGRAM_LABEL, "EAGLE head trained for smollm2-135m-instruct"]
    assert loaded == [str(hf_specdec.trained_head("smollm2-135m-instruct"))] and checked == [target]
    assert list(DemoSession.load("gemma-3-270m").speculators) == [NGRAM_LABEL]
    assert list(DemoSession.load("smollm2-135m-instruct", eagle="heads/x").speculators) == [
        NGRAM_LABEL, "EAGLE head: heads/x"]


def test_app_handlers_show_messages_not_tracebacks(session, monkeypatch):
    pytest.importorskip("gradio")
    handlers = {f.name: f.fn for f in demo_app.build_app(session).fns.values()}
    settings = (NGRAM_LABEL, 4, 12, False, 0.8, 0.95, 0, "adaptive")
    with pytest.warns(UserWarning, match="The prompt is empty"):  # gr.Warning's toast, outside a request
        status, *_ = list(handlers["compare"]("  ", *settings))[-1]
    assert "sd-status-error" in status and "The prompt is empty" in status
    status, plain, speculative, metrics, chart, _ = list(handlers["compare"](word_prompt(5, 12), *settings))[-1]
    assert "Done:" in status and 'data-state="done"' in plain and "speedup" in metrics and "sd-chart" in chart
    status, result = handlers["run_batch"]("w5 w6\n---\nw7", *settings)
    assert "2 prompts in one batch" in status and "tokens/s" in result

    def broken(*args, **kwargs):
        raise FloatingPointError("the target model produced NaN or inf logits")

    monkeypatch.setattr(session.model, "generate", broken)
    status, *_ = list(handlers["compare"]("w5 w6", *settings))[-1]
    assert "Generation failed: the target model produced NaN" in status and "Traceback" not in status
    status, _ = handlers["run_batch"]("w5 w6", *settings)
    assert "Generation failed" in status


def test_a_closed_page_stops_its_run_and_leaves_the_model_usable(session):
    import threading

    from hf_specdec.demo.stream import RunCancelled, StepStreamer

    # The streamer ends a speculative generate call at its next step once cancelled...
    class CancelAfterTwoSteps(StepStreamer):
        def put(self, value):
            super().put(value)
            if self.queue.qsize() == 2:
                self.cancel()

    inputs = chat_inputs(session.tokenizer, [word_prompt(5, 12)])
    streamer = CancelAfterTwoSteps()
    with pytest.raises(RunCancelled):
        session.model.generate(**inputs, max_new_tokens=40, do_sample=False, streamer=streamer,
                               speculator=session.speculators[SELF_DRAFT], num_speculative_tokens=3)
    assert streamer.queue.qsize() == 2
    # ...and closing a comparison mid-stream cancels and joins its worker; the next run is unaffected.
    running = session.compare(word_prompt(6, 12), session.check_settings(SELF_DRAFT, 4, 64), interval_s=0)
    first = next(running)
    running.close()
    assert not first.done
    assert not [t for t in threading.enumerate() if t.name == "hf-specdec-demo-generate"]
    last = _run(session, word_prompt(5, 12), speculator=NGRAM_LABEL, k=4, max_new_tokens=40, schedule="constant")
    assert last.identical and last.speculative.num_accepted == last.metrics.num_accepted_tokens


def test_missing_gradio_is_named_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gradio", None)
    args = hf_specdec.cli.build_parser().parse_args(["demo"])
    with pytest.raises(ImportError, match=re.escape('pip install "hf_specdec[demo]"')):
        args.func(args)
