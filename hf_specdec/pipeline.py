"""The `speculative-text-generation` pipeline task: text-generation, with a speculator."""

from __future__ import annotations

import logging
import types

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextGenerationPipeline
from transformers.pipelines import PIPELINE_REGISTRY
from transformers.pipelines.base import is_valid_message
from transformers.pipelines.pt_utils import KeyDataset
from transformers.pipelines.text_generation import Chat, ReturnType

from .decode.requests import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, SamplingParams
from .decode.speculator import Speculator
from .generation import _check_num_speculative_tokens
from .quantization import load_draft
from .serving.engine import ServingEngine
from .serving.offline import generate_stream
from .speculators.convert_head import head_speculator_from_dir
from .speculators.draft_model import DraftModelSpeculator
from .speculators.resolve import resolve_speculator
from .structured.grammar import Grammar
from .tokenizers import check_tokenizers_match

logger = logging.getLogger(__name__)

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
        if num_speculative_tokens is not None:  # checked here: continuous batching would not check it
            forward["num_speculative_tokens"] = _check_num_speculative_tokens(num_speculative_tokens)
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

    def __call__(self, text_inputs, **kwargs):
        """As `text-generation`; given many prompts (a list, a dataset, a generator) and `batch_size=N`, runs them
        with continuous batching: N requests in flight, each slot refilled as soon as its request finishes. Options
        continuous batching does not take (stop strings, ... given to the call or set in the generation config), and
        outputs that show the stock batches' padding (`return_tensors=True`, a pad token the text keeps), run the
        stock pipeline's batches instead, with speculation: the output is the same, and nothing is dropped."""
        batch_size = kwargs.get("batch_size")
        text_inputs = _as_stock_reads(text_inputs)
        if text_inputs is None:  # an empty generator, which the stock pipeline answers with []
            return []
        if batch_size and batch_size > 1 and _many(text_inputs):
            plan = self._continuous_plan({k: v for k, v in kwargs.items() if k != "batch_size"})
            if isinstance(plan, dict):
                kwargs.pop("batch_size")
                results = self._continuous(text_inputs, batch_size, plan)
                return list(results) if isinstance(text_inputs, (list, tuple)) else results
            logger.info(f"speculative-text-generation: {', '.join(plan)} not taken by continuous batching; running "
                        f"batches of {batch_size} as the text-generation pipeline does")
        return super().__call__(text_inputs, **kwargs)

    # What continuous batching takes from the call and the generation config; the rest must be unset (or as the
    # model's own config has it, for the token ids), else the stock batches run.
    _CONTINUOUS = {"max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "repetition_penalty"}
    _BOOKKEEPING = {"transformers_version", "_from_model_config", "use_cache", "bos_token_id", "pad_token_id",
                    "max_length", "eos_token_id"}

    def _continuous_plan(self, kwargs: dict):
        """The settings of a continuous run, or the names of the options it cannot honour. The settings are those
        `generate` would use: the call's, then the model's generation config, then transformers' defaults (top-k 50
        when sampling, say); anything else that differs from a plain call's is an option continuous batching does
        not take."""
        from transformers import GenerationConfig

        preprocess_params, forward_params, postprocess_params = self._sanitize_parameters(**kwargs)
        # what the pipeline was built with, under the call's own (as `Pipeline.__call__` merges them)
        preprocess_params = {**self._preprocess_params, **preprocess_params}
        forward_params = {**self._forward_params, **forward_params}
        postprocess_params = {**self._postprocess_params, **postprocess_params}
        options = self._prepare_generate_kwargs(dict(forward_params))
        k, grammar = options.pop("num_speculative_tokens", None), options.pop("grammar", None)
        options.pop("tokenizer", None)
        user_config = options.pop("generation_config", None)
        config, rest = self.model._prepare_generation_config(user_config, **options)
        unsupported = sorted(name for name, value in rest.items() if value is not None)
        own = self.model.generation_config
        plain = GenerationConfig()  # transformers' defaults alone: the model's own settings count as options too
        plain.update(**own._get_default_generation_params(), defaults_only=True)
        for name, value in config.to_dict().items():
            if name in self._CONTINUOUS or (name in self._BOOKKEEPING and name != "eos_token_id"):
                continue
            if name == "eos_token_id" and value == own.eos_token_id:  # the engine stops on the model's own
                continue
            default = getattr(plain, name, None)
            if value != default and (value or default):  # False, None, 0 and [] all leave an option off
                unsupported.append(name)
        if config.max_new_tokens is None:
            unsupported.append("max_length")  # a length counted with the prompt: the stock batches honour it
        # The stock batches pad: each prompt on the left to its batch's longest, each row that ended early on the
        # right with pad_token_id. Token ids show both, and text shows the right padding unless it is skipped as a
        # special token; continuous batching pads nothing, so those calls run the stock batches.
        if postprocess_params.get("return_type") == ReturnType.TENSORS:
            unsupported.append("return_tensors")
        if config.eos_token_id is not None and self._padding_shows(config, postprocess_params):
            unsupported.append("pad_token_id")
        if grammar is not None and config.eos_token_id is None:
            unsupported.append("grammar")  # needs an EOS to end on: generate(speculator=) says so
        penalty = config.repetition_penalty
        if penalty not in (None, 1.0) and not (isinstance(penalty, float)
                                               and MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY):
            unsupported.append("repetition_penalty")  # outside our bounds: the stock batches take it, or say why not
        if unsupported:
            return sorted(set(unsupported))
        return {"preprocess": preprocess_params, "postprocess": postprocess_params, "k": k, "grammar": grammar,
                **{name: getattr(config, name) for name in self._CONTINUOUS}}

    def _padding_shows(self, config, postprocess_params: dict) -> bool:
        """Whether the pad token `generate` appends to rows that ended early shows in the decoded text."""
        pad = config.pad_token_id
        if pad is None:  # generate pads with the (first) EOS then
            eos = config.eos_token_id
            pad = eos[0] if isinstance(eos, (list, tuple)) else eos
        skip = postprocess_params.get("skip_special_tokens")
        if getattr(self.tokenizer, "response_template", None) or skip is False:  # as `postprocess` decides
            return True
        return int(pad) not in self.tokenizer.all_special_ids

    def _continuous(self, inputs, batch_size: int, plan: dict):
        preprocess_params, postprocess_params = plan["preprocess"], plan["postprocess"]
        max_new_tokens = plan["max_new_tokens"] or 256
        top_p, top_k = plan["top_p"], plan["top_k"]

        # Request i is seeded `base + i`, `base` drawn from the global generator before anything runs: under
        # torch.manual_seed the run repeats whatever shares its steps (a seeded request's tokens depend on its seed
        # alone, `verify.sample_by_position`).
        base = int(torch.randint(0, 2**31 - 1, (1,))) if plan["do_sample"] else None

        repetition = plan["repetition_penalty"] or 1.0  # transformers' formula, ours too (`RowSampling`)

        def sampling(index: int):
            if base is None:
                return SamplingParams(repetition_penalty=repetition) if repetition != 1 else None
            return SamplingParams(plan["temperature"] or 1.0, top_p if top_p is not None else 1.0, top_k or 0,
                                  base + index, repetition_penalty=repetition)

        engine = ServingEngine(self.model, self.tokenizer, self.speculator, num_speculative_tokens=plan["k"],
                               max_batch_size=batch_size, max_queue=2 * batch_size, warmup=False).start()
        prepared: list = []

        def prompts():
            for item in inputs:
                if isinstance(item, (list, tuple)) and item and is_valid_message(item[0]):
                    item = Chat(item)  # a chat, as the stock pipeline wraps it
                model_inputs = self.preprocess(item, **preprocess_params)
                prepared.append(model_inputs)
                yield model_inputs["input_ids"][0].tolist()

        try:
            for stream in generate_stream(engine, prompts(), max_new_tokens, sampling, plan["grammar"]):
                model_inputs = prepared.pop(0)
                ids = model_inputs["input_ids"]
                sequence = torch.cat([ids[0], torch.tensor(stream.request.output_ids, dtype=ids.dtype)])
                yield self.postprocess({"generated_sequence": sequence.view(1, 1, -1), "input_ids": ids,
                                        "prompt_text": model_inputs["prompt_text"]}, **postprocess_params)
        finally:
            engine.shutdown()


def _as_stock_reads(inputs):
    """The inputs as `Pipeline.__call__` reads them: message dicts (a list, tuple, KeyDataset or generator of them)
    are one `Chat`. A generator's first item is looked at, then put back; None for an empty generator."""
    if isinstance(inputs, types.GeneratorType):
        try:
            first = next(inputs)
        except StopIteration:
            return None
        return Chat([first, *inputs]) if is_valid_message(first) else _put_back(first, inputs)
    if isinstance(inputs, (list, tuple, KeyDataset)) and len(inputs) > 0 and is_valid_message(inputs[0]):
        return Chat(inputs)
    return inputs


def _put_back(first, rest):
    """A generator again (the pipeline streams generators only), starting with `first`."""
    yield first
    yield from rest


def _many(inputs) -> bool:
    """A collection of prompts, not one prompt (a string, or one chat: a list of message dicts)."""
    if isinstance(inputs, (str, dict, Chat)):
        return False
    if isinstance(inputs, (list, tuple)):
        return len(inputs) > 0 and not isinstance(inputs[0], dict)
    return hasattr(inputs, "__iter__")


def register_pipeline() -> None:
    """Registers the task with transformers' pipeline registry (idempotent)."""
    if TASK not in PIPELINE_REGISTRY.get_supported_tasks():
        PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=SpeculativeTextGenerationPipeline,
                                            pt_model=AutoModelForCausalLM, type="text")

