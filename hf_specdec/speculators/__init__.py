"""Speculators: what proposes draft tokens. Each implements `base.Speculator`."""

from .base import Speculator
from .draft_model import DraftModelSpeculator
from .eagle import EagleSpeculator
from .heads import EagleCheckpointError
from .ngram import NgramSpeculator

__all__ = ["Speculator", "DraftModelSpeculator", "EagleCheckpointError", "EagleSpeculator", "NgramSpeculator"]
