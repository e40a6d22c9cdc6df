"""Tiny random-init models built from configs: the fixtures for correctness tests (float64 to rule out near-ties)."""

from __future__ import annotations

import os

import torch

# Kernel tests run the Triton kernels for real on a GPU and under the Triton interpreter on a CPU. The variable must
# be set before any kernel module is imported (triton reads it when it decorates a kernel).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests never read or write this host's calibration profiles (~/.cache/hf_specdec/calibration): adaptive k sees the
# static default costs, and `run`/`bench` do not measure at start. tests/test_calibration.py turns it on in tmp_path.
os.environ.setdefault("HF_SPECDEC_CALIBRATION", "off")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402
from transformers import (
    Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
    Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)  # noqa: E402

import hf_specdec  # noqa: F401  (registers speculator=)

# CI replays the same examples every run (HYPOTHESIS_PROFILE=ci in .ci/run), so a landing never hangs on the draw;
# local runs draw fresh examples each time and keep failures in .hypothesis/ to replay.
settings.register_profile("ci", derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None)

ARCHITECTURES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    # Sliding windows shorter than the test sequences, so the window really cuts the context.
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=8)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=8)),
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**COMMON)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3}, head_dim=8, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


def make_model(arch: str = "llama", seed: int = 0, dtype=torch.float64):
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch]().to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def ragged_batch(rows: int = 3, width: int = 14, seed: int = 0, side: str = "left"):
    """A padded batch of random prompts of different lengths (at least 2 tokens each)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, VOCAB, (rows, width), generator=g)
    lengths = [width - (i * 5) % (width - 2) for i in range(rows)]
    mask = torch.zeros_like(input_ids)
    for i, n in enumerate(lengths):
        if side == "left":
            mask[i, width - n:] = 1
        else:
            mask[i, :n] = 1
    input_ids[mask == 0] = 0
    return input_ids, mask


def repetitive_prompt(rows: int = 1, width: int = 16, seed: int = 0):
    """Prompts that repeat a short random phrase, so n-gram lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(2, VOCAB, (rows, 5), generator=g)
    return phrase.repeat(1, width // 5 + 1)[:, :width]


@pytest.fixture
def llama():
    return make_model("llama")


def make_tokenizer(shuffle_seed: int | None = None):
    """A word-level tokenizer over the tiny models' vocabulary: specials, then words w4 .. w95.

    With `shuffle_seed`, word ids are permuted: same size and specials, different strings per id.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(4, VOCAB)]
    if shuffle_seed is not None:
        g = torch.Generator().manual_seed(shuffle_seed)
        words = [words[i] for i in torch.randperm(len(words), generator=g).tolist()]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>", padding_side="left")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer


def word_prompt(seed: int, length: int) -> str:
    g = torch.Generator().manual_seed(seed)
    phrase = [f"w{i}" for i in torch.randint(4, VOCAB, (4,), generator=g).tolist()]
    return " ".join((phrase * length)[:length])


@pytest.fixture(scope="session")
def fitted_eagle_heads(tmp_path_factory):
    """EAGLE heads fitted to tiny targets (`test_eagle.fit_reference`), in the reference layout: `{1: (target,
    dir), 3: (target, dir)}`. Fitting takes a while, so every module shares one."""
    from test_eagle import fit_reference, make_target

    root = tmp_path_factory.mktemp("fitted")
    target1, target3 = make_target(num_layers=2), make_target(num_layers=4, seed=1)
    return {1: (target1, fit_reference(root / "v1", target1, 1, [2])),
            3: (target3, fit_reference(root / "v3", target3, 3, [1, 2, 3]))}


def saved_target_and_head(fitted, tmp_path):
    """A fitted head's target saved as a float32 model directory with the word tokenizer, and the head converted for
    it: `(model_dir, head_dir)`, for command-line tests. `fitted` is an entry of `fitted_eagle_heads`."""
    import copy

    from hf_specdec import convert_eagle

    target, source = fitted
    model_dir, head_dir = tmp_path / "target", tmp_path / "head"
    copy.deepcopy(target).float().save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    convert_eagle(source, head_dir, target=str(model_dir))
    return model_dir, head_dir


def assert_seeded_sampling_is_reproducible(run) -> None:
    """`run(**kwargs)` calls a speculative `generate` (with `return_dict_in_generate=True`) plus `kwargs`. The same
    seed must give the same sequences, another seed other ones, and drafts must have been proposed."""
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(run(do_sample=True, temperature=0.8, top_k=20))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].speculative_metrics.num_draft_tokens > 0
    torch.manual_seed(8)
    assert not torch.equal(run(do_sample=True).sequences, runs[0].sequences)


# Slow sweeps (every architecture, soak and load runs, the browser test) run in CI (`.ci/run` passes --runslow) and
# when asked; the README's test command leaves them out so it stays a loop to run after each change.
def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", help="also run the tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("HF_SPECDEC_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (CI does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
