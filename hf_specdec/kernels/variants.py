"""Which compiled variants of the Triton kernels a run launches, on a GPU or under the interpreter on a CPU.

Triton compiles a kernel once per variant: its constexpr arguments, each tensor's dtype and whether its address is
16-byte aligned, each integer's type and whether it equals 1 or is a multiple of 16. A launch whose variant is new
compiles first, which costs a GPU from a fraction of a second to seconds; a server that meets one in a client's
request makes that client wait. `record_variants` keeps the key each launch looks up in Triton's kernel cache,
computed by Triton's own argument binder for a CUDA target (`create_function_from_signature`), so the same record
comes out of an interpreted run on a CPU: the serving engine's warm-up is tested on a CPU against the variants
that a mix of later requests launches (tests/test_serving.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class VariantRecord:
    """The variants launched while recording: `(kernel, key)` pairs, and how many launches in all."""

    seen: set[tuple[str, str]] = field(default_factory=set)
    launches: int = 0

    def kernels(self) -> set[str]:
        return {name for name, _ in self.seen}


def _our_kernels() -> dict:
    from .paged_attention import triton_kernel as attention
    from .rejection_sample import triton_kernel as rejection
    from .sampling import triton_kernel as sampling

    return {"paged_attention": attention._paged_attention_kernel,
            "rejection_sample": rejection._rejection_sample_kernel,
            "sampling_params": sampling._sampling_params_kernel}


def _binder(kernel, target: tuple[str, int, int]):
    """Triton's argument binder for `kernel` as a CUDA device of compute capability `target[1]` would build it:
    it returns the launch's specialization and options, from which the kernel cache's key is made."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit as triton_jit

    if not hasattr(triton_jit, "create_function_from_signature"):
        raise RuntimeError(f"recording kernel variants needs Triton's argument binder "
                           f"(triton.runtime.jit.create_function_from_signature), which triton {triton.__version__} "
                           "lacks; install a newer triton")
    JITFunction, create_function_from_signature = triton_jit.JITFunction, triton_jit.create_function_from_signature

    # Under the interpreter `triton.jit` made an `InterpretedFunction`; the binder needs the JIT's parsed signature.
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    return create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget(*target)))


@contextmanager
def record_variants(target: tuple[str, int, int] = ("cuda", 90, 32)):
    """Within the block, every launch of hf_specdec's Triton kernels adds its variant to the `VariantRecord` it
    yields (the launch itself runs as usual). `target`: the `GPUTarget` whose specialization rules apply, by
    default a Hopper GPU's."""
    record = VariantRecord()
    kernels = _our_kernels()
    patched = []  # (kernel, the `run` it held as its own attribute, or None)
    try:
        for name, kernel in kernels.items():
            binder, original = _binder(kernel, target), kernel.run
            own = vars(kernel).get("run")  # a recording already in progress (nested), or anyone's patch

            def run(*args, grid, warmup, _name=name, _binder=binder, _original=original, **kwargs):
                _, specialization, options = _binder(*args, **kwargs)
                record.seen.add((_name, repr(specialization) + repr(sorted(options.items()))))
                record.launches += 1
                return _original(*args, grid=grid, warmup=warmup, **kwargs)

            kernel.run = run  # shadows the class's `run`, which `kernel[grid](...)` calls
            patched.append((kernel, own))
        yield record
    finally:
        for kernel, own in reversed(patched):
            if own is None:
                del kernel.run
            else:
                kernel.run = own
