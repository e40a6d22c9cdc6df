"""The Gradio app: one prompt streamed through plain and speculative generation side by side, and a batch mode.

`hf-specdec demo` and `python demos/app.py` start it. Gradio is imported only when the app is built, so the rest
of hf_specdec does not need it (`pip install "hf_specdec[demo]"` brings it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Callable

from ..costs.calibration import calibrate, enabled
from ..extraction import ITEMS as EXTRACTION_ITEMS
from ..extraction import extraction_prompt
from ..models import DEFAULT_MODEL
from ..speculators.resolve import resolve_speculator
from ..workloads import GROUNDED, OPEN_CHAT
from .render import CSS, LEGEND, batch_html, chart_html, metrics_html, pane_html, status_html
from .session import DemoInputError, DemoLimits, DemoSession

logger = logging.getLogger("hf_specdec.demo")

EXAMPLES = {**{f"grounded: {name}": text for name, text in GROUNDED.items()},
            **{f"open chat: {name}": text for name, text in OPEN_CHAT.items()}}
# JSON mode examples: a passage and the schema its fields go into (the prompt shows the schema too).
JSON_EXAMPLES = {f"json: {passage.split(',')[0].split('.')[0][:40]}": (extraction_prompt(passage, schema),
                                                                     json.dumps(schema, indent=2))
                 for passage, schema in EXTRACTION_ITEMS}
DEFAULT_HOST = "127.0.0.1"


def json_view(text: str, done: bool) -> str:
    """The speculative output laid out as JSON once it parses; the raw text (with a note) while it does not."""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        note = "(not complete JSON yet)" if not done else "(incomplete: raise max new tokens)"
        return f"{text}\n\n{note}" if text else ""


def _import_gradio():
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no calls home from a demo
    try:
        import gradio
    except ImportError:
        raise ImportError('the demo needs gradio: pip install "hf_specdec[demo]" (or pip install gradio)') from None
    return gradio


def build_app(session: DemoSession, gpu: Callable | None = None):
    """Builds the Gradio `Blocks` app for a loaded `DemoSession`.

    Args:
        session (`DemoSession`): the target, its tokenizer and the speculators on offer.
        gpu (`Callable`, *optional*): a decorator for the functions that run the models, such as ZeroGPU's
            `spaces.GPU`; `None` runs them as they are.
    Returns:
        `gradio.Blocks`: call `.queue()` and `.launch()` on it (see `launch`).
    """
    gr = _import_gradio()
    wrap = gpu or (lambda fn: fn)
    limits = session.limits

    def compare(prompt, speculator, k, max_new_tokens, do_sample, temperature, top_p, seed, schedule, json_mode=False,
                json_schema=""):
        skip = (gr.skip(),) * 5
        try:
            settings = session.check_settings(speculator, k, max_new_tokens, do_sample, temperature, top_p, seed,
                                              schedule, json_mode, json_schema)
            running = ""
            for state in session.compare(prompt, settings):
                now = "Running speculative generation..." if state.plain.done else "Running plain generate..."
                status = (f"Done: {state.speedup:.2f}x the plain tokens/s, acceptance rate "
                          f"{state.metrics.acceptance_rate:.2f}." if state.metrics is not None else now)
                shown = json_view(state.speculative.text, state.metrics is not None) if json_mode else ""
                yield (status_html(status) if status != running else gr.skip(),
                       pane_html(state.plain, "plain generate"), pane_html(state.speculative, "speculative"),
                       metrics_html(state), chart_html(state.metrics), gr.update(value=shown, visible=json_mode))
                running = status
        except DemoInputError as error:
            gr.Warning(str(error))
            yield status_html(str(error), error=True), *skip
        except Exception as error:  # shown as one line; the traceback goes to the server log only
            logger.exception("demo generation failed")
            yield status_html(f"Generation failed: {error}", error=True), *skip

    def run_batch(text, speculator, k, max_new_tokens, do_sample, temperature, top_p, seed, schedule,
                  json_mode=False, json_schema=""):
        try:
            settings = session.check_settings(speculator, k, max_new_tokens, do_sample, temperature, top_p, seed,
                                              schedule, json_mode, json_schema)
            result = session.run_batch(session.check_batch(text), settings)
            return status_html(f"Done: {len(result.prompts)} prompts in one batch."), batch_html(result)
        except DemoInputError as error:
            gr.Warning(str(error))
            return status_html(str(error), error=True), gr.skip()
        except Exception as error:
            logger.exception("demo batch failed")
            return status_html(f"Generation failed: {error}", error=True), gr.skip()

    with gr.Blocks(title="hf_specdec: speculative decoding demo", analytics_enabled=False) as app:
        gr.Markdown(
            f"# Speculative decoding, side by side\nTarget model: `{session.model_name}` on "
            f"`{session.model.device}`. The same prompt runs through plain `generate`, then through speculative "
            "generation (one after the other, so their timings do not compete for the same cores). Under greedy "
            "decoding both outputs are identical; the speculative one just takes fewer target forwards.")
        with gr.Row():
            speculator = gr.Dropdown(list(session.speculators), value=next(iter(session.speculators)),
                                     label="Speculator")
            k = gr.Number(5, label=f"k: most drafts per step (1 to {limits.max_k})", precision=0)
            schedule = gr.Radio(["adaptive", "constant"], value="adaptive", label="k schedule")
            max_new_tokens = gr.Number(min(128, limits.max_new_tokens), precision=0,
                                       label=f"Max new tokens (at most {limits.max_new_tokens})")
        with gr.Row():
            do_sample = gr.Checkbox(False, label="Sample (otherwise greedy)")
            temperature = gr.Number(0.8, label="Temperature")
            top_p = gr.Number(0.95, label="Top-p")
            seed = gr.Number(0, label="Seed", precision=0)
        with gr.Accordion("JSON mode", open=False):
            with gr.Row():
                json_mode = gr.Checkbox(False, label="JSON output (both runs follow the schema, exactly)",
                                        elem_id="json-mode")
                json_example = gr.Dropdown(list(JSON_EXAMPLES), value=None, label="Extraction example")
            json_schema = gr.Code("", language="json", label="JSON schema (empty: any JSON)", elem_id="json-schema")
        settings = [speculator, k, max_new_tokens, do_sample, temperature, top_p, seed, schedule, json_mode,
                    json_schema]
        with gr.Tab("Compare"):
            with gr.Row():
                prompt = gr.Textbox(label="Prompt", lines=4, scale=4, max_length=limits.max_prompt_chars,
                                    placeholder="Type a prompt, or pick a built-in example")
                example = gr.Dropdown(list(EXAMPLES), value=None, label="Built-in example", scale=1)
            button = gr.Button("Generate", variant="primary", elem_id="generate")
            status = gr.HTML(elem_id="status", js_on_load=None)
            gr.HTML(LEGEND, js_on_load=None)
            with gr.Row(equal_height=True):
                plain_pane = gr.HTML(pane_html(None, "plain generate"), elem_id="plain-pane", js_on_load=None)
                spec_pane = gr.HTML(pane_html(None, "speculative"), elem_id="spec-pane", js_on_load=None)
            json_output = gr.Code("", language="json", label="Speculative output as JSON", visible=False,
                                  elem_id="json-output")
            with gr.Row():
                metrics = gr.HTML(elem_id="metrics", js_on_load=None)
                chart = gr.HTML(elem_id="chart", js_on_load=None)
        with gr.Tab("Batch"):
            batch_prompts = gr.Textbox(label="Prompts (separate them with a line holding only ---)", lines=8,
                                       max_length=limits.max_batch_prompts * (limits.max_prompt_chars + 5))
            with gr.Row():
                load_builtin = gr.Button("Load the built-in prompts")
                batch_button = gr.Button("Run batch", variant="primary", elem_id="run-batch")
            batch_status = gr.HTML(elem_id="batch-status", js_on_load=None)
            batch_result = gr.HTML(elem_id="batch-result", js_on_load=None)

        example.change(lambda name: EXAMPLES.get(name, gr.skip()) if name else gr.skip(), example, prompt)
        json_example.change(lambda name: (*JSON_EXAMPLES[name], True) if name else (gr.skip(),) * 3, json_example,
                            [prompt, json_schema, json_mode])
        outputs = [status, plain_pane, spec_pane, metrics, chart, json_output]
        button.click(wrap(compare), [prompt, *settings], outputs)
        prompt.submit(wrap(compare), [prompt, *settings], outputs)
        builtin = list(EXAMPLES.values())[: limits.max_batch_prompts]
        load_builtin.click(lambda: "\n---\n".join(builtin), None, batch_prompts)
        batch_button.click(wrap(run_batch), [batch_prompts, *settings], [batch_status, batch_result])
    return app


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's command-line options (shared by `hf-specdec demo` and `python demos/app.py`)."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help="embedded model name, hub id or path")
    parser.add_argument("--draft", action="append", default=[], metavar="MODEL",
                        help="offer this draft model (name, id or path sharing the target's tokenizer); repeatable")
    parser.add_argument("--eagle", default=None, metavar="HEAD",
                        help="offer this EAGLE head (default: the head shipped for --model, when one ships)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--host", default=None,
                        help=f"address to bind (default {DEFAULT_HOST}; 0.0.0.0 exposes the app to your network)")
    parser.add_argument("--port", type=int, default=7860)
    parser.add_argument("--max-new-tokens", type=int, default=DemoLimits.max_new_tokens,
                        help="cap on new tokens per request")
    parser.add_argument("--max-prompt-tokens", type=int, default=DemoLimits.max_prompt_tokens,
                        help="cap on prompt length in tokens")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="skip the short warm-up runs at start")
    return parser


def launch(args: argparse.Namespace, gpu: Callable | None = None) -> int:
    """Loads the models named in `args`, builds the app and serves it until interrupted."""
    import torch

    gr = _import_gradio()
    for name, value in (("--max-new-tokens", args.max_new_tokens), ("--max-prompt-tokens", args.max_prompt_tokens)):
        if value < 1:
            raise SystemExit(f"{name} must be at least 1, got {value}")
    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    limits = DemoLimits(max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens)
    session = DemoSession.load(args.model, args.draft, args.eagle, device=device, limits=limits)
    if args.warm_up:
        if enabled():
            calibrate(session.model, [resolve_speculator(s) for s in session.speculators.values()
                                      if not isinstance(s, str)], retry=False)
        session.warm_up()
    app = build_app(session, gpu)
    app.queue(default_concurrency_limit=1, max_size=32)  # one generation at a time keeps timings honest
    app.launch(server_name=args.host or DEFAULT_HOST, server_port=args.port, css=CSS, theme=gr.themes.Default(),
               footer_links=[], show_error=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="hf-specdec demo", description=__doc__.splitlines()[0]))
    return launch(parser.parse_args(argv))
