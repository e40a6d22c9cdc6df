"""What the benchmark scripts share: the one way a script loads its model and tokenizer and builds its prompts, and
the options that choose them (`--model`, `--dtype`, `--device`, `--threads`).

A script in benchmarks/ imports it as `import _common` (Python puts the script's own folder on `sys.path`).

    parser = argparse.ArgumentParser()
    _common.add_model_args(parser)
    args = parser.parse_args()
    model, tokenizer = _common.load(args)
    inputs = _common.chat_batch(tokenizer, "open_chat", rows=16, device=model.device)
"""

from __future__ import annotations

import argparse

import torch

from hf_specdec.models import DEFAULT_MODEL, load_model, parse_dtype
from hf_specdec.tools.serve_bench import workload
from hf_specdec.workloads import GROUNDED, HELD_OUT, OPEN_CHAT, chat_inputs

# The built-in prompts by workload, each prompt under a name: the benchmark's two workloads, and the hand-written
# open-chat prompts held out from every head's training (for measuring heads).
WORKLOADS = {"grounded": GROUNDED, "open_chat": OPEN_CHAT,
             "held_out": {f"held_out_{i}": prompt for i, prompt in enumerate(HELD_OUT)}}
OPTIONS = ("model", "dtype", "device", "threads")


def add_model_args(parser: argparse.ArgumentParser, *, dtype: str | None = None, device: str | None = None,
                   threads: int | None = 2, options: tuple[str, ...] = OPTIONS) -> argparse.ArgumentParser:
    """Adds the options `load` reads: `--model`, `--dtype`, `--device`, `--threads`, or only those in `options`
    (a script that cannot run on another device leaves `device` out). The keywords are the script's defaults;
    `threads=None` keeps torch's own thread count."""
    if "model" in options:
        parser.add_argument("--model", default=DEFAULT_MODEL,
                            help=f"embedded model name, hub id or local path (default: {DEFAULT_MODEL})")
    if "dtype" in options:
        own = "the model's own: float32 for the embedded models"
        parser.add_argument("--dtype", default=dtype, type=_dtype_name,
                            help=f"torch dtype, e.g. float32 or bfloat16 (default: {dtype or own})")
    if "device" in options:
        parser.add_argument("--device", default=device, help=f"e.g. cuda (default: {device or 'the CPU'})")
    if "threads" in options:
        parser.add_argument("--threads", type=int, default=threads,
                            help=f"torch CPU threads (default: {threads or 'as torch starts'})")
    return parser


def _dtype_name(name: str) -> str:
    try:
        parse_dtype(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return name


def load(args: argparse.Namespace | None = None, **given):
    """`(model, tokenizer)`: the model `--model` names (`hf_specdec.models.load_model`), in `--dtype`, on `--device`,
    after setting torch's CPU threads to `--threads`. `given` (model=, dtype=, device=, threads=) takes the place
    of `args` or overrides it; an option neither has keeps its default (the embedded SmolLM2, its own dtype, the
    CPU, torch's threads). `dtype` is a name or a `torch.dtype`."""
    options = {"model": DEFAULT_MODEL, "dtype": None, "device": None, "threads": None,
               **(vars(args) if args is not None else {}), **given}
    if options["threads"]:
        torch.set_num_threads(options["threads"])
    dtype = options["dtype"]
    dtype = dtype if dtype is None or isinstance(dtype, torch.dtype) else parse_dtype(dtype)
    return load_model(options["model"], dtype=dtype, device=options["device"])


def prompt_texts(name: str) -> list[str]:
    """The built-in prompts of workload `name` ("grounded", "open_chat" or "held_out")."""
    return list(WORKLOADS[name].values())


def chat_batch(tokenizer, prompts: str | list[str], rows: int | None = None, device=None):
    """Chat inputs (`input_ids`, `attention_mask`, left-padded) of `prompts`, a workload's name or a list of
    prompts, cycled to `rows` rows (default: one per prompt), on `device` (default: the CPU)."""
    texts = prompt_texts(prompts) if isinstance(prompts, str) else list(prompts)
    inputs = chat_inputs(tokenizer, [texts[i % len(texts)] for i in range(rows or len(texts))])
    return inputs if device is None else inputs.to(device)


def serve_requests(tokenizer, num_requests: int = 32) -> list[tuple[list[int], int]]:
    """`hf-specdec bench-serve`'s requests, `(prompt ids, max tokens)` each: grounded and open-chat prompts
    alternating, answer lengths mixed."""
    return workload(tokenizer, num_requests)
