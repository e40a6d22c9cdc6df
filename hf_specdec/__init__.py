"""hf_specdec: batched, lossless speculative decoding for Hugging Face Transformers.

`import hf_specdec` registers the generation strategy, so `model.generate(**inputs, speculator=...)` runs
speculative decoding. Importing does no network access and writes no files.
"""

from .cache.block_manager import BlockManager, OutOfBlocksError
from .cache.paged import PagedKVCache, release_kv_pools
from .costs.step_cost import StepCost
from .decode.engine import SpeculativeEngine
from .decode.verify import verify
from .errors import UnsupportedModelError
from .generation import SpeculativeGenerateOutput, register_generation_strategy
from .metrics import SpeculativeMetrics
from .models import trained_head
from .pipeline import SpeculativeTextGenerationPipeline, register_pipeline
from .quantization import QuantizationUnavailableError, load_draft
from .quantized_checkpoint import QuantizedCheckpointError
from .serving import SamplingParams, ServingEngine, generate_batch
from .speculators import (
    DraftModelSpeculator,
    EagleCheckpointError,
    EagleSpeculator,
    GrammarSpeculator,
    HybridSpeculator,
    MedusaSpeculator,
    MlpSpeculator,
    NgramSpeculator,
    NoDraftSpeculator,
    Speculator,
)
from .speculators.convert_eagle import convert_eagle
from .speculators.convert_head import convert_head
from .speculators.head_format import HeadCheckpointError
from .speculators.resolve import resolve_speculator
from .structured.grammar import Grammar, GrammarError, StructuredOutputUnavailableError
from .tokenizers import TokenizerMismatchError, check_tokenizers_match
from .train_eagle import TrainingSet, build_training_set, train_eagle_head
from .types import DraftProposal, VerifyResult

__version__ = "0.1.0"

register_generation_strategy()
register_pipeline()

__all__ = [
    "BlockManager", "DraftModelSpeculator", "DraftProposal", "EagleCheckpointError", "EagleSpeculator",
    "NgramSpeculator", "OutOfBlocksError", "PagedKVCache", "QuantizationUnavailableError", "QuantizedCheckpointError",
    "SpeculativeEngine", "SpeculativeGenerateOutput", "NoDraftSpeculator", "SpeculativeMetrics", "SpeculativeTextGenerationPipeline",
    "Speculator", "StepCost", "TokenizerMismatchError",
    "UnsupportedModelError", "VerifyResult", "check_tokenizers_match", "convert_eagle", "register_pipeline",
    "load_draft", "resolve_speculator", "TrainingSet", "build_training_set", "train_eagle_head",
    "verify", "HeadCheckpointError", "MedusaSpeculator", "MlpSpeculator", "convert_head",
    "trained_head", "HybridSpeculator", "Grammar", "GrammarError", "GrammarSpeculator",
    "StructuredOutputUnavailableError", "SamplingParams", "ServingEngine", "generate_batch", "release_kv_pools",
]
