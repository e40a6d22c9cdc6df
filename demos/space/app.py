"""Hugging Face Space entry point for the hf_specdec demo (CPU, GPU and ZeroGPU hardware).

The Space runs `python app.py`. It serves the same app as `hf-specdec demo`, with the Space's limits:
- CPU hardware: the model runs on the CPU.
- GPU hardware: the model runs on `cuda`.
- ZeroGPU: when the `spaces` package is importable, the functions that run the models are wrapped in `spaces.GPU`
  (a no-op off ZeroGPU); on ZeroGPU (`SPACES_ZERO_GPU` set) the model is placed on `cuda` at start, as ZeroGPU asks,
  and the warm-up runs are skipped because a GPU is only attached inside the wrapped functions.
Settings come from the environment (Space variables), never from secrets: `HF_SPECDEC_MODEL` (default: the
embedded SmolLM2-135M-Instruct), `HF_SPECDEC_MAX_NEW_TOKENS` (default 256), `GRADIO_SERVER_NAME` (Spaces set
0.0.0.0; elsewhere the app binds 127.0.0.1) and `GRADIO_SERVER_PORT` (default 7860).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

try:
    import spaces  # noqa: F401  (first, before torch: on ZeroGPU it patches torch as torch is imported)
except ImportError:
    pass
try:
    import hf_specdec  # noqa: F401  (vendored beside this file by build.py, or pip-installed)
except ImportError:  # run from a checkout: demos/space/app.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_specdec.demo import add_arguments, launch


def gpu_decorator(duration_s: int = 120):
    """`spaces.GPU(duration=...)` when the `spaces` package is importable, else `None` (run as is)."""
    try:
        import spaces
    except ImportError:
        return None
    return spaces.GPU(duration=duration_s)


def zero_gpu(environ=os.environ) -> bool:
    """Whether this is ZeroGPU hardware (the variable the `spaces` package itself reads)."""
    return environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")


def space_arguments(environ=os.environ) -> argparse.Namespace:
    """The demo's options for a Space, read from its environment variables."""
    args = add_arguments(argparse.ArgumentParser()).parse_args([])
    args.model = environ.get("HF_SPECDEC_MODEL", args.model)
    args.max_new_tokens = int(environ.get("HF_SPECDEC_MAX_NEW_TOKENS", 256))
    args.host = environ.get("GRADIO_SERVER_NAME") or None  # None: the app's default, 127.0.0.1
    args.port = int(environ.get("GRADIO_SERVER_PORT", 7860))
    if zero_gpu(environ):
        args.device, args.warm_up = "cuda", False
    return args


if __name__ == "__main__":
    raise SystemExit(launch(space_arguments(), gpu=gpu_decorator()))
