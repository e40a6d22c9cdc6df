"""The demo app: plain and speculative generation streamed side by side (`hf-specdec demo`).

`session.py` checks input and runs the models (no UI), `stream.py` holds what a streamed run produced,
`render.py` turns it into HTML, `app.py` is the Gradio UI.
Importing this package does not import gradio.
"""

from .app import add_arguments, build_app, launch, main
from .session import DemoInputError, DemoLimits, DemoSession
from .stream import NGRAM_LABEL, BatchResult, Comparison, Settings

__all__ = ["NGRAM_LABEL", "BatchResult", "Comparison", "DemoInputError", "DemoLimits", "DemoSession", "Settings",
           "add_arguments", "build_app", "launch", "main"]
