"""Speculators: what proposes draft tokens. Each implements `base.Speculator`."""

from .base import Speculator
from .draft_model import DraftModelSpeculator
from .ngram import NgramSpeculator

__all__ = ["Speculator", "DraftModelSpeculator", "NgramSpeculator"]
