"""Speculators: what proposes draft tokens. Each implements `Speculator` (`hf_specdec/decode/speculator.py`)."""

from ..decode.speculator import Speculator
from .draft_model import DraftModelSpeculator
from .eagle import EagleSpeculator
from .grammar import GrammarSpeculator
from .heads import EagleCheckpointError
from .hybrid import HybridSpeculator
from .medusa import MedusaSpeculator
from .mlp import MlpSpeculator
from .ngram import NgramSpeculator
from .off import NoDraftSpeculator
from .resolve import resolve_speculator

__all__ = ["Speculator", "DraftModelSpeculator", "EagleCheckpointError", "EagleSpeculator", "GrammarSpeculator",
           "HybridSpeculator",
           "MedusaSpeculator", "MlpSpeculator", "NgramSpeculator", "NoDraftSpeculator", "resolve_speculator"]
