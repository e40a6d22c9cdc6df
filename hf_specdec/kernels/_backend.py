"""Which implementation an op runs: `backend="auto" | "torch" | "triton"`.

`auto` is triton on CUDA tensors (when triton imports) and torch elsewhere. The environment variable
`HF_SPECDEC_KERNEL_BACKEND` (`torch` or `triton`) overrides `auto` everywhere the engine calls these ops, so the whole
engine can run its Triton kernels on a CPU under `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "torch", "triton")
ENV_VAR = "HF_SPECDEC_KERNEL_BACKEND"


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Returns `"torch"` or `"triton"` for an op on `device`, or raises a clear error.

    Args:
        backend: `"auto"`, `"torch"` or `"triton"`. `"auto"` defers to `HF_SPECDEC_KERNEL_BACKEND` when it is set.
        device: where the op's tensors live.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        forced = os.environ.get(ENV_VAR, "").strip().lower()
        if forced:
            if forced not in ("torch", "triton"):
                raise ValueError(f"{ENV_VAR} must be 'torch' or 'triton', got {forced!r}")
            backend = forced
        else:
            return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the triton package: pip install triton (or use backend='torch')")
        if torch.device(device).type != "cuda" and not interpreting():
            raise RuntimeError(
                f"backend='triton' on {torch.device(device).type} tensors needs TRITON_INTERPRET=1 set before triton "
                "is imported (the Triton interpreter); on this device use backend='torch'"
            )
    return backend


def check_tensor(name: str, tensor: torch.Tensor, shape: tuple, dtypes: tuple, device: torch.device,
                 contiguous_last: bool = True) -> None:
    """Launcher checks: a clear error for the wrong rank, sizes (None = any), dtype, device or inner stride."""
    if tensor.dim() != len(shape) or any(s is not None and s != t for s, t in zip(shape, tensor.shape)):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {expected}, got {list(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the op runs on {device}; move it there first")
    if contiguous_last and tensor.dim() and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {tensor.stride()}")
