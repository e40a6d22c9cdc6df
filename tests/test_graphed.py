"""Compiled (graphed) steps, forced on the CPU: exact like the eager path, and eager wherever they cannot run.

Compiling takes seconds per shape on these tiny models, so each test compiles a few shapes only.
"""

import logging

import pytest
import torch
from conftest import make_model, ragged_batch, repetitive_prompt
from test_generate_sampling import SAMPLES, VOCAB, exact_joint, peaky_model, tv
from torch._dynamo.utils import counters
from transformers import CompileConfig, LogitsProcessorList

import hf_specdec
from hf_specdec.runners import graphed
from hf_specdec.runners.graphed import graph_refusal, graph_settings, requested_settings


def compiled_entries(model) -> list[dict]:
    return list(model.__dict__.get("_hf_specdec_graphed", {}).values())


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv("HF_SPECDEC_COMPILE", "1")
    monkeypatch.setenv("HF_SPECDEC_CALIBRATION", "off")


@pytest.mark.parametrize("speculator", ["off", "ngram"])
def test_compiled_steps_give_plain_greedy_output(forced, speculator):
    model = make_model("llama")
    input_ids, mask = ragged_batch(rows=3, width=14)
    input_ids[:, 8:] = input_ids[:, 2:8]  # a repeat, so n-gram drafts
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    options = {"speculative_schedule": "constant", "num_speculative_tokens": 3} if speculator == "ngram" else {}
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False, speculator=speculator,
                         return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, expected)
    (entry,) = compiled_entries(model)
    assert entry["trusted"] and "failed" not in entry and entry["steps"] > 0
    assert set(entry["trials"]) == entry["trusted"]  # every shape it ran was checked against its eager twin first
    if speculator == "ngram":
        assert out.speculative_metrics.num_draft_tokens > 0
        assert len(entry["trusted"]) > 1  # decode and verify widths: each checked
    # A second call reuses the compiled function (nothing compiled again from scratch) and is as exact.
    again = model.generate(input_ids, attention_mask=mask, max_new_tokens=24, do_sample=False, speculator=speculator,
                           **options)
    assert torch.equal(again, expected) and len(compiled_entries(model)) == 1


def test_a_draft_model_compiles_its_own_steps(forced):
    target, draft = make_model("llama"), make_model("llama", seed=1)
    input_ids, mask = ragged_batch(rows=2, width=12)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False, speculator=draft,
                          num_speculative_tokens=3, speculative_schedule="constant")
    assert torch.equal(out, expected)
    assert compiled_entries(target)[0]["steps"] > 0 and compiled_entries(draft)[0]["steps"] > 0


def test_compiled_verify_keeps_the_exact_sampling_distribution(forced):
    target = peaky_model(0, sharpness=4.0)
    prompt = torch.tensor([[1, 3, 4, 3, 4, 3]])
    expected = exact_joint(target, prompt, LogitsProcessorList())
    torch.manual_seed(0)
    out = target.generate(prompt.expand(SAMPLES, -1), max_new_tokens=2, do_sample=True, speculator="ngram",
                          num_speculative_tokens=3, speculative_schedule="constant", return_dict_in_generate=True)
    assert out.speculative_metrics.num_draft_tokens > 0
    (entry,) = compiled_entries(target)
    assert entry["steps"] > 0  # the verify step ran compiled
    pairs = out.sequences[:, -2] * VOCAB + out.sequences[:, -1]
    assert tv(pairs, expected) < 0.045


def test_compiled_seeded_sampling_repeats(forced):
    model = make_model("llama")
    prompt = repetitive_prompt(rows=2, width=16)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(model.generate(prompt, max_new_tokens=16, do_sample=True, temperature=0.9, speculator="ngram",
                                   speculative_schedule="constant"))
    assert torch.equal(runs[0], runs[1])
    assert compiled_entries(model)[0]["steps"] > 0


def test_switches(monkeypatch):
    model = make_model("llama")
    cpu = torch.device("cpu")
    monkeypatch.delenv("HF_SPECDEC_COMPILE", raising=False)
    assert graph_settings(model, cpu) is None  # off by default on CPUs
    assert graph_settings(model, torch.device("cuda")).options["mode"] == "reduce-overhead"
    assert graph_settings(model, torch.device("cuda")).bucket
    config = model.generation_config
    config.compile_config = CompileConfig(fullgraph=False, mode="default")
    settings = graph_settings(model, cpu, config)  # a compile_config asks for it on any device, with its options
    assert settings.options["mode"] == "default" and settings.options["dynamic"] is True and not settings.bucket
    config.disable_compile = True
    assert graph_settings(model, cpu, config) is None
    config.disable_compile = False
    monkeypatch.setenv("HF_SPECDEC_COMPILE", "0")
    assert graph_settings(model, torch.device("cuda"), config) is None


def test_a_bad_switch_value_is_refused(monkeypatch):
    monkeypatch.setenv("HF_SPECDEC_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="HF_SPECDEC_COMPILE must be 1/on"):
        requested_settings(torch.device("cpu"))


def test_options_torch_compile_refuses_run_eagerly_and_say_so(monkeypatch, caplog):
    """transformers' CompileConfig defaults to mode="reduce-overhead"; adding backend options makes torch.compile
    refuse the pair ("Either mode or options"): the call runs eagerly, exact, and says why."""
    monkeypatch.setenv("HF_SPECDEC_CALIBRATION", "off")
    model = make_model("llama")
    model.generation_config.compile_config = CompileConfig(options={"max_autotune": False})
    assert_off_is_exact(model, caplog)
    (entry,) = compiled_entries(model)
    assert entry["fn"] is None and "failed" in entry
    assert any("could not compile LlamaForCausalLM's steps" in r.getMessage() for r in caplog.records)


def test_disable_compile_runs_eagerly(forced):
    model = make_model("llama")
    prompt = repetitive_prompt(rows=1, width=16)
    model.generate(prompt, max_new_tokens=4, do_sample=False, speculator="ngram", disable_compile=True)
    assert compiled_entries(model) == []


def test_models_the_step_cannot_describe_stay_eager(forced, caplog):
    model = make_model("gemma3")  # sliding-window layers
    assert "sliding_attention" in graph_refusal(model)
    prompt = repetitive_prompt(rows=1, width=16)
    expected = model.generate(prompt, max_new_tokens=10, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        for _ in range(2):
            out = model.generate(prompt, max_new_tokens=10, do_sample=False, speculator="ngram")
            assert torch.equal(out, expected)
    assert compiled_entries(model) == []
    assert sum("runs Gemma3ForCausalLM's steps eagerly" in r.getMessage() for r in caplog.records) == 1


def assert_off_is_exact(model, caplog) -> None:
    """`speculator="off"` on a ragged batch of 2, its warnings captured, gives plain greedy's output."""
    input_ids, mask = ragged_batch(rows=2, width=12)
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="hf_specdec"):
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, speculator="off")
    assert torch.equal(out, expected)


def force_buckets(monkeypatch) -> None:
    """The CUDA-graph layout (rows padded to a power of two, contexts and block tables to buckets) on the CPU."""
    real = requested_settings

    def bucketed(device, generation_config=None):
        settings = real(device, generation_config)
        settings.bucket = True
        return settings

    monkeypatch.setattr("hf_specdec.decode.engine.requested_settings", bucketed)


def test_a_compile_failure_falls_back_to_eager_once(forced, monkeypatch, caplog):
    def broken(fn, **options):
        def run(*args):
            raise RuntimeError("backend exploded")
        return run

    monkeypatch.setattr(graphed.torch, "compile", broken)
    model = make_model("llama")
    assert_off_is_exact(model, caplog)
    assert [r.getMessage() for r in caplog.records if "could not compile" in r.getMessage()] == [
        "hf_specdec could not compile LlamaForCausalLM's steps and runs them eagerly (RuntimeError: backend "
        "exploded)"]


def test_running_out_of_memory_now_and_then_runs_those_steps_eagerly_only(forced, monkeypatch, caplog):
    """Device memory short for a compiled step (a graph's recording, say) sends that step to eager and later steps
    try again; only `OUT_OF_MEMORY_LIMIT` of them turn compiling off for the model."""
    real = graphed.torch.compile
    calls = []

    def short_now_and_then(fn, **options):
        compiled = real(fn, **options)

        def run(*args):
            calls.append(1)
            if len(calls) in (2, 4):
                raise torch.OutOfMemoryError("out of memory (made up)")
            return compiled(*args)
        return run

    monkeypatch.setattr(graphed.torch, "compile", short_now_and_then)
    model = make_model("llama")
    assert_off_is_exact(model, caplog)
    (entry,) = compiled_entries(model)
    assert "failed" not in entry and entry["out_of_memory"] == 2 and entry["steps"] > 0
    monkeypatch.setattr(graphed, "OUT_OF_MEMORY_LIMIT", 3)
    calls.clear()

    def always_short(fn, **options):
        def run(*args):
            raise torch.OutOfMemoryError("out of memory (made up)")
        return run

    monkeypatch.setattr(graphed.torch, "compile", always_short)
    other = make_model("llama", seed=2)
    assert_off_is_exact(other, caplog)
    assert "OutOfMemoryError" in compiled_entries(other)[0]["failed"]


def test_a_compiled_step_that_disagrees_is_not_trusted(forced, monkeypatch, caplog):
    def skewed(fn, **options):
        def run(hidden, *args):
            logits, states = fn(hidden, *args)
            return logits + 1e-2 * torch.randn_like(logits), states
        return run

    monkeypatch.setattr(graphed.torch, "compile", skewed)
    model = make_model("llama")
    assert_off_is_exact(model, caplog)
    (entry,) = compiled_entries(model)
    assert not entry["trusted"] and "differ" in entry["failed"] and entry["steps"] == 0
    assert any("logits differ from the eager step's" in r.getMessage() for r in caplog.records)


def test_bucketed_rows_and_contexts_are_exact(forced, monkeypatch):
    """The CUDA-graph layout (rows padded to a power of two, contexts to a bucket), run on the CPU."""
    force_buckets(monkeypatch)
    monkeypatch.setattr(graphed, "CONTEXT_BUCKET", 8)
    model = make_model("llama")
    input_ids, mask = ragged_batch(rows=3, width=14)
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False, speculator="off")
    assert torch.equal(out, expected) and compiled_entries(model)[0]["steps"] > 0


def test_served_requests_with_compiled_steps_equal_their_solo_runs(forced):
    """The serving engine compiles its steps too (at its warm-up); requests joining and leaving mid-way change the
    rows each step holds, and every answer still equals its solo run."""
    from test_serving import five_requests_equal_their_solo_runs, served_model, word_tokenizer

    from hf_specdec.serving import ServingEngine

    model = served_model()
    engine = ServingEngine(model, word_tokenizer(), "ngram", num_speculative_tokens=4, max_batch_size=3,
                           schedule="constant")
    five_requests_equal_their_solo_runs(engine, model)
    (entry,) = compiled_entries(model)
    assert entry["trusted"] and entry["steps"] > 0


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_head_and_its_target_compile_and_stay_exact(forced, tmp_path, version):
    """The target's verify (with the hidden states the head reads) and the head's own forwards (per-token features)
    run compiled; the output is still the target's greedy one."""
    from test_eagle import convert, make_target, speculate

    from hf_specdec import EagleSpeculator

    target = make_target(num_layers=2 if version == 1 else 4)
    spec = EagleSpeculator.from_pretrained(convert(tmp_path, target, version))
    input_ids, mask = ragged_batch(rows=2)
    out = speculate(target, spec, input_ids, mask)
    expected = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    assert torch.equal(out.sequences, expected) and out.speculative_metrics.num_draft_tokens > 0
    assert compiled_entries(target)[0]["steps"] > 0
    (head,) = compiled_entries(spec.head)
    assert head["trusted"] and head["steps"] > 0 and head["returns_tensor"]


@pytest.mark.parametrize("bucket", [False, True])
def test_compiled_steps_on_the_attention_kernel_read_the_pools_in_place(forced, monkeypatch, bucket):
    """On CUDA the compiled step attends through the paged attention kernel, an opaque custom op reading the pools
    through the block tables (no context length in the compiled shapes); here on the Triton interpreter, with and
    without the CUDA-graph buckets. The output is still plain greedy's."""
    pytest.importorskip("triton")
    import hf_specdec.kernels.paged_attention.triton_kernel as attention_kernel
    from hf_specdec.kernels._backend import ENV_VAR

    monkeypatch.setenv(ENV_VAR, "triton")
    launches = []
    original = attention_kernel.paged_attention_triton
    monkeypatch.setattr(attention_kernel, "paged_attention_triton",
                        lambda *args, **kwargs: launches.append(args[0].shape) or original(*args, **kwargs))
    if bucket:
        force_buckets(monkeypatch)
    model = make_model("llama", dtype=torch.float32)
    input_ids, mask = ragged_batch(rows=3, width=10)
    input_ids[:, 6:] = input_ids[:, 2:6]
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, speculator="ngram",
                         num_speculative_tokens=2, speculative_schedule="constant")
    assert torch.equal(out, expected)
    (entry,) = compiled_entries(model)
    assert entry["trusted"] and entry["steps"] > 0
    assert any(shape[0] == (4 if bucket else 3) for shape in launches)  # the compiled steps' rows, padded or not


def test_a_profile_with_packed_linear_layers_still_compiles(forced, monkeypatch, tmp_path, caplog):
    """A profile that packs linear weights for oneDNN (an AMD EPYC's, say) leaves the packed form out of compiled
    steps (inductor cannot lower the opaque packed copy), so the steps compile instead of falling back."""
    from hf_specdec.costs import linear_forms
    from hf_specdec.costs.profile import Profile, profile_key, save_profile
    from hf_specdec.costs.step_cost import StepCost

    if not linear_forms.packed_linear_supported(torch.zeros(1)):
        pytest.skip("torch built without oneDNN")
    monkeypatch.setenv("HF_SPECDEC_CALIBRATION", "cached")
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    model = make_model("llama", dtype=torch.float32)
    every = {linear_forms.shape_key(m.weight.shape): tuple(range(1, 17)) for m in model.modules()
             if isinstance(m, torch.nn.Linear)}
    flat = StepCost(per_row=0.0, points=((1, 10.0), (256, 10.0)))
    save_profile(model, Profile(profile_key(model), flat, (), {}, {}, tuple(range(1, 17)), {}, every))
    input_ids, mask = ragged_batch(rows=2, width=10)
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    with caplog.at_level(logging.INFO, logger="hf_specdec"):
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, speculator="off")
    assert torch.equal(out, expected)
    (entry,) = compiled_entries(model)
    assert "failed" not in entry and entry["steps"] > 0
    assert not [r for r in caplog.records if "could not compile" in r.getMessage()]


def test_cuda_graph_steps_keep_their_pools_from_one_call_to_the_next(forced, monkeypatch):
    """Under CUDA graphs (the bucketed layout, forced here) a call starts with the pools the model's last call left,
    so graphs recorded at their addresses replay instead of recording again; a cache running
    beside a live one allocates its own; a model cast to another dtype gets fresh pools; every output exact."""
    from hf_specdec.runners.dense import make_runner
    from hf_specdec.runners.graphed import GraphSettings

    force_buckets(monkeypatch)
    model = make_model("llama")
    input_ids, mask = ragged_batch(rows=3, width=14)
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    runs = []
    for _ in range(2):
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=40, do_sample=False, speculator="off")
        assert torch.equal(out, expected)
        kept = model.__dict__["_hf_specdec_pools"]
        runs.append({layer: pool.data_ptr() for layer, pool in kept.keys.items()})
    assert runs[0] and runs[0] == runs[1]  # the second call wrote into the first's pools
    settings = GraphSettings({}, True)
    first, second = make_runner(model), make_runner(model)
    first.use_graphs(settings)
    second.use_graphs(settings)  # the first still lives and holds them
    assert first.cache.kept is kept and second.cache.kept is None
    assert {layer: p.data_ptr() for layer, p in first.cache.key_pools.items()} == runs[0]
    del first, second
    model.to(torch.float64)
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, speculator="off")
    assert torch.equal(out, expected) and all(p.dtype == torch.float64 for p in kept.keys.values())
    assert hf_specdec.release_kv_pools(model) == kept.memory_bytes() > 0
    assert "_hf_specdec_pools" not in model.__dict__


def test_a_draft_on_another_kind_of_device_follows_that_devices_switches(monkeypatch):
    """The target on CUDA records CUDA graphs by default; a draft model on the CPU beside it stays eager (the CPU's
    default) unless the switches ask for compiling there, and then compiles without CUDA graphs."""
    from types import SimpleNamespace

    from hf_specdec.decode.engine import compile_steps
    from hf_specdec.speculators import DraftModelSpeculator

    monkeypatch.delenv("HF_SPECDEC_COMPILE", raising=False)
    target, draft = make_model("llama"), make_model("llama", seed=1)
    speculator = DraftModelSpeculator(draft)
    compile_steps(target, SimpleNamespace(device=torch.device("cuda")), speculator)
    assert speculator.graph_settings.bucket and speculator.graph_settings.options["mode"] == "reduce-overhead"
    assert speculator.graph_settings_on(torch.device("cuda")) is speculator.graph_settings
    assert speculator.graph_settings_on(torch.device("cpu")) is None
    monkeypatch.setenv("HF_SPECDEC_COMPILE", "1")
    on_cpu = speculator.graph_settings_on(torch.device("cpu"))
    assert on_cpu is not None and not on_cpu.bucket and "mode" not in on_cpu.options
    compile_steps(target, SimpleNamespace(device=torch.device("cpu")), speculator, GenerationConfigLike())
    assert speculator.graph_settings is None and speculator.graph_settings_on(torch.device("cuda")) is None


class GenerationConfigLike:
    disable_compile = True
    compile_config = None


@pytest.mark.parametrize("speculator", ["off", "ngram"])
def test_cpu_steps_compile_with_their_weights_frozen_and_stay_exact(forced, monkeypatch, tmp_path, speculator):
    """Switched on without a compile_config of the user's, a CPU's compiled steps freeze the weights into the graph
    (inductor's C++ GEMM template packs them; `graphed.CPU_OPTIONS`), take every linear layer as `F.linear` (a
    profile's forms left out, though this one chooses them everywhere), and give plain greedy output."""
    from hf_specdec.costs import linear_forms
    from hf_specdec.costs.profile import Profile, profile_key, save_profile
    from hf_specdec.costs.step_cost import StepCost

    monkeypatch.setenv("HF_SPECDEC_CALIBRATION", "cached")
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path))
    model = make_model("llama", dtype=torch.float32)
    settings = graph_settings(model, torch.device("cpu"))
    assert settings.frozen and settings.options["options"] == graphed.CPU_OPTIONS
    every = {linear_forms.shape_key(m.weight.shape): tuple(range(1, 17)) for m in model.modules()
             if isinstance(m, torch.nn.Linear)}
    flat = StepCost(per_row=0.0, points=((1, 10.0), (256, 10.0)))
    save_profile(model, Profile(profile_key(model), flat, tuple(range(1, 17)), {}, every, tuple(range(1, 17)), {}))
    switched = []
    thin_forward = linear_forms._thin_forward
    monkeypatch.setattr(linear_forms, "_thin_forward", lambda *a, **k: switched.append(1) or thin_forward(*a, **k))
    input_ids, mask = ragged_batch(rows=2, width=12)
    input_ids[:, 7:] = input_ids[:, 1:6]  # a repeat, so n-gram drafts
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    options = {"speculative_schedule": "constant", "num_speculative_tokens": 3} if speculator == "ngram" else {}
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False, speculator=speculator,
                         **options)
    assert torch.equal(out, expected)
    (entry,) = compiled_entries(model)
    assert "failed" not in entry and entry["steps"] > 0 and entry["trusted"]
    assert not switched  # no layer took a profile's form: the frozen graph has its own
    eager = model.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False, speculator=speculator,
                           disable_compile=True, **options)
    assert switched and torch.equal(eager, expected)  # eager steps still take the profile's forms


def test_weights_changed_after_freezing_are_not_missed(forced, caplog):
    """A frozen graph holds the weights it was compiled with: changed in place since, the steps run eagerly, say so,
    and give the new weights' output."""
    model = make_model("llama", dtype=torch.float32)
    input_ids, mask = ragged_batch(rows=2, width=10)
    first = model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, speculator="off")
    assert torch.equal(first, model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # every greedy choice moves
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert not torch.equal(expected, first)
    with caplog.at_level(logging.INFO, logger="hf_specdec"):
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=12, do_sample=False, speculator="off")
    assert torch.equal(out, expected)
    assert [r for r in caplog.records if "weights changed since" in r.getMessage()]


def test_a_compiled_steps_first_run_is_not_timed_for_the_cost_model(forced, monkeypatch):
    """A shape's first compiled step (its compile and its eager twin's check) is not a step's usual time: the cost
    model that prices drafts by the steps' timings (on for frozen steps) never sees it."""
    from hf_specdec.costs.step_cost import MeasuredStepCost
    from hf_specdec.decode.step import Step

    seen = []
    observe = MeasuredStepCost.observe
    monkeypatch.setattr(MeasuredStepCost, "observe", lambda self, *a: seen.append(a[-1]) or observe(self, *a))
    trials = []
    run = graphed.GraphedSteps.run

    def counted(self, *a, **k):
        out = run(self, *a, **k)
        trials.append(self.trial)
        return out

    monkeypatch.setattr(graphed.GraphedSteps, "run", counted)
    steps = []
    call = Step.__call__
    monkeypatch.setattr(Step, "__call__", lambda self, *a: steps.append(1) or call(self, *a))
    model = make_model("llama", dtype=torch.float32)
    input_ids, mask = ragged_batch(rows=1, width=12)
    input_ids[:, 7:] = input_ids[:, 1:6]
    model.generate(input_ids, attention_mask=mask, max_new_tokens=20, do_sample=False, speculator="ngram")
    assert any(trials) and not all(trials) and seen
    assert len(seen) <= len(steps) - trials.count(True)  # no step whose compiled code ran for the first time


def test_a_frozen_steps_graph_for_several_tokens_is_compiled_at_the_tune_width(forced, monkeypatch):
    """Inductor tunes a frozen graph's products for the call that compiles it, and the graph for several tokens a row
    serves every width: a first verify wider than `TUNE_WIDTH` compiles it with a step of that width first (its
    keys and values sent to the scratch slot), and the output stays plain greedy."""
    widths = []
    compile_ = torch.compile

    def recording(fn, **options):
        compiled = compile_(fn, **options)

        def call(*args):
            widths.append(args[3].shape[1])  # graphed_forward's input_ids, after (hidden, extra, block_size)
            return compiled(*args)
        return call

    monkeypatch.setattr(torch, "compile", recording)
    model = make_model("llama", dtype=torch.float32)
    input_ids, mask = ragged_batch(rows=1, width=12)
    input_ids[:, 7:] = input_ids[:, 1:6]  # a repeat, so n-gram drafts
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    counters.clear()
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False, speculator="ngram",
                         speculative_schedule="constant", num_speculative_tokens=4)
    assert torch.equal(out, expected)
    several = [w for w in widths if w > 1]
    assert several[0] == graphed.TUNE_WIDTH and max(several) > graphed.TUNE_WIDTH
    assert widths.count(graphed.TUNE_WIDTH) == 1  # only the tuning call: n-gram's verifies here are 5 tokens wide
    assert counters["stats"]["unique_graphs"] == 2  # one token, several: the wider steps reuse the tuned graph
    (entry,) = compiled_entries(model)
    assert "failed" not in entry and entry["tuned"] == {(True, False, False)}


def test_each_models_steps_compile_apart_from_other_models(forced, monkeypatch):
    """Dynamo counts compiled variants per code object: each model's steps have their own, so other models' graphs
    never use up a model's (here with limits of one variant per object and two per code object, a third model
    would otherwise run eagerly)."""
    monkeypatch.setattr(graphed, "RECOMPILE_LIMIT", 1)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    monkeypatch.setattr(torch._dynamo.config, "accumulated_recompile_limit", 2)
    torch._dynamo.reset()
    input_ids, mask = ragged_batch(rows=1, width=10)
    models = [make_model("llama", dtype=torch.float32) for _ in range(3)]
    for model in models:
        counters.clear()
        expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False, speculator="off")
        assert torch.equal(out, expected)
        assert counters["stats"]["unique_graphs"] == 1  # its one-token step, compiled for it


def test_adaptive_k_prices_compiled_steps_as_padded(forced, monkeypatch):
    """A compiled step feeds every row the widest row's tokens (one graph per width), so adaptive k prices one k for
    all rows there, as for padded steps; eager steps stay packed (each row its own drafts)."""
    from hf_specdec.costs import adaptive

    policies = []
    init = adaptive.AdaptiveK.__init__
    monkeypatch.setattr(adaptive.AdaptiveK, "__init__",
                        lambda self, *a, **k: policies.append(self) or init(self, *a, **k))
    model = make_model("llama", dtype=torch.float32)
    input_ids, mask = ragged_batch(rows=2, width=12)
    input_ids[:, 7:] = input_ids[:, 1:6]
    expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    for disable in (False, True):
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=10, do_sample=False, speculator="ngram",
                             disable_compile=disable)
        assert torch.equal(out, expected)
    assert [p.packed for p in policies] == [False, True]


def test_weights_are_not_frozen_where_their_copy_would_not_fit(forced, monkeypatch, caplog):
    """Freezing packs a copy of the weights; with less than twice their size available the steps compile unfrozen
    (and say so), still exact."""
    import psutil

    real = psutil.virtual_memory()
    model = make_model("llama", dtype=torch.float32)
    size = graphed.weight_bytes(model)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=size))
    with caplog.at_level(logging.INFO, logger="hf_specdec"):
        settings = graph_settings(model, torch.device("cpu"))
        assert settings is not None and not settings.frozen
        input_ids, mask = ragged_batch(rows=2, width=10)
        expected = model.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, speculator="off")
    assert torch.equal(out, expected)
    assert [r for r in caplog.records if "without freezing the weights" in r.getMessage()]
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=4 * size))
    assert graph_settings(make_model("llama", dtype=torch.float32), torch.device("cpu")).frozen
