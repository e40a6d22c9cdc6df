"""The `speculative-text-generation` pipeline task: text-generation, with a speculator."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoTokenizer, TextGenerationPipeline
from transformers.pipelines import PIPELINE_REGISTRY

from .generation import resolve_speculator
from .head_convert import head_speculator_from_dir
from .quantization import load_draft
from .speculators.base import Speculator
from .speculators.draft_model import DraftModelSpeculator
from .structured import Grammar
from .tokenizers import check_tokenizers_match

TASK = "speculative-text-generation"


class SpeculativeTextGenerationPipeline(TextGenerationPipeline):
    """Takes and returns what the `text-generation` pipeline does, and decodes speculatively.

    Args:
        assistant (`str`, `PreTrainedModel` or `Speculator`): a draft model id or path (loaded on the target's
            device and dtype), a directory holding a head (EAGLE, MLP speculator, Medusa) converted by
            `hf-specdec convert-head`, a draft model, `"ngram"`, or a speculator object.
        assistant_tokenizer (*optional*): the draft's tokenizer; loaded beside the draft when `assistant` is an id or
            path. When known, it must match the target's tokenizer (`TokenizerMismatchError` otherwise).
        assistant_quantization (`str`, *optional*): quantize the draft as it loads: `"fp8"`, `"int8"`, `"nf4"` or
            `"gptq"` (calibrated on the target's own generations); see `hf_specdec.load_draft`. Pre-quantized
            checkpoints (GPTQ, FP8) load as they are without it.
        num_speculative_tokens (`int`, *optional*): drafts per step (k); may also be given per call.

    Per call it also takes `grammar=` (an `hf_specdec.Grammar`, applied to every prompt) or an OpenAI-style
    `response_format={"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}` (or
    `{"type": "json_object"}`): the output then follows it exactly (see docs/structured.md).
    """

    def __init__(self, *args, assistant=None, assistant_tokenizer=None, assistant_quantization=None, **kwargs):
        super().__init__(*args, **kwargs)
        if assistant is None:
            raise ValueError(f"the {TASK!r} pipeline needs assistant=: a draft model id or path, a PreTrainedModel, "
                             "'ngram', or an hf_specdec.Speculator")
        self.speculator = self._load_assistant(assistant, assistant_tokenizer, assistant_quantization)

    def _load_assistant(self, assistant, assistant_tokenizer, quantization=None) -> Speculator:
        head = head_speculator_from_dir(assistant)  # a converted EAGLE, MLP speculator or Medusa head directory
        if head is not None:
            if quantization is not None:
                raise ValueError("assistant_quantization= applies to draft models, not to draft heads")
            head.validate(self.model)
            return head
        if quantization is not None and (isinstance(assistant, Speculator) or assistant == "ngram"):
            raise ValueError(f"assistant_quantization={quantization!r} applies to draft models; the assistant "
                             f"{assistant!r} is not one")
        if quantization is not None and not isinstance(assistant, str):
            assistant = load_draft(assistant, quantization, device=self.model.device, target=self.model,
                                   tokenizer=self.tokenizer)
        if isinstance(assistant, str) and assistant != "ngram":
            draft = load_draft(assistant, quantization, dtype=self.model.dtype, device=self.model.device,
                               target=self.model, tokenizer=self.tokenizer)
            if assistant_tokenizer is None:
                try:
                    assistant_tokenizer = AutoTokenizer.from_pretrained(assistant)
                except (OSError, ValueError) as error:
                    raise ValueError(f"could not load a tokenizer beside the assistant {assistant!r} to check it "
                                     "matches the target's; pass assistant_tokenizer=") from error
            assistant = draft
        speculator = resolve_speculator(assistant)
        if assistant_tokenizer is not None and self.tokenizer is not None:
            check_tokenizers_match(self.tokenizer, assistant_tokenizer)
        if isinstance(speculator, DraftModelSpeculator):
            speculator.validate(self.model)
        return speculator

    def _sanitize_parameters(self, num_speculative_tokens=None, grammar=None, response_format=None, **kwargs):
        preprocess, forward, postprocess = super()._sanitize_parameters(**kwargs)
        if num_speculative_tokens is not None:
            forward["num_speculative_tokens"] = num_speculative_tokens
        if response_format is not None:
            if grammar is not None:
                raise ValueError("pass grammar= or response_format=, not both")
            grammar = Grammar.from_response_format(response_format)
        if grammar is not None:
            if not isinstance(grammar, Grammar):
                raise TypeError(f"grammar= takes one hf_specdec.Grammar, applied to every prompt (for a grammar per "
                                f"row call model.generate(grammar=[...])), got {type(grammar).__name__}")
            forward["grammar"] = grammar
            forward["tokenizer"] = self.tokenizer
        return preprocess, forward, postprocess

    def _forward(self, model_inputs, **generate_kwargs):
        return super()._forward(model_inputs, speculator=self.speculator, **generate_kwargs)


def register_pipeline() -> None:
    """Registers the task with transformers' pipeline registry (idempotent)."""
    if TASK not in PIPELINE_REGISTRY.get_supported_tasks():
        PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=SpeculativeTextGenerationPipeline,
                                            pt_model=AutoModelForCausalLM, type="text")

