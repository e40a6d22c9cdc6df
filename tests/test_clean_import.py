"""`import hf_specdec` prints nothing, even with torchao installed next to a torch it predates."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from hf_specdec.errors import _DropKnownSkewMessages, torchao_skew_messages_dropped


def test_first_import_prints_nothing():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", "import hf_specdec"], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout + result.stderr == ""


def test_only_the_two_version_skew_messages_are_dropped(caplog):
    def record(name, message):
        return logging.LogRecord(name, logging.WARNING, __file__, 1, message, None, None)

    quiet = _DropKnownSkewMessages()
    assert not quiet.filter(record("torchao", "Failed to load /x/site-packages/torchao/_C_mxfp8.so: Could not load"))
    assert not quiet.filter(record("torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now "
                                   "natively supported ... Calling register_constant() on Enum subclasses is "
                                   "deprecated"))
    assert quiet.filter(record("torchao", "Failed to load /x/model.safetensors"))
    assert quiet.filter(record("torchao", "Skipping import of cpp extensions due to incompatible torch version"))
    with caplog.at_level(logging.WARNING), torchao_skew_messages_dropped():
        logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_cutlass_90a.abi3.so: no CUDA")
        logging.getLogger("torchao").warning("anything else")
    assert [r.getMessage() for r in caplog.records] == ["anything else"]
    assert not logging.getLogger("torchao").filters  # the filter is gone after the block
