"""Triton kernels for the verify step, each beside a plain PyTorch reference.

A subpackage of hf_specdec, imported only as `hf_specdec.kernels`: PyPI's `kernels` package exists and transformers
probes for it, so this folder must never be importable as a top-level `kernels` (tests/test_layers.py checks both).
"""
