"""Models bigger than one device: accelerate `device_map` (CPU and disk offload, everything on disk, draft and target
placed apart) and tensor parallelism under `torchrun` (gloo on the CPU). Each must give exactly what plain `generate`
gives (greedy), keep the target's distribution (sampling), and, under tensor parallelism, give every rank the same
output as one process, even when the ranks' random states differ (rank 0 decides, `hf_specdec/distributed.py`).

Run as a script (`torchrun --nproc_per_node 2 tests/test_big_models.py ...`) this file is the tensor-parallel worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_specdec  # noqa: F401  (registers speculator=)

HERE = Path(__file__).resolve().parent
VOCAB = 96
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=None,
              tie_word_embeddings=False)
# Layer by layer: the embedding and the first layer in memory, the rest of the layers and the head on disk.
CPU_DISK_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                "model.layers.1": "disk", "model.layers.2": "disk", "model.norm": "cpu", "lm_head": "disk"}
ALL_ON_DISK = {"device_map": "auto", "max_memory": {"cpu": 0}}


def save_model(directory: Path, num_layers: int, seed: int, dtype=torch.float64) -> Path:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, num_hidden_layers=num_layers)).to(dtype).eval()
    model.save_pretrained(directory)
    return directory


def load(directory: Path, offload: Path | None = None, **placement):
    kwargs = dict(offload_folder=str(offload)) if offload is not None else {}
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64, **kwargs, **placement).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompts(rows: int = 3, seed: int = 0):
    """A ragged, left-padded batch of prompts that repeat a phrase (so n-gram lookup proposes)."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(2, VOCAB, (rows, 5), generator=g)
    input_ids = phrase.repeat(1, 4)[:, :18]
    mask = torch.ones_like(input_ids)
    for row in range(1, rows):
        mask[row, : 3 * row] = 0
    return input_ids.masked_fill(mask == 0, 0), mask


def on_disk(model) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("big_models")
    return {"target": save_model(root / "target", 3, seed=0), "draft": save_model(root / "draft", 1, seed=1),
            "offload": root / "offload"}


def speculative(model, speculator, input_ids, mask, **kwargs):
    out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=16, speculator=speculator,
                         num_speculative_tokens=3, speculative_schedule="constant", return_dict_in_generate=True,
                         **kwargs)
    assert out.speculative_metrics.num_draft_tokens > 0
    return out.sequences


PLACEMENTS = {
    "cpu+disk": dict(device_map=CPU_DISK_MAP),
    "all on disk": ALL_ON_DISK,
}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_offloaded_target_equals_plain_generate(saved, tmp_path, placement, kind):
    input_ids, mask = prompts()
    expected = load(saved["target"]).generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=16,
                                              do_sample=False)
    target = load(saved["target"], tmp_path / "offload", **PLACEMENTS[placement])
    assert on_disk(target)
    if placement == "all on disk":
        assert target.device.type == "meta"  # what made tensors created on `model.device` fail
    speculator = load(saved["draft"]) if kind == "draft" else "ngram"
    assert torch.equal(speculative(target, speculator, input_ids, mask, do_sample=False), expected)


@pytest.mark.parametrize("where", ["draft on disk", "target on disk"])
def test_draft_and_target_placed_apart(saved, tmp_path, where):
    """Draft and target on different devices: on a CPU-only host the one pair that differs is a model in memory
    (`cpu`) and one whose weights stay on disk (`meta`, computed on the host by accelerate's hooks)."""
    input_ids, mask = prompts()
    expected = load(saved["target"]).generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=16,
                                              do_sample=False)
    target_disk, draft_disk = where == "target on disk", where == "draft on disk"
    target = load(saved["target"], tmp_path / "t", **ALL_ON_DISK) if target_disk else load(saved["target"])
    draft = load(saved["draft"], tmp_path / "d", **ALL_ON_DISK) if draft_disk else load(saved["draft"])
    assert target.device != draft.device
    assert torch.equal(speculative(target, draft, input_ids, mask, do_sample=False), expected)


def test_eagle_head_on_an_offloaded_target(tmp_path):
    from test_eagle import convert, make_target

    from hf_specdec import EagleSpeculator

    target = make_target(num_layers=4)
    head = EagleSpeculator.from_pretrained(convert(tmp_path, target, 3))
    target.save_pretrained(tmp_path / "target")
    offloaded = load(tmp_path / "target", tmp_path / "offload", **ALL_ON_DISK)
    input_ids, mask = prompts()
    expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert torch.equal(speculative(offloaded, head, input_ids, mask, do_sample=False), expected)


def test_offloaded_sampling_keeps_the_target_distribution(tmp_path):
    """The first two sampled tokens of a disk-offloaded target follow its exact joint distribution, with a
    confident draft that disagrees with it (the pattern of tests/test_generate_sampling.py)."""
    from test_generate_sampling import SAMPLES, VOCAB as SMALL_VOCAB, exact_joint, peaky_model, tv

    target, draft = peaky_model(0, sharpness=4.0), peaky_model(5, sharpness=6.0)
    target.save_pretrained(tmp_path / "target")
    offloaded = load(tmp_path / "target", tmp_path / "offload", device_map={"model.embed_tokens": "cpu",
                     "model.rotary_emb": "cpu", "model.layers.0": "disk", "model.norm": "cpu", "lm_head": "disk"})
    offloaded.generation_config.eos_token_id = None
    assert on_disk(offloaded)
    prompt = torch.tensor([[1, 3, 4, 3, 4, 3]])
    expected = exact_joint(target, prompt, lambda ids, scores: scores)
    torch.manual_seed(0)
    out = offloaded.generate(prompt.expand(SAMPLES, -1), max_new_tokens=2, do_sample=True, speculator=draft,
                             num_speculative_tokens=3, speculative_schedule="constant", return_dict_in_generate=True)
    assert out.speculative_metrics.num_draft_tokens > 0
    pairs = out.sequences[:, -2] * SMALL_VOCAB + out.sequences[:, -1]
    assert tv(pairs, expected) < 0.045  # the bound and its reasoning: tests/test_generate_sampling.py
    # Power: emitting the draft's own samples would fail the bound by a wide margin.
    draft_joint = exact_joint(draft, prompt, lambda ids, scores: scores)
    assert 0.5 * (draft_joint - expected).abs().sum() > 0.2


def test_calibration_measures_an_offloaded_model(saved, tmp_path):
    """`StepCost.measure` (what `hf-specdec calibrate` runs) works on a model whose `device` is `meta`, and the
    profile of an offloaded model is not the in-memory one's (its costs differ: the weights stream every forward)."""
    from hf_specdec.costs.step_cost import StepCost
    from hf_specdec.costs.profile import profile_key

    target = load(saved["target"], tmp_path / "offload", **ALL_ON_DISK)
    cost = StepCost.measure(target, rows=(1,), tokens=(1, 4), contexts=(8,), repeats=1)
    assert float(cost(1, torch.tensor(4.0))) >= float(cost(1, torch.tensor(1.0))) > 0
    assert profile_key(target) != profile_key(load(saved["target"]))


def test_thin_linear_reaches_offloaded_layers(saved, tmp_path):
    """The host's faster linear form also runs in layers whose weights accelerate streams in from disk: the hook's
    inner forward is switched (the hook stays, so the streamed weights are the ones used), exactly, and restored."""
    from hf_specdec.costs.linear_forms import thin_linear

    target = load(saved["target"], tmp_path / "offload", device_map=CPU_DISK_MAP)
    layer = target.model.layers[1].mlp.down_proj
    assert layer.weight.device.type == "meta" and "_old_forward" in vars(layer)
    original, hooked = vars(layer)["_old_forward"], vars(layer)["forward"]
    input_ids, mask = prompts()
    expected = target(input_ids=input_ids, attention_mask=mask).logits
    calls = []
    with thin_linear([target], rows=range(1, 64)):
        inner = vars(layer)["_old_forward"]
        assert inner is not original and vars(layer)["forward"] is hooked
        vars(layer)["_old_forward"] = lambda x, _inner=inner: calls.append(x.shape) or _inner(x)
        got = target(input_ids=input_ids, attention_mask=mask).logits
        vars(layer)["_old_forward"] = inner
    assert calls and torch.allclose(got, expected, rtol=0, atol=1e-12)
    assert vars(layer)["_old_forward"] is original and layer.weight.device.type == "meta"


def test_linear_form_is_measured_for_a_model_all_on_disk(saved, tmp_path):
    """Calibration's small-row linear timing covers layers whose weights are on disk (a stand-in of each shape is
    timed), instead of finding no layer on the CPU and measuring nothing."""
    from hf_specdec.costs.linear_forms import measure_thin_linear

    target = load(saved["target"], tmp_path / "offload", **ALL_ON_DISK)
    assert all(m.weight.device.type == "meta" for m in target.modules() if type(m) is torch.nn.Linear)
    _, details, _, _ = measure_thin_linear(target, rows=(1, 2, 3), margin=0.8, repeats=1, attempts=1)
    assert set(details["linear_ms"]) == {"1", "2", "3"} and all(t > 0 for pair in details["linear_ms"].values()
                                                           for t in pair)
    assert all(m.weight.device.type == "meta" for m in target.modules() if type(m) is torch.nn.Linear)


# --- tensor parallelism under torchrun ------------------------------------------------------------------------------
CASES = ["greedy ngram", "greedy draft", "sampled ngram", "sampled draft", "greedy eagle", "sampled eagle"]


@pytest.mark.slow  # two processes under torchrun
def test_tensor_parallel_ranks_agree_and_equal_one_process(saved, tmp_path):
    from test_eagle import convert, make_target

    eagle_target = make_target(num_layers=4)
    eagle_target.save_pretrained(tmp_path / "eagle_target")
    convert(tmp_path / "eagle", eagle_target, 3)
    out = tmp_path / "tp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(Path(__file__)), str(saved["target"]), str(saved["draft"]), str(tmp_path / "eagle_target"),
               str(tmp_path / "eagle" / "dst"), str(out)]
    with subprocess.Popen(command, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as workers:
        try:
            log, _ = workers.communicate(timeout=300)
        except subprocess.TimeoutExpired:  # ranks that disagree would wait for each other forever
            os.killpg(workers.pid, 9)
            raise
    assert workers.returncode == 0, log[-4000:]
    results = json.loads(out.read_text())
    for case in CASES:
        ranks = results[case]
        assert ranks[0]["tp"] == ranks[1]["tp"], case  # every rank took the same decisions
        assert ranks[0]["tp"] == ranks[0]["single"], case  # and they are what one process gives
        assert ranks[0]["drafted"] > 0, case
    # The sampled cases ran with another seed on each rank; power: the seeds do lead to other samples.
    assert results["sampled draft"][0]["single"] != results["sampled draft"][1]["single"]
    assert results["sampled ngram"][0]["single"] != results["sampled ngram"][1]["single"]


def _tensor_parallel_worker(target_dir, draft_dir, eagle_target_dir, eagle_dir, out_path) -> None:
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    from hf_specdec import EagleSpeculator

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)

    def tp_model(path):
        model = load(path, distributed_config=DistributedConfig(tp_plan="auto"))
        assert model.tp_size == 2
        return model

    models = {"plain": (tp_model(target_dir), load(target_dir)),
              "eagle": (tp_model(eagle_target_dir), load(eagle_target_dir))}
    draft = load(draft_dir)
    input_ids, mask = prompts()
    results = {}
    for case in CASES:
        mode, kind = case.split()
        tp, single = models["eagle" if kind == "eagle" else "plain"]
        speculator = {"ngram": lambda: "ngram", "draft": lambda: draft,
                      "eagle": lambda: EagleSpeculator.from_pretrained(eagle_dir)}[kind]
        kwargs = dict(do_sample=False) if mode == "greedy" else dict(do_sample=True, temperature=0.9)
        runs = {}
        for name, model in (("tp", tp), ("single", single)):
            torch.manual_seed(100 + rank)  # another random state on each rank: rank 0's must win
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=16,
                                 speculator=speculator(), num_speculative_tokens=3, speculative_schedule="constant",
                                 return_dict_in_generate=True, **kwargs)
            runs[name] = out.sequences.tolist()
            runs["drafted"] = out.speculative_metrics.num_draft_tokens
        results[case] = runs
    gathered = [None, None]
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out_path).write_text(json.dumps({case: [g[case] for g in gathered] for case in CASES}))
    dist.destroy_process_group()


if __name__ == "__main__":
    _tensor_parallel_worker(*sys.argv[1:6])
