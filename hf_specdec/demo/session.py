"""What the demo runs, without any UI: input limits and checks, and the plain vs speculative runs it streams.

The two runs of a comparison are sequential (plain `generate` first, then speculative), never concurrent: on a
small machine two concurrent runs would compete for the same cores and make both tokens/s figures meaningless.
Each run happens in a worker thread that feeds a streamer; the caller iterates over snapshots as tokens arrive.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..models import DEFAULT_MODEL, has_trained_head, load_causal_lm, load_model, load_tokenizer, trained_head
from ..structured.grammar import Grammar, StructuredOutputUnavailableError
from ..tokenizers import check_tokenizers_match
from ..workloads import chat_inputs
from .stream import NGRAM_LABEL, BatchResult, Comparison, Pane, Settings, StepStreamer


class DemoInputError(ValueError):
    """Input the demo refuses; the message names the problem and the fix, and is shown to the person as is."""


@dataclass(frozen=True)
class DemoLimits:
    """Caps that keep a public deployment responsive.

    Args:
        max_prompt_chars (`int`): longest prompt, in characters.
        max_prompt_tokens (`int`): longest prompt, in tokens after the chat template.
        max_new_tokens (`int`): the most new tokens one request may ask for.
        max_k (`int`): the most drafts per step (`num_speculative_tokens`).
        max_batch_prompts (`int`): the most prompts in one batch request.
    """

    max_prompt_chars: int = 4000
    max_prompt_tokens: int = 1024
    max_new_tokens: int = 512
    max_k: int = 16
    max_batch_prompts: int = 8


def load_speculators(model, tokenizer, drafts: list[str] = (), eagle: str | None = None,
                     eagle_label: str | None = None) -> dict:
    """Speculators the demo offers, by label: n-gram always, each draft model given, an EAGLE head when available,
    and then that head combined with n-gram (`HybridSpeculator`).

    Draft models load on the target's device and dtype; their tokenizers, when they have one, must match the
    target's. EAGLE is offered only if this build of hf_specdec has `EagleSpeculator` and a head (converted with
    `hf_specdec.convert_eagle`) is given; it must pass the speculator's own check against the target. It is
    offered as `eagle_label` (default: "EAGLE head: " and the path).
    """
    speculators: dict = {NGRAM_LABEL: "ngram"}
    for name in drafts:
        draft = load_causal_lm(name, dtype=model.dtype, device=str(model.device))
        try:
            draft_tokenizer = load_tokenizer(name)
        except (OSError, ValueError):
            draft_tokenizer = None  # generate still checks that the vocabularies can match
        if draft_tokenizer is not None:
            check_tokenizers_match(tokenizer, draft_tokenizer)
        speculators[f"draft model: {name}"] = draft
    if eagle is not None:
        import hf_specdec

        eagle_class = getattr(hf_specdec, "EagleSpeculator", None)
        if eagle_class is None:
            raise ValueError("--eagle needs a version of hf_specdec with EagleSpeculator; drop --eagle or upgrade")
        head = eagle_class.from_pretrained(eagle)
        head.validate(model)  # a head that cannot serve this target is refused now, not offered
        label = eagle_label or f"EAGLE head: {eagle}"
        speculators[label] = head
        if isinstance(head, eagle_class):
            # The lookup where the text repeats, the head elsewhere: its own speculator around the same weights.
            speculators[f"n-gram + {label}"] = hf_specdec.HybridSpeculator(eagle_class(head.head, head.block_size))
    return speculators


class DemoSession:
    """A loaded target, its tokenizer and the speculators on offer, with the runs the demo makes.

    Args:
        model (`PreTrainedModel`): the target.
        tokenizer: its tokenizer (with a chat template, the prompts go through it).
        speculators (`dict`): label -> what `generate(speculator=...)` takes (see `load_speculators`).
        limits (`DemoLimits`, *optional*): input caps.
        model_name (`str`): shown in the app.
    """

    def __init__(self, model, tokenizer, speculators: dict, limits: DemoLimits | None = None,
                 model_name: str = ""):
        self.model = model
        self.tokenizer = tokenizer
        self.speculators = speculators
        self.limits = limits or DemoLimits()
        self.model_name = model_name
        self._lock = threading.Lock()
        context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.context = context or self.limits.max_prompt_tokens + self.limits.max_new_tokens

    @classmethod
    def load(cls, model: str = DEFAULT_MODEL, drafts: list[str] = (), eagle: str | None = None,
             device: str | None = None, limits: DemoLimits | None = None) -> DemoSession:
        """Loads a target by embedded name, hub id or path (see `hf_specdec.models.load_model`) and its speculators."""
        target, tokenizer = load_model(model, device=device)
        label = None
        if eagle is None and has_trained_head(model):  # the head trained for it ships with hf_specdec
            eagle, label = str(trained_head(model)), f"EAGLE head trained for {model}"
        return cls(target, tokenizer, load_speculators(target, tokenizer, list(drafts), eagle, label), limits, model)

    def warm_up(self) -> None:
        """One short run of each path, so the first request's timings do not include one-off start-up costs."""
        inputs = chat_inputs(self.tokenizer, ["Hello"]).to(self.model.device)
        self.model.generate(**inputs, max_new_tokens=4, do_sample=False)
        for speculator in self.speculators.values():
            self.model.generate(**inputs, max_new_tokens=4, do_sample=False, speculator=speculator)

    # Checks ---------------------------------------------------------------------------------------------------
    def check_prompt(self, prompt: str | None) -> str:
        """Returns the prompt stripped, or raises `DemoInputError` if it is empty or too long."""
        prompt = (prompt or "").strip()
        if not prompt:
            raise DemoInputError("The prompt is empty: type a prompt or pick one of the examples.")
        if len(prompt) > self.limits.max_prompt_chars:
            raise DemoInputError(f"The prompt has {len(prompt)} characters, over this demo's limit of "
                                 f"{self.limits.max_prompt_chars}: shorten it.")
        num_tokens = chat_inputs(self.tokenizer, [prompt])["input_ids"].shape[1]
        if num_tokens > self.limits.max_prompt_tokens:
            raise DemoInputError(f"The prompt is {num_tokens} tokens long, over this demo's limit of "
                                 f"{self.limits.max_prompt_tokens}: shorten it.")
        return prompt

    def check_settings(self, speculator, k, max_new_tokens, do_sample=False, temperature=1.0, top_p=1.0, seed=0,
                       schedule="adaptive", json_mode=False, json_schema="") -> Settings:
        """Returns checked `Settings`, or raises `DemoInputError` naming the bad field and its allowed range.

        With `json_mode`, both runs write JSON: following `json_schema` (text) when given, else any JSON value."""
        grammar = self._check_json(json_schema) if json_mode else None
        if speculator not in self.speculators:
            raise DemoInputError(f"Unknown speculator {speculator!r}: choose one of {', '.join(self.speculators)}.")
        k = _whole_number("k (drafts per step)", k, 1, self.limits.max_k)
        max_new_tokens = _whole_number("max new tokens", max_new_tokens, 1, self.limits.max_new_tokens)
        seed = _whole_number("seed", seed, 0, 2**31 - 1)
        if schedule not in ("adaptive", "constant"):
            raise DemoInputError(f"Unknown k schedule {schedule!r}: choose 'adaptive' or 'constant'.")
        if not do_sample:
            temperature, top_p = 1.0, 1.0  # unused by greedy decoding, so not checked
        else:
            temperature, top_p = _number("temperature", temperature), _number("top-p", top_p)
            if not 0.05 <= temperature <= 2.0:
                raise DemoInputError(f"Temperature {temperature:g} is out of range: use a value from 0.05 to 2.")
            if not 0.0 < top_p <= 1.0:
                raise DemoInputError(f"Top-p {top_p:g} is out of range: use a value above 0 and at most 1.")
        return Settings(speculator, k, max_new_tokens, bool(do_sample), temperature, top_p, seed, schedule, grammar,
                        self.tokenizer if grammar is not None else None)

    def _check_json(self, schema_text: str | None):
        try:
            grammar = Grammar.json_schema(schema_text) if (schema_text or "").strip() else Grammar.json()
            eos = self.model.generation_config.eos_token_id
            grammar.compile(self.tokenizer, self.model.config.get_text_config().vocab_size,
                            None if eos is None else [eos] if isinstance(eos, int) else list(eos))
        except StructuredOutputUnavailableError as error:
            raise DemoInputError(f"JSON mode is not available here: {error}") from None
        except ValueError as error:  # GrammarError included: the schema is shown the library's message
            raise DemoInputError(f"The JSON schema cannot be used: {error}") from None
        return grammar

    def check_batch(self, text: str | None) -> list[str]:
        """Splits a batch request (prompts separated by lines holding only `---`) and checks each prompt."""
        prompts = [p.strip() for p in _split_batch(text or "") if p.strip()]
        if not prompts:
            raise DemoInputError("No prompts: type one or more prompts, separated by a line holding only ---.")
        if len(prompts) > self.limits.max_batch_prompts:
            raise DemoInputError(f"{len(prompts)} prompts is over this demo's limit of "
                                 f"{self.limits.max_batch_prompts} per batch: remove some.")
        checked = []
        for i, prompt in enumerate(prompts, 1):
            try:
                checked.append(self.check_prompt(prompt))
            except DemoInputError as error:
                raise DemoInputError(f"Prompt {i}: {error}") from None
        return checked

    def _check_context(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        if num_prompt_tokens + max_new_tokens > self.context:
            raise DemoInputError(f"The prompt ({num_prompt_tokens} tokens) plus {max_new_tokens} new tokens exceeds "
                                 f"the model's context of {self.context} tokens: lower max new tokens or shorten "
                                 "the prompt.")

    # Runs -----------------------------------------------------------------------------------------------------
    def compare(self, prompt: str, settings: Settings, interval_s: float = 0.05) -> Iterator[Comparison]:
        """Streams plain `generate`, then speculative generation, of one prompt.

        Yields `Comparison` snapshots (the same object, updated) at most every `interval_s` while tokens arrive,
        and a last one with `done` and the speculative metrics.
        """
        prompt = self.check_prompt(prompt)
        inputs = chat_inputs(self.tokenizer, [prompt]).to(self.model.device)
        self._check_context(inputs["input_ids"].shape[1], settings.max_new_tokens)
        state = Comparison(Pane(speculative=False), Pane(speculative=True), settings)
        common = settings.generate_kwargs()
        with self._lock:  # one run at a time on this model, whatever the app's queue allows
            yield from self._stream(state.plain, state, inputs, settings.seed, interval_s, common)
            outputs = {}
            yield from self._stream(state.speculative, state, inputs, settings.seed, interval_s,
                                    {**common, **self._speculative_kwargs(settings), "return_dict_in_generate": True},
                                    outputs)
        state.metrics = outputs["result"].speculative_metrics
        yield state

    def _speculative_kwargs(self, settings: Settings) -> dict:
        return dict(speculator=self.speculators[settings.speculator], num_speculative_tokens=settings.k,
                    speculative_schedule=settings.schedule)

    def _stream(self, pane: Pane, state: Comparison, inputs, seed: int, interval_s: float, kwargs: dict,
                outputs: dict | None = None) -> Iterator[Comparison]:
        streamer = StepStreamer()
        failure: list[BaseException] = []
        started, total = [0.0], [0.0]

        def work():
            try:
                torch.manual_seed(seed)
                started[0] = time.perf_counter()
                result = self.model.generate(**inputs, streamer=streamer, **kwargs)
                total[0] = time.perf_counter() - started[0]
                if outputs is not None:
                    outputs["result"] = result
            except BaseException as error:  # re-raised in the caller's thread
                failure.append(error)
                streamer.end()

        worker = threading.Thread(target=work, name="hf-specdec-demo-generate", daemon=True)
        worker.start()
        last_yield = 0.0
        try:
            while True:
                item = streamer.queue.get()
                if item is None:
                    break
                arrived, token_ids = item
                pane.add_step(token_ids, self.tokenizer)
                pane.elapsed_s = arrived - started[0]
                if time.perf_counter() - last_yield >= interval_s:
                    last_yield = time.perf_counter()
                    yield state
        finally:
            # A page closed mid-stream closes this generator: stop the run at its next step and wait for it, so
            # two runs never use the model at once. (Harmless once the run has ended.)
            streamer.cancel()
            worker.join()
        if failure:
            raise failure[0]
        pane.elapsed_s, pane.done = total[0], True  # the whole call, as a user of generate would time it
        yield state

    def run_batch(self, prompts: list[str], settings: Settings) -> BatchResult:
        """Runs the prompts as one batch, plain then speculative, and times both."""
        inputs = chat_inputs(self.tokenizer, prompts).to(self.model.device)
        self._check_context(inputs["input_ids"].shape[1], settings.max_new_tokens)
        common = settings.generate_kwargs()
        with self._lock:
            torch.manual_seed(settings.seed)
            start = time.perf_counter()
            plain = self.model.generate(**inputs, **common)
            plain_time = time.perf_counter() - start
            torch.manual_seed(settings.seed)
            start = time.perf_counter()
            out = self.model.generate(**inputs, **common, **self._speculative_kwargs(settings),
                                      return_dict_in_generate=True)
            speculative_time = time.perf_counter() - start
        width = inputs["input_ids"].shape[1]
        generated = out.sequences[:, width:]
        num_new = _num_new_tokens(generated, self.model.generation_config.eos_token_id)
        outputs = [self.tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(generated, num_new)]
        return BatchResult(prompts, outputs, num_new, plain_time, speculative_time,
                           torch.equal(plain, out.sequences), out.speculative_metrics, settings)


def _num_new_tokens(generated: torch.Tensor, eos_token_id) -> list[int]:
    """Per row: tokens up to and including the first EOS, or all of them (later columns are padding)."""
    if eos_token_id is None:
        return [generated.shape[1]] * generated.shape[0]
    eos = torch.tensor(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
    is_eos = torch.isin(generated.cpu(), eos)
    first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, generated.shape[1])
    return first.tolist()


def _split_batch(text: str) -> list[str]:
    prompts, current = [], []
    for line in text.splitlines():
        if line.strip() == "---":
            prompts.append("\n".join(current))
            current = []
        else:
            current.append(line)
    return prompts + ["\n".join(current)]


def _number(name: str, value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise DemoInputError(f"{name} must be a number, got {value!r}.") from None
    if not math.isfinite(number):
        raise DemoInputError(f"{name} must be a finite number, got {value!r}.")
    return number


def _whole_number(name: str, value, low: int, high: int) -> int:
    number = _number(name, value)
    if number != int(number) or not low <= number <= high:
        raise DemoInputError(f"{name} is {value!r}: use a whole number from {low} to {high}.")
    return int(number)
