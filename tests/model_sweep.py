"""Every causal LM architecture transformers knows, built tiny from its config and decoded speculatively.

Each architecture of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built with random weights from a shrunken config (vocab
128, hidden 64, 2 layers, 4 heads, sliding window 8 where it has one, `is_decoder=True` where the config has it), in
float64 (so no near-tie can fork greedy output). A ragged left-padded batch of 2 is decoded greedily with plain
`generate` and with `speculator="ngram"` and an identical draft model (constant schedule), and each architecture is
classified:

- `lossless`: both speculative outputs equal plain `generate`, token for token;
- `lossless (other reference)`: plain `generate` is itself wrong on this batch (listed in `REFERENCE_DIFFERS`, each
  with the reason), and both speculative outputs equal transformers' `use_cache=False` output or each row's output
  generated alone;
- `refused`: `UnsupportedModelError` before any forward, with its reason;
- `not buildable`: the config, the model or plain `generate` itself fails (the reason is transformers');
- `mismatch` / `crash`: a bug (a crash is any other exception once the up-front checks accepted the model).

`python tests/model_sweep.py [--jobs N] [--markdown]` prints the table; `tests/test_model_sweep.py` runs it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import multiprocessing
import signal
import sys
import time
import traceback
import warnings
from collections import Counter

LOSSLESS, OTHER_REFERENCE, REFUSED, UNBUILDABLE, MISMATCH, CRASH = (
    "lossless", "lossless (other reference)", "refused", "not buildable", "mismatch", "crash")
FAILURES = (MISMATCH, CRASH)

# Architectures where transformers' own plain `generate` is wrong on the sweep's batch, and why; ours equals its
# uncached output or each row's output alone there (outcome `OTHER_REFERENCE`). The test requires this list to be
# exactly the architectures where that happens.
REFERENCE_DIFFERS = {
    "moshi": "its cached generate differs from its own use_cache=False output",
    "gemma2": "its eager attention turns the left-padded row's logits into NaN (plain generate then emits token 0)",
    "vaultgemma": "its eager attention turns the left-padded row's logits into NaN (plain generate then emits "
                  "token 0)",
    "granite_swa": "its eager attention (with sinks) turns the left-padded row's logits into NaN",
    "whisper": "its plain generate gives the left-padded row other tokens than that row alone",
    "bloom": "its attention turns the left-padded row's logits into NaN in float64 (padding queries see no key; plain "
             "generate then emits token 0)",
    "mpt": "its attention turns the left-padded row's logits into NaN in float64 (padding queries see no key; plain "
           "generate then emits token 0)",
}

VOCAB = 128
MAX_NEW_TOKENS = 10
K = 3
TIME_BUDGET_S = 60

# Field values of a tiny model; each is set only where the config class has the field (directly or through its
# attribute_map). Sub-configs (vision towers, text configs of wrappers) get the same treatment.
TINY = dict(
    vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=8, is_decoder=True,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # mixture of experts
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    n_shared_experts=1, n_group=1, topk_group=1,
    # multi-head latent attention
    kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
    # vision towers of multimodal wrappers
    image_size=32, patch_size=8, num_channels=3,
    # decoders of encoder-decoder families (their ForCausalLM is the decoder alone)
    d_model=64, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4, encoder_attention_heads=4,
    decoder_ffn_dim=128, encoder_ffn_dim=128,
    rotary_dim=16, hidden_size_global=64, encoder_hash_byte_group_vocab=VOCAB,
)
# Per-family settings the generic ones above cannot express (a config validator would refuse the model otherwise).
FAMILY = {
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
}


def _field_names(config_class) -> set[str]:
    names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    return names | set(getattr(config_class, "attribute_map", {}))


def _layer_pattern(config_class, names: set[str], num_layers: int) -> dict:
    """Layer kinds for a shallow hybrid: each kind the full-size default uses, in order of first appearance (so a
    2-layer model still holds an attention layer and a recurrent one), repeated to `num_layers`."""
    if "layer_types" not in names:
        return {}
    try:
        default = list(config_class().layer_types or [])
    except Exception:  # noqa: BLE001 - configs that need arguments keep their own pattern
        return {}
    kinds = list(dict.fromkeys(default))
    if len(kinds) < 2:
        return {}
    pattern = (kinds * num_layers)[:num_layers]
    extra = {"layer_types": pattern}
    attention = [i for i, kind in enumerate(pattern) if "attention" in kind and "linear" not in kind]
    if "attn_layer_period" in names and attention:
        extra.update(attn_layer_period=len(kinds), attn_layer_offset=attention[0] % len(kinds))
    if "attn_layer_indices" in names:
        extra["attn_layer_indices"] = attention
    return extra


def tiny_config(config_class, num_layers: int = 2, depth: int = 0):
    """A tiny instance of `config_class`: `TINY`'s values for the fields it has, sub-configs shrunk likewise."""
    from transformers import PreTrainedConfig

    names = _field_names(config_class)
    kwargs = {name: value for name, value in TINY.items() if name in names}
    if "num_hidden_layers" in names:
        kwargs["num_hidden_layers"] = num_layers
    if "kv_lora_rank" in names:  # latent attention has no grouped kv heads
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    kwargs.update(FAMILY.get(getattr(config_class, "model_type", ""), {}))
    kwargs.update(_layer_pattern(config_class, names, num_layers))
    sub_configs = getattr(config_class, "sub_configs", None) or {}
    if sub_configs and depth < 3:
        default = config_class()  # the default sub-configs tell which classes an AutoConfig entry stands for
        for key in sub_configs:
            sub = getattr(default, key, None)
            if isinstance(sub, PreTrainedConfig):
                kwargs[key] = tiny_config(type(sub), num_layers, depth + 1).to_dict()
    return config_class(**kwargs)


def build(model_type: str, num_layers: int = 2, dtype=None):
    """The tiny model of `model_type` (float64 unless `dtype`), ready for greedy generation."""
    import torch
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    config = tiny_config(getattr(model_class, "config_class", None) or CONFIG_MAPPING[model_type], num_layers)
    torch.manual_seed(0)
    model = model_class(config).to(dtype or torch.float64).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts():
    """A left-padded batch of 2: a repeated phrase (n-gram lookup finds matches) and a shorter random row."""
    import torch

    g = torch.Generator().manual_seed(0)
    phrase = torch.randint(3, VOCAB, (5,), generator=g)
    input_ids = torch.zeros((2, 12), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    input_ids[0] = phrase.repeat(3)[:12]
    input_ids[1, 5:] = torch.randint(3, VOCAB, (7,), generator=g)
    attention_mask[0] = 1
    attention_mask[1, 5:] = 1
    return input_ids, attention_mask


def _first_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    return text[:300]


def check(model_type: str) -> tuple[str, str]:
    """Classifies one architecture; returns `(outcome, detail)`."""
    import torch
    from hf_specdec import UnsupportedModelError

    input_ids, attention_mask = prompts()
    args = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                min_new_tokens=MAX_NEW_TOKENS)
    # float64 rules out near-ties, but some kernels only take float32; some hybrids cannot be built or run with 2
    # layers (none of them an attention layer), so a failure gets one more try with 4.
    num_layers, dtype, first_error = 2, torch.float64, None
    while True:
        stage = ""
        _progress["speculating"] = False
        try:
            model = build(model_type, num_layers, dtype)
            stage = "plain generate fails: "
            with torch.no_grad():
                expected = model.generate(**args)
            break
        except Exception as error:  # noqa: BLE001 - any failure to build is reported, not raised
            message = stage + _first_line(error)
            first_error = first_error or message
            if dtype == torch.float64 and any(word in message.lower() for word in ("double", "float", "dtype")):
                dtype = torch.float32
            elif num_layers == 2:
                num_layers, dtype = 4, torch.float64
            else:
                return UNBUILDABLE, first_error
    _progress["speculating"] = True
    with torch.no_grad():
        forwards = []
        hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
        outputs = {}
        try:
            for name, speculator in (("ngram", "ngram"), ("draft", copy.deepcopy(model))):
                forwards.clear()
                try:
                    outputs[name] = model.generate(**args, speculator=speculator, num_speculative_tokens=K,
                                                   speculative_schedule="constant")
                except UnsupportedModelError as error:
                    # Up front means before generation: in the checks (which may run a trial forward), not later.
                    frames = {frame.name for frame in traceback.extract_tb(error.__traceback__)}
                    if "check_model_supported" not in frames and "validate" not in frames:
                        return CRASH, f"{name}: refused after {len(forwards)} forwards: " + _first_line(error)
                    return REFUSED, str(error).splitlines()[0]
                except Exception as error:  # noqa: BLE001
                    where = "".join(traceback.format_exception(error)[-3:-1]).strip().splitlines()[0]
                    return CRASH, f"{name}: {_first_line(error)} ({where.strip()})"
        finally:
            hook.remove()
        wrong = [name for name, out in outputs.items() if not torch.equal(out, expected)]
        if not wrong:
            return LOSSLESS, ""
        # Plain generate is the reference unless it is itself wrong here: then ours must equal what transformers
        # gives without a cache, or what it gives for each row alone (no padding).
        alone = [model.generate(**{**args, "input_ids": input_ids[i:i + 1, attention_mask[i].bool()],
                                   "attention_mask": None})[0] for i in range(len(input_ids))]
        references = {
            "transformers' use_cache=False output": model.generate(**args, use_cache=False)[:, -MAX_NEW_TOKENS:],
            "each row generated alone": torch.stack([row[-MAX_NEW_TOKENS:] for row in alone]),
        }
        for what, reference in references.items():
            if all(torch.equal(out[:, -MAX_NEW_TOKENS:], reference) for out in outputs.values()):
                return OTHER_REFERENCE, f"equals {what}; plain generate on the padded batch differs from it"
        return MISMATCH, f"{', '.join(wrong)} differ from plain generate"


_progress = {"speculating": False}  # whether a budget overrun happened in our code (a crash) or in transformers'


class _OverBudget(BaseException):  # not an Exception: no `except Exception` on the way may swallow it
    pass


def _timeout(signum, frame):
    raise _OverBudget(f"over the {TIME_BUDGET_S} s budget")


def _check_with_budget(model_type: str) -> tuple[str, str, str, float]:
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(TIME_BUDGET_S)
    try:
        outcome, detail = check(model_type)
    except _OverBudget as error:
        outcome = CRASH if _progress["speculating"] else UNBUILDABLE
        detail = _first_line(error) + ("" if _progress["speculating"] else " while building or in plain generate")
    finally:
        signal.alarm(0)
    return model_type, outcome, detail, time.perf_counter() - start


def _init_worker():
    import logging

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()
    import hf_specdec  # noqa: F401  (registers speculator=)


def architectures() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sweep(model_types: list[str] | None = None, jobs: int = 2) -> dict[str, tuple[str, str]]:
    """Runs `check` on every architecture (or `model_types`) in `jobs` worker processes (one architecture crashing
    its process cannot take the others with it: each worker is replaced after a fixed number of tasks)."""
    model_types = architectures() if model_types is None else model_types
    context = multiprocessing.get_context("spawn")
    results, seconds = {}, {}
    with context.Pool(jobs, initializer=_init_worker, maxtasksperchild=100) as pool:
        for model_type, outcome, detail, elapsed in pool.imap_unordered(_check_with_budget, model_types):
            results[model_type] = (outcome, detail)
            seconds[model_type] = elapsed
    sweep.seconds = seconds  # per architecture, for --slowest
    return dict(sorted(results.items()))


def markdown(results: dict[str, tuple[str, str]]) -> str:
    counts = Counter(outcome for outcome, _ in results.values())
    lines = [", ".join(f"{n} {outcome}" for outcome, n in counts.most_common()) + f" (of {len(results)})", "",
             "| architecture | outcome | why |", "| --- | --- | --- |"]
    for model_type, (outcome, detail) in results.items():
        if outcome == OTHER_REFERENCE:
            detail = f"{detail} ({REFERENCE_DIFFERS.get(model_type, 'undocumented')})"
        detail = detail.replace("|", "/").replace("\n", " ")
        lines.append(f"| {model_type} | {outcome} | {detail[:240] + '...' if len(detail) > 240 else detail} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="architectures to check (default: all)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--slowest", type=int, default=0, help="also list the N slowest architectures")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = sweep(args.model_types or None, args.jobs)
    print(markdown(results))
    print(f"\n{time.perf_counter() - start:.0f} s", file=sys.stderr)
    for model_type, elapsed in sorted(sweep.seconds.items(), key=lambda item: -item[1])[:args.slowest]:
        print(f"{model_type}: {elapsed:.1f} s", file=sys.stderr)
    return 1 if any(outcome in FAILURES for outcome, _ in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
