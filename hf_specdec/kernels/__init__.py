"""Triton kernels for the verify step, each beside a plain PyTorch reference.

Installed and imported only as `hf_specdec.kernels` (see pyproject's package-dir mapping): PyPI's `kernels`
package exists and transformers probes for it, so this folder must never be importable as a top-level `kernels`.
"""
