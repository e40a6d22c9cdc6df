"""Errors raised before any token is generated, and the one log filter the package installs."""

from __future__ import annotations

import logging
from contextlib import contextmanager


class UnsupportedModelError(ValueError):
    """The model cannot be decoded speculatively by hf_specdec."""


class _DropKnownSkewMessages(logging.Filter):
    """Drops the two messages torchao 0.18's import gives under torch 2.13 (see `torchao_skew_messages_dropped`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cuda_kernel = message.startswith("Failed to load ") and "/torchao/_C" in message
        enum_constant = "is an Enum subclass" in message and "register_constant()" in message
        return not (cuda_kernel or enum_constant)


@contextmanager
def torchao_skew_messages_dropped():
    """Runs the first import of transformers' model code without torchao's two version-skew messages.

    transformers imports torchao, when installed, as soon as its model code loads (`transformers.quantizers`).
    torchao 0.18, the newest release, predates torch 2.13: its PyPI wheel carries CUDA kernels (`_C_cutlass_90a`,
    `_C_mxfp8`) that a CPU build of torch cannot load, logged as "Failed to load .../torchao/_C_*.so", and it
    registers its Enum types with a pytree call torch 2.13 deprecates, logged as one "W... _pytree.py ...
    register_constant()" line per type. Neither changes what hf_specdec uses torchao for (fp8 weight-only drafts, on
    its Python path), so exactly those messages are dropped inside this block; anything else still shows.
    """
    loggers = [logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")]
    quiet = _DropKnownSkewMessages()
    for each in loggers:
        each.addFilter(quiet)
    try:
        yield
    finally:
        for each in loggers:
            each.removeFilter(quiet)
