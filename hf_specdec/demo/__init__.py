"""The demo app: plain and speculative generation streamed side by side (`hf-specdec demo`).

`session.py` runs the models and checks input (no UI), `render.py` turns results into HTML, `app.py` is the Gradio UI.
Importing this package does not import gradio.
"""

from .app import add_arguments, build_app, launch, main
from .session import NGRAM_LABEL, BatchResult, Comparison, DemoInputError, DemoLimits, DemoSession, Settings

__all__ = ["NGRAM_LABEL", "BatchResult", "Comparison", "DemoInputError", "DemoLimits", "DemoSession", "Settings",
           "add_arguments", "build_app", "launch", "main"]
