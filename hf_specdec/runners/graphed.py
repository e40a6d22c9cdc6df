"""Compiled (graphed) decode and verify steps: a `ModelRunner`'s narrow steps as one `torch.compile`d function.

A step that feeds each row at most `MAX_WIDTH` tokens (decoding, verifying a chain of drafts) runs the model through
`graphed_forward`, whose every input is a tensor: the token ids, their positions, the pool slots they are written to,
each row's context slots and the KV pools themselves. Inside it the model sees `StepCache` (writes, then gathers each
row's context) and our attention (`cache/attention.py`) takes the `GRAPHED` plan: masked SDPA by a mask built from
the positions. Nothing in it reads a Python value that changes from step to step, so one compilation (shapes
symbolic) serves every step, and on CUDA each bucket of rows and context becomes one CUDA graph (inductor's
`mode="reduce-overhead"`). On a CPU the weights are frozen into the graph (`CPU_OPTIONS`), where inductor's C++
GEMM template computes a few rows' product at about the price of one. Prefill, draft trees and the models the check
below refuses stay eager.

Switches follow transformers' own compile knobs: on by default on CUDA (as `generate` compiles a static cache's
decode there), off on CPUs, where compiling takes minutes in every process (docs/benchmarks.md, "Compiled steps
on a CPU"); `generation_config.disable_compile=True` turns it off, a `compile_config` turns it on (with its options)
on any device, and `HF_SPECDEC_COMPILE=0`/`1` overrides both defaults. A model that fails to compile, or whose
compiled steps disagree with their eager twins (each new step shape is checked on its first calls), runs eagerly and
says so once.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..cache.attention import GRAPHED, PLAN_KWARG, GraphedKernelPlan
from ..cache.layout import SCRATCH_SLOT
from ..kernels.paged_attention.reference import attention_mask, context_slots

logger = logging.getLogger("hf_specdec")

MAX_WIDTH = 17  # tokens per row a graphed step may feed: one plus up to 16 drafts
SWITCH_ON, SWITCH_OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")  # HF_SPECDEC_COMPILE's values
RECOMPILE_LIMIT = 64  # dynamo's compiled variants per code object, at least (see `GraphedSteps`)
CONTEXT_BUCKET = 256  # with bucketing (CUDA graphs), contexts are padded to a multiple of this many slots
# Agreement asked of a compiled step with its eager twin (the logits' largest difference, relative to their
# largest magnitude): compiled kernels reorder sums and vectorise functions, so bits may differ, never more than
# rounding. Models compute some parts in float32 whatever their dtype (rotary angles), so float64 models get float32's.
TRIAL_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4}
TRIAL_TOLERANCE_LOW = 1e-2  # half precision
# Each new step shape (rows, width, hidden states or not, attention path) is checked against its eager twin on its
# first calls: one where the compiled code runs as traced; three where CUDA graphs are recorded (a warm-up run, the
# recording, then the first replay).
TRIALS, TRIALS_GRAPHED = 1, 3
# Inductor's options for compiled steps on a CPU (when switched on without a `compile_config` of the user's own):
# the weights frozen into the graph (each linear layer's weight packed once into its own blocked layout, a copy the
# size of the weights) and every product autotuned between inductor's C++ GEMM template and oneDNN. The template's
# micro-kernels keep a product of 1-4 rows at the price of one: SmolLM2-135M's forward over 400 cached tokens on a
# 2-core AMD EPYC took 23.4 / 22.5 / 23.7 / 22.8 ms at 1-4 tokens against the eager step's 34.6 / 34.8 / 43.6 / 40.9
# with this host's linear forms (docs/benchmarks.md, "Compiled steps on a CPU"). Without freezing inductor keeps the
# stock product and compiled steps run no faster than eager ones. Its price: compiling takes minutes, in every
# process (graphs with frozen weights are not cached on disk), and weights changed in place after it are not seen
# (`GraphedSteps` then runs eagerly).
CPU_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
# Frozen steps: inductor tunes each product's kernel for the shapes of the call that compiles the graph, and the graph
# for several tokens a row then serves every width. First compiled at 12 tokens, SmolLM2-135M's forward (1 row, 400
# cached tokens, 2-core AMD EPYC) took 35.1 / 30.5 / 28.9 / 30.2 / 39.2 ms at 2 / 3 / 4 / 6 / 12 tokens; first
# compiled at 2, 22.6 / 23.4 / 22.6 / 30.4 / 44.7 (one token: 23.4). Verifies of a few drafts are the common ones, so
# that graph is compiled at this width whatever width first needs it (`GraphedSteps._tune`).
TUNE_WIDTH = 2
# Device memory running short for a step's graph (recording one, or a bigger bucket) is a moment's, not the model's:
# that step runs eagerly and later ones try again; only this many in one process turn compiling off for the model.
OUT_OF_MEMORY_LIMIT = 3


class StepCache(Cache):
    """The cache a compiled step's model sees: each layer writes its new keys and values at `write_slots` and gets
    back every row's context gathered through `slots` (`[rows, num_context]`, padding at the scratch slot), or, with
    `slots=None` (the kernel reads the pools in place), the pools themselves. It holds only tensors the step was
    given, so tracing it adds no guard that changes from step to step."""

    is_compileable = True

    def __init__(self, key_pools, value_pools, write_slots: torch.Tensor, slots: torch.Tensor):
        self.layers = []  # transformers' mask helpers read it; our mask is built by the step
        self.key_pools, self.value_pools = key_pools, value_pools
        self.write_slots, self.slots = write_slots, slots

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rows, heads, q, dim = key_states.shape
        key_pool, value_pool = self.key_pools[layer_idx], self.value_pools[layer_idx]
        # index_put_ (not index_copy_): inductor writes it into the pool in place, with no copy of the pool.
        key_pool.index_put_((self.write_slots,), key_states.transpose(1, 2).reshape(rows * q, heads, dim))
        value_pool.index_put_((self.write_slots,), value_states.transpose(1, 2).reshape(rows * q, heads, -1))
        if self.slots is None:
            return key_pool, value_pool
        flat = self.slots.reshape(-1)
        shape = (*self.slots.shape, heads)
        keys = key_pool.index_select(0, flat).view(*shape, dim).transpose(1, 2)
        values = value_pool.index_select(0, flat).view(*shape, value_pool.shape[-1]).transpose(1, 2)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given; nothing slices buffers by it in the models `graph_refusal` admits


def graphed_forward(model, cache_kwarg: str, hidden: bool, extra: dict, block_size: int | None, input_ids,
                    position_ids, write_slots, slots, key_pools, value_pools):
    """One step of `model` over `StepCache`: logits at every fed position `[rows, q, vocab]` and, with `hidden`, the
    hidden states; a draft head's own output (a tensor `[rows, q, hidden]`) and None. `extra`: the model's other
    arguments (a head's per-token features `[rows, q, ...]`, flags). `slots`: each row's context slots, gathered
    and attended by masked SDPA; or, with `block_size`, each row's block table, read in place by the paged
    attention kernel (`kernels/paged_attention/graph_op.py`). The function `torch.compile` captures."""
    if block_size is None:
        mask, plan = attention_mask(position_ids, slots.shape[1], None), GRAPHED
        cache = StepCache(key_pools, value_pools, write_slots, slots)
    else:
        mask, plan = None, GraphedKernelPlan(slots, position_ids, block_size)
        cache = StepCache(key_pools, value_pools, write_slots, None)
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **{cache_kwarg: cache},
                use_cache=True, logits_to_keep=0, output_hidden_states=hidden, **extra, **{PLAN_KWARG: plan})
    if isinstance(out, torch.Tensor):
        return out, None
    return out.logits, (out.hidden_states if hidden else None)


@dataclass
class GraphSettings:
    """How a model's graphed steps compile: `torch.compile`'s keyword arguments, and whether shapes are padded to
    buckets (rows to a power of two, contexts to `CONTEXT_BUCKET`) so that CUDA graphs are few and reused."""

    options: dict
    bucket: bool

    @property
    def key(self) -> tuple:
        return tuple(sorted((k, repr(v)) for k, v in self.options.items())) + (self.bucket,)

    @property
    def frozen(self) -> bool:
        """Whether the compiled graph holds the weights as constants (inductor's `freezing`): the steps then take
        each linear layer as `F.linear` (the graph packs its weights itself), and a weight changed later is not
        seen."""
        return bool((self.options.get("options") or {}).get("freezing"))


def graph_settings(model, device: torch.device, generation_config=None) -> GraphSettings | None:
    """Whether (and how) the steps of a `generate(speculator=...)` call on `model` (its inputs on `device`) are
    compiled; None: eager."""
    return for_model(requested_settings(device, generation_config), model)


def requested_settings(device: torch.device, generation_config=None) -> GraphSettings | None:
    """What the call's switches ask for on `device` (see the module's docstring), whatever the model; None: eager."""
    config = generation_config
    if config is not None and getattr(config, "disable_compile", False):
        return None
    switch = os.environ.get("HF_SPECDEC_COMPILE", "").strip().lower()
    if switch not in ("", *SWITCH_ON, *SWITCH_OFF):
        raise ValueError(f"HF_SPECDEC_COMPILE must be 1/on (compile hf_specdec's steps) or 0/off (run them eagerly), "
                         f"got {switch!r}")
    if switch in SWITCH_OFF:
        return None
    compile_config = getattr(config, "compile_config", None)
    if not (switch in SWITCH_ON or compile_config is not None or device.type == "cuda"):
        return None
    if compile_config is not None:
        options = compile_config.to_dict()
        if options.get("dynamic") is None:  # one graph with symbolic rows and context, not one per step
            options["dynamic"] = True
    else:
        options = {"dynamic": True, "fullgraph": False}
        if device.type == "cuda":
            options["mode"] = "reduce-overhead"
        elif device.type == "cpu":
            options["options"] = dict(CPU_OPTIONS)
    # Shapes bucketed wherever inductor records CUDA graphs: these modes, or its `triton.cudagraphs` option
    graphs = options.get("mode") in ("reduce-overhead", "max-autotune") or bool(
        (options.get("options") or {}).get("triton.cudagraphs"))
    return GraphSettings(options, bucket=device.type == "cuda" and graphs)


def for_model(settings: GraphSettings | None, model) -> GraphSettings | None:
    """`settings` where `model`'s steps can be graphed; None (said once per model) where `graph_refusal` refuses."""
    if settings is None:
        return None
    why = graph_refusal(model)
    if why is not None:
        say_once(model, f"hf_specdec runs {type(model).__name__}'s steps eagerly: {why}")
        return None
    if settings.frozen:  # the frozen graph packs a copy of the weights: only where it leaves room
        import psutil

        need = weight_bytes(model)
        available = psutil.virtual_memory().available
        if need > available / 2:
            say_once(model, f"hf_specdec compiles {type(model).__name__}'s steps without freezing the weights: the "
                            f"frozen graph's packed copy of them ({need / 2**30:.1f} GiB) would take more than half "
                            f"the {available / 2**30:.1f} GiB of memory available now")
            options = {k: v for k, v in settings.options.items() if k != "options"}
            return GraphSettings(options, settings.bucket)
    return settings


def graph_refusal(model) -> str | None:
    """Why `model`'s steps cannot be graphed by `graphed_forward` (None: they can, subject to the first step's trial):
    its layers attend through windows or caches the step's one causal mask does not describe, or its weights are
    spread over devices."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention"}:
        return f"its layers are of kinds {sorted(layer_types)} (only full attention layers are graphed)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False:
        return "it attends through a sliding window"
    if getattr(config, "attn_temperature_tuning", False):
        return "its attention scales queries by the cached length, which the compiled step does not pass"
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "its weights are spread over devices or offloaded"
    if getattr(model, "_hf_specdec_tp", None) or getattr(config, "base_model_tp_plan", None) and getattr(
            model, "_tp_size", None):
        return "it runs tensor-parallel"
    return None


def say_once(model, message: str) -> None:
    """Logs `message` at WARNING once per model."""
    said = model.__dict__.setdefault("_hf_specdec_graph_notes", set())
    if message not in said:
        said.add(message)
        logger.warning(message)


class GraphedSteps:
    """A `ModelRunner`'s compiled narrow steps (see the module's docstring). The compiled function is kept on the
    model, per settings, so later calls reuse its graphs."""

    def __init__(self, model, cache_kwarg: str, settings: GraphSettings):
        self.model = model
        self.settings = settings
        compiled = model.__dict__.setdefault("_hf_specdec_graphed", {})
        # dynamo keeps one cache per code object, shared by every model compiled here (a target and its draft, a
        # server's models): 8 entries (its default) are spent by one model's few shapes (one row or more, one
        # token or more, hidden states or not). Raised, never lowered.
        dynamo = torch._dynamo.config
        for name, least in (("recompile_limit", RECOMPILE_LIMIT), ("accumulated_recompile_limit", 4 * RECOMPILE_LIMIT)):
            if isinstance(getattr(dynamo, name, None), int):  # (older torch names them otherwise: left alone)
                setattr(dynamo, name, max(getattr(dynamo, name), least))
        def step(*args, _model=model, _kwarg=cache_kwarg):
            return graphed_forward(_model, _kwarg, *args)

        # A code object of its own: dynamo keeps compiled variants, and counts them against its limits, per code
        # object, so other models' steps (or a freed model's, whose objects a new one may reuse the addresses of)
        # neither use up this model's variants nor stand in for them. Sharing one, a process's later models met
        # dynamo's limit and ran eagerly with only dynamo's log line saying so.
        step.__code__ = step.__code__.replace()

        if settings.key not in compiled:
            compiled[settings.key] = {"fn": None, "trusted": set(), "steps": 0, "trials": {}}
        self._entry = compiled[settings.key]
        if settings.frozen:  # the graph holds the weights it was compiled with: changed since, it is not used
            weights = weight_identity(model)
            if self._entry.setdefault("weights", weights) != weights and "failed" not in self._entry:
                self._give_up("its weights changed since its compiled steps froze them (inductor's freezing); "
                              "a fresh model object compiles anew")
        self.trial = False  # whether the latest step was one of its shape's first (compiled, checked)
        self._marked = None  # the pools last marked as static addresses (CUDA graphs)
        if self._entry["fn"] is None and "failed" not in self._entry:
            if settings.frozen:
                size = weight_bytes(model) / 2 ** 30
                logger.info(f"hf_specdec compiles {type(model).__name__}'s steps with their weights frozen into the "
                            f"graph: minutes of compiling at this process's first steps of each shape, and a packed "
                            f"copy of the weights ({size:.2f} GiB); disable_compile=True or HF_SPECDEC_COMPILE=0 "
                            "keeps them eager")
            try:  # options torch.compile refuses, or a Python it cannot compile on: eager, said once
                self._entry["fn"] = torch.compile(step, **settings.options)
            except Exception as error:  # noqa: BLE001
                self._give_up(error)

    def _give_up(self, error: Exception | str) -> None:
        """Runs this model's steps eagerly from now on, saying why once."""
        if isinstance(error, Exception):
            first = str(error).splitlines()[0] if str(error) else ""
            self._entry["failed"] = f"{type(error).__name__}: {first}"
            say_once(self.model, f"hf_specdec could not compile {type(self.model).__name__}'s steps and runs them "
                                 f"eagerly ({self._entry['failed']})")
        else:
            self._entry["failed"] = error
            say_once(self.model, f"hf_specdec runs {type(self.model).__name__}'s steps eagerly: {error}")

    def _tracing_config(self):
        """What the call is traced under: inductor's `freezing` decides already while dynamo traces (whether the
        weights enter the graph as constants), before `torch.compile`'s `options` apply, so a frozen step's call
        sets it too."""
        if not self.settings.frozen:
            return contextlib.nullcontext()
        from torch._inductor import config as inductor_config
        return inductor_config.patch(freezing=True)

    @property
    def active(self) -> bool:
        return self._entry.get("failed") is None and self._entry["fn"] is not None

    def eligible(self, num_tokens: list[int], tree, model_kwargs: dict, width: int) -> bool:
        """Whether a step feeding `num_tokens` per row (`width` columns) runs compiled: no tree, every row feeding
        at most `MAX_WIDTH`, and the model's other tensor arguments per token (`[rows, width, ...]`)."""
        rows = len(num_tokens)
        return (self.active and tree is None and 0 < min(num_tokens) and width <= MAX_WIDTH
                and all(not isinstance(v, torch.Tensor) or v.shape[:2] == (rows, width)
                        for v in model_kwargs.values()))

    def run(self, cache, plan, input_ids: torch.Tensor, num_context: int, hidden: bool, eager,
            model_kwargs: dict | None = None) -> CausalLMOutputWithPast | torch.Tensor | None:
        """Runs the step `plan` describes (built unpacked, no tree) compiled. Returns its output with logits at
        every fed position `[rows, q, vocab]` (right-aligned, as the padded eager step's; a draft head's tensor as
        it returns it), or None where it cannot (the caller then runs it eagerly: the same keys and values land in
        the same slots, so nothing is lost). `num_context`: the longest row's context after the step (known on the
        host). `eager()` runs the same step eagerly, for the first step's trial."""
        self.trial = False
        layers = sorted(cache.key_pools)
        if layers != list(range(len(layers))):
            return None  # layers without pools of their own (shared KV): not graphed
        pools = ([cache.key_pools[i] for i in layers], [cache.value_pools[i] for i in layers])
        extra = dict(model_kwargs or {})
        rows, q = input_ids.shape
        device = input_ids.device
        positions, writes = plan.query_positions, plan.write_slots.reshape(rows, q)
        kernel = plan.backend == "triton"  # the kernel reads the pools in place: no context in the shapes
        bucket = self.settings.bucket  # few shapes, so few CUDA graphs: rows to a power of two, the rest to buckets
        padded_rows = 1 << (rows - 1).bit_length() if bucket else rows
        if kernel:  # block tables, as wide as a bucket when bucketing (entries past a row's context go unread)
            slots = plan.block_tables
            if bucket:
                width = 1 << (slots.shape[1] - 1).bit_length()
                slots = torch.cat([slots, slots.new_zeros(rows, width - slots.shape[1])], dim=1)
        elif bucket or plan.context_slots is None:
            if bucket:
                num_context = -(-num_context // CONTEXT_BUCKET) * CONTEXT_BUCKET
            slots = context_slots(plan.block_tables, plan.context_lens, num_context, plan.block_size,
                                  pad_slot=SCRATCH_SLOT)
        else:  # the plan gathered them already (an unpacked plan: one row of slots per row)
            slots = plan.context_slots
        if padded_rows > rows:  # extra rows read and write only the scratch slot, at position 0
            more = padded_rows - rows
            input_ids = torch.cat([input_ids, input_ids.new_zeros(more, q)])
            positions = torch.cat([positions, positions.new_zeros(more, q)])
            writes = torch.cat([writes, writes.new_full((more, q), SCRATCH_SLOT)])
            slots = torch.cat([slots, slots.new_full((more, slots.shape[1]), 0 if kernel else SCRATCH_SLOT)])
            extra = {name: torch.cat([v, v.new_zeros(more, *v.shape[1:])]) if isinstance(v, torch.Tensor) else v
                     for name, v in extra.items()}
        if bucket and self._marked is not pools[0][0]:  # pools are replaced together when the cache grows
            for pool in (*pools[0], *pools[1]):
                torch._dynamo.mark_static_address(pool)
            self._marked = pools[0][0]
        args = (hidden, extra, plan.block_size if kernel else None, input_ids, positions,
                writes.reshape(-1).to(device), slots, *pools)
        try:
            if bucket:  # a new step of CUDA graphs: earlier replays' outputs may be reused
                torch.compiler.cudagraph_mark_step_begin()
            with self._tracing_config():
                self._tune(args, rows, q, hidden, kernel)
                logits, states = self._entry["fn"](*args)
        except torch.OutOfMemoryError as error:  # this step eagerly; later steps try again (`OUT_OF_MEMORY_LIMIT`)
            self._entry["out_of_memory"] = self._entry.get("out_of_memory", 0) + 1
            if self._entry["out_of_memory"] >= OUT_OF_MEMORY_LIMIT:
                self._give_up(error)
            else:
                logger.info(f"hf_specdec ran a step of {type(self.model).__name__} eagerly: out of device memory for "
                            "its compiled step now (tried again next step)")
            return None
        except Exception as error:  # noqa: BLE001 - any other failure to compile means: run eagerly, say why once
            self._give_up(error)
            return None
        logits = logits[:rows]
        states = None if states is None else tuple(h[:rows] for h in states)
        if bucket:  # a CUDA graph's outputs live in its pool, overwritten by its next replay
            logits = logits.clone()
            states = None if states is None else tuple(h.clone() for h in states)
        shape = (padded_rows, q, hidden, kernel)
        trials = self._entry["trials"]
        # A shape's first calls compiled it (seconds to minutes) and ran its eager twin: not what a step costs.
        self.trial = trials.get(shape, 0) < (TRIALS_GRAPHED if bucket else TRIALS)
        if self.trial:
            trials[shape] = trials.get(shape, 0) + 1
            reference = eager()
            self._entry["returns_tensor"] = isinstance(reference, torch.Tensor)  # a draft head's own output
            wanted = reference if self._entry["returns_tensor"] else reference.logits
            agree = _agree(logits, wanted[:, -q:] if wanted.shape[1] >= q else wanted)
            if agree and states is not None and getattr(reference, "hidden_states", None) is not None:
                agree = _agree(states[-1], reference.hidden_states[-1])  # what a head reads: the last layer's
            if not agree:
                self._give_up("its compiled step's logits differ from the eager step's")
                return reference
            self._entry["trusted"].add(shape)
        self._entry["steps"] += 1
        if self._entry["returns_tensor"]:
            return logits
        return CausalLMOutputWithPast(logits=logits, hidden_states=states)

    def _tune(self, args: tuple, rows: int, q: int, hidden: bool, kernel: bool) -> None:
        """Before a frozen step's graph for several tokens a row is compiled by a step wider than `TUNE_WIDTH`, compiles
        it with a step of that width: the same rows' first tokens, their keys and values written to the scratch slot
        only, the output dropped. Dynamo keeps one such graph per one row or more, hidden states or not, and kernel."""
        if not self.settings.frozen or q < 2:
            return
        tuned = self._entry.setdefault("tuned", set())
        family = (rows == 1, hidden, kernel)
        if family in tuned:
            return
        tuned.add(family)
        if q <= TUNE_WIDTH:
            return
        _, extra, block_size, input_ids, positions, writes, slots, *pools = args
        width = TUNE_WIDTH
        # Copies, not views: dynamo guards a view on its base, which the steps' own inputs do not have (another
        # compile, tuned at the step's own width, would follow).
        narrow = {name: v[:, :width].clone() if isinstance(v, torch.Tensor) else v for name, v in extra.items()}
        scratch = writes.new_full((input_ids.shape[0] * width,), SCRATCH_SLOT)
        self._entry["fn"](hidden, narrow, block_size, input_ids[:, :width].clone(), positions[:, :width].clone(),
                          scratch, slots, *pools)


def weight_bytes(model) -> int:
    """The bytes `model`'s parameters take: what a frozen graph's packed copy of them takes again."""
    return sum(t.numel() * t.element_size() for t in model.parameters())


def weight_identity(model) -> tuple:
    """What tells `model`'s weights apart, cheaply: each parameter's and buffer's storage and version (an in-place
    change bumps the version; one through `.data` does not, like every cache of weights keyed so)."""
    return tuple((t.data_ptr(), t._version) for t in (*model.parameters(), *model.buffers()))


def _agree(compiled: torch.Tensor, eager: torch.Tensor) -> bool:
    if compiled.shape != eager.shape:
        return False
    tolerance = TRIAL_TOLERANCE.get(eager.dtype, TRIAL_TOLERANCE_LOW)
    wide = torch.promote_types(eager.dtype, torch.float32)
    scale = float(eager.abs().max().clamp(min=1.0))
    return bool((compiled.to(wide) - eager.to(wide)).abs().max() <= tolerance * scale)
