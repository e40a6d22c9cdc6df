"""What `speculator=` accepts: a `Speculator`, a draft model, or a speculator's name."""

from __future__ import annotations

from transformers import PreTrainedModel

from ..decode.speculator import Speculator
from .draft_model import DraftModelSpeculator
from .grammar import GrammarSpeculator
from .ngram import NgramSpeculator
from .off import NoDraftSpeculator


def resolve_speculator(speculator) -> Speculator:
    """Turns what a user passed as `speculator=` into a `Speculator`, or raises naming `speculator`."""
    if isinstance(speculator, Speculator):
        return speculator
    if isinstance(speculator, PreTrainedModel):
        return DraftModelSpeculator(speculator)
    if isinstance(speculator, str):
        if speculator == "ngram":
            return NgramSpeculator()
        if speculator == "grammar":
            return GrammarSpeculator()
        if speculator == "off":
            return NoDraftSpeculator()
        heads = ""
        if speculator.lower() in ("eagle", "eagle3", "medusa", "mlp", "hybrid"):
            heads = ("; a head is a speculator object: hf_specdec.EagleSpeculator.from_pretrained(path), e.g. the "
                     "shipped one for SmolLM2, hf_specdec.trained_head('smollm2-135m-instruct')")
        raise ValueError(
            f"speculator={speculator!r} is not a known speculator name; pass 'ngram', 'grammar' (with grammar=), 'off' "
            "(hf_specdec's engine without drafts), "
            "a draft PreTrainedModel "
            f"(load one with AutoModelForCausalLM.from_pretrained) or an hf_specdec.Speculator{heads}"
        )
    raise TypeError(
        f"speculator= must be a draft PreTrainedModel, 'ngram' or an hf_specdec.Speculator, "
        f"got {type(speculator).__name__}"
    )
