"""Speculators: what proposes draft tokens. Each implements `base.Speculator`."""

from .base import Speculator
from .draft_model import DraftModelSpeculator
from .eagle import EagleCheckpointError, EagleSpeculator
from .ngram import NgramSpeculator

__all__ = ["Speculator", "DraftModelSpeculator", "EagleCheckpointError", "EagleSpeculator", "NgramSpeculator"]
