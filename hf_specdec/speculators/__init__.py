"""Speculators: what proposes draft tokens. Each implements `base.Speculator`."""

from .base import Speculator
from .draft_model import DraftModelSpeculator
from .eagle import EagleSpeculator
from .heads import EagleCheckpointError
from .hybrid import HybridSpeculator
from .medusa import MedusaSpeculator
from .mlp import MlpSpeculator
from .ngram import NgramSpeculator

__all__ = ["Speculator", "DraftModelSpeculator", "EagleCheckpointError", "EagleSpeculator", "HybridSpeculator",
           "MedusaSpeculator", "MlpSpeculator", "NgramSpeculator"]
