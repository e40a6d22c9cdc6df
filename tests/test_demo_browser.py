"""The demo app as a person uses it: started on a free local port, driven in headless Chromium through Playwright.

Skipped (not failed) when gradio, playwright or Chromium is missing; .ci/run installs all three.
By default the app serves a tiny random-init model with itself as draft model (start-up in seconds, every draft
accepted). `HF_SPECDEC_DEMO_MODEL=smollm2-135m-instruct` runs the same test on the embedded default model instead,
and `HF_SPECDEC_DEMO_SCREENSHOT=docs/demo.png` copies the screenshot there (that is how docs/demo.png is made).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from conftest import make_model, make_tokenizer, word_prompt

pytestmark = pytest.mark.slow  # a real browser

CHROMIUM = os.environ.get("HF_SPECDEC_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parents[1]
REAL_MODEL = os.environ.get("HF_SPECDEC_DEMO_MODEL")



def _missing(reason: str):
    # .ci/run sets HF_SPECDEC_REQUIRE_BROWSER_TEST so that a missing piece fails CI instead of skipping the test.
    if os.environ.get("HF_SPECDEC_REQUIRE_BROWSER_TEST"):
        raise RuntimeError(f"the browser test cannot run: {reason}")
    pytest.skip(reason, allow_module_level=True)


try:
    import gradio  # noqa: F401
    from playwright import sync_api
except ImportError as error:
    _missing(f"{error.name} is not installed (pip install -e '.[test]')")
if not Path(CHROMIUM).exists():
    _missing(f"no Chromium at {CHROMIUM} (apt-get install chromium)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_serving(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the demo exited with {process.returncode} before serving:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the demo did not serve {url} within {timeout_s} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory):
    """Starts `python demos/app.py` on a free port (default host) and yields its URL."""
    tmp = tmp_path_factory.mktemp("demo")
    if REAL_MODEL:
        args = ["--model", REAL_MODEL]
    else:
        model_dir = tmp / "tiny-llama"
        make_model("llama", dtype=torch.float32).save_pretrained(model_dir)
        make_tokenizer().save_pretrained(model_dir)
        args = ["--model", str(model_dir), "--draft", str(model_dir), "--max-new-tokens", "64"]
    port = _free_port()
    log = tmp / "demo.log"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    env.pop("GRADIO_SERVER_NAME", None)  # the default host is part of what is tested
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, str(REPO / "demos" / "app.py"), *args, "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_until_serving(url, process, log, timeout_s=300 if REAL_MODEL else 120)
        assert f"Running on local URL:  http://127.0.0.1:{port}" in log.read_text()
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def page(demo_url):
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(30_000)
        page.goto(demo_url)
        yield page
        browser.close()


def _choose(page, label: str, option: str | re.Pattern) -> None:
    page.get_by_label(label).click()
    page.get_by_role("option", name=option).click()


def _generate_and_wait_for_status(page, expected: str) -> str:
    page.get_by_role("button", name="Generate").click()
    status = page.locator("#status")
    sync_api.expect(status).to_contain_text(expected, timeout=30_000)
    return status.inner_text()


def test_bad_input_gets_a_visible_message(page):
    page.get_by_label("Prompt").fill("   ")
    assert "prompt is empty" in _generate_and_wait_for_status(page, "prompt is empty")
    page.get_by_label("Prompt").fill("hello")
    k = page.get_by_label("k: most drafts per step (1 to 16)")
    k.fill("0")
    assert "from 1 to 16" in _generate_and_wait_for_status(page, "k (drafts per step) is 0")
    k.fill("5")
    cap = page.get_by_label("Max new tokens", exact=False)
    cap.fill("100000")
    assert "max new tokens is 100000" in _generate_and_wait_for_status(page, "max new tokens is 100000")
    cap.fill("16")
    assert "Traceback" not in page.content()


def test_compare_streams_both_panes_with_highlighted_drafts_and_metrics(page, tmp_path):
    if REAL_MODEL:
        _choose(page, "Built-in example", "grounded: repeat_summarise")
        sync_api.expect(page.get_by_label("Prompt")).to_have_value(re.compile(r"^Here is a news report"))
        new_tokens = "96"
    else:
        page.get_by_label("Prompt").fill(word_prompt(5, 12))
        _choose(page, "Speculator", re.compile(r"^draft model: "))
        page.get_by_label("constant").check()
        new_tokens = "48"
    page.get_by_label("Max new tokens", exact=False).fill(new_tokens)
    page.get_by_role("button", name="Generate").click()
    # Both panes fill (plain first, then speculative), then the metrics and the chart appear.
    sync_api.expect(page.locator("#plain-pane .sd-pane[data-state=done]")).to_have_count(1, timeout=180_000)
    sync_api.expect(page.locator("#spec-pane .sd-pane[data-state=done]")).to_have_count(1, timeout=180_000)
    sync_api.expect(page.locator("#metrics")).to_contain_text("speedup", timeout=30_000)

    plain = page.locator("#plain-pane .sd-pane").inner_text()
    speculative = page.locator("#spec-pane .sd-pane").inner_text()
    assert plain.strip() and plain == speculative  # greedy: identical text
    assert "tokens/s" in page.locator("#plain-pane").inner_text()
    assert "tokens/s" in page.locator("#spec-pane").inner_text()
    metrics = page.locator("#metrics").inner_text()
    assert "yes, token for token" in metrics and "acceptance rate" in metrics
    accepted = page.locator("#spec-pane [data-kind=accepted]")
    assert accepted.count() > 0  # highlighted accepted drafts
    assert page.locator("#spec-pane [data-kind=target]").count() > 0
    colour = accepted.first.evaluate("e => getComputedStyle(e).backgroundColor")
    assert colour not in ("rgba(0, 0, 0, 0)", "transparent")
    assert page.locator("#plain-pane [data-kind=accepted]").count() == 0
    assert page.locator("#chart .sd-bar-row").count() >= 1
    assert "Done:" in page.locator("#status").inner_text()

    shot = tmp_path / "demo.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("HF_SPECDEC_DEMO_SCREENSHOT"):
        shutil.copy(shot, os.environ["HF_SPECDEC_DEMO_SCREENSHOT"])


def test_batch_mode_shows_throughput(page):
    page.get_by_role("tab", name="Batch").click()
    prompts = [word_prompt(7, 9), word_prompt(8, 5), word_prompt(9, 13)]
    page.get_by_label("Prompts", exact=False).fill("\n---\n".join(prompts))
    page.get_by_label("Max new tokens", exact=False).fill("16")
    page.get_by_role("button", name="Run batch").click()
    result = page.locator("#batch-result")
    sync_api.expect(result).to_contain_text("tokens/s", timeout=180_000)
    text = result.inner_text()
    assert "3 prompts" in text and "speedup" in text and "yes, every row" in text
    assert result.locator("tr").count() == 8 + 1 + 3  # summary rows, header, one row per prompt
    assert "Traceback" not in page.content()

