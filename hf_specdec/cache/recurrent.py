"""Per-row, rollback-able conv and recurrent state for hybrid and recurrent models (Mamba, Mamba2, Qwen3-Next,
Falcon-H1, ...), on top of the paged KV cache.

transformers' recurrent layers ("mixers") read and write their state through the cache object they are given:
`get_conv_state` / `update_conv_state` (the last inputs of a causal convolution), `get_recurrent_state` /
`update_recurrent_state` (an SSM or linear-attention state), or `get_linear_cache` / `set_linear_cache`
(MiniMax). `RecurrentPagedCache` answers those calls per row, so the model's own code, torch path included, runs
unchanged.

**How a row rolls back.** A verify step feeds `[last committed token, d1 .. dk]`; a row that accepts `a` drafts must
continue from its state after `a + 1` of those tokens. We keep the state after *each* of the step's last
`num_logits` positions (the positions a row can roll back to) and pick the accepted one. States live in a small ring
per row, indexed by position (`history[row, length % H]`), so the state of a row of length `L` is simply
`history[row, L % H]`: rolling back moves the row's length pointer, exactly like the paged KV cache, and copies
nothing.

To get a state after each position, a mixer runs those positions one token at a time (its own single-token decode
path); the positions before them (a prompt) run as one call through its chunked path, with a padding mask, as
transformers' own generate does. This is the approach serving engines take for Mamba hybrids (keep every verified
position's state, select the accepted one). The other known approach, restoring a snapshot and re-feeding a row's
accepted tokens in its next step, was rejected: re-fed rows are ragged, a ragged row puts padding between its state
and its tokens, and a recurrent layer cannot skip padding (its decay applies at every position), so re-feeding would
need an extra forward per step with any rejection. The price of ours: in a verify step the recurrent layers cost
about `k + 1` single-token calls instead of one `k + 1`-token call (attention, MLPs and the LM head still run the
whole step at once), and each row keeps up to `H` states per layer.

Mixers are found from their source: the modules whose `forward` calls one of those cache methods. Within
`paged_attention` (runners/model_runner.py) their `forward` is wrapped to split a step as above; with any other cache
the wrapper passes straight through. A recurrent layer that reaches the cache some other way is caught by the runner's
trial forward (runners/support.py), which then refuses the model up front.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..errors import UnsupportedModelError
from .paged import PagedKVCache

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the compiled paged-attention kernel takes

# Cache methods through which transformers' recurrent layers reach their state.
_STATE_METHODS = ("get_conv_state", "get_recurrent_state", "update_conv_state", "update_recurrent_state",
                  "get_linear_cache", "set_linear_cache")
_MIXERS_ATTR = "_hf_specdec_recurrent_mixers"
_WRAPPED_ATTR = "_hf_specdec_wrapped_forward"


def recurrent_mixers(model) -> list[torch.nn.Module]:
    """The modules of `model` whose forward reads or writes recurrent state through the cache (remembered)."""
    names = getattr(model, _MIXERS_ATTR, None)
    if names is None:
        names = [name for name, module in model.named_modules() if _reaches_state(type(module).forward)]
        setattr(model, _MIXERS_ATTR, names)
    return [model.get_submodule(name) for name in names]


def _reaches_state(function, depth: int = 3) -> bool:
    """Whether `function`'s source calls one of the state methods, itself or through what it calls, `depth` calls
    deep: the functions and modules its globals name and the functions its closure holds (transformers 5.25 moved
    Mamba2's conv and scan into module functions, `causal_conv1d_forward` and `mamba2_scan_forward`, which its hub
    kernel decorator turns into modules calling the function from a closure)."""
    function = inspect.unwrap(function)
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    if any(f".{method}(" in source for method in _STATE_METHODS):
        return True
    if depth == 0:
        return False
    try:
        referenced = inspect.getclosurevars(function)
    except (TypeError, ValueError):  # not a Python function, or a closure variable not yet assigned
        return False
    callees = [*referenced.globals.values(), *referenced.nonlocals.values()]
    callees = [type(c).forward if isinstance(c, torch.nn.Module) else c for c in callees]
    return any(inspect.isfunction(c) and _reaches_state(c, depth - 1) for c in callees)


def is_recurrent(model) -> bool:
    return bool(recurrent_mixers(model))


def make_cache(model, **kwargs) -> PagedKVCache:
    """The cache a `ModelRunner` gives `model`: a `RecurrentPagedCache` when it has recurrent layers. Latent attention
    (DeepSeek's: value heads narrower than the keys') attends on the PyTorch path: the Triton kernel takes one head
    size for both; so does a CUDA model in a dtype the compiled kernel does not take (float64)."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    value_dim, key_dim = getattr(config, "v_head_dim", None), getattr(config, "qk_head_dim", None)
    dtype, device = getattr(model, "dtype", None), getattr(model, "device", None)
    if (value_dim is not None and key_dim is not None and value_dim != key_dim) or (
            dtype not in KERNEL_DTYPES and getattr(device, "type", None) == "cuda"):
        kwargs["kernel_backend"] = "torch"
    return RecurrentPagedCache(**kwargs) if is_recurrent(model) else PagedKVCache(**kwargs)


@contextmanager
def recurrent_layers_split(model):
    """Wraps the forward of `model`'s recurrent mixers for the duration (see the module docstring)."""
    wrapped = []
    try:
        for module in recurrent_mixers(model):
            if getattr(module, _WRAPPED_ATTR, False):
                continue  # already wrapped by an enclosing context (one model as target and draft)
            own = module.__dict__.get("forward")  # accelerate's hooks replace forward on the instance
            module.forward = _split_forward(module, module.forward)
            setattr(module, _WRAPPED_ATTR, True)
            wrapped.append((module, own))
        yield
    finally:
        for module, own in wrapped:
            del module.forward
            if own is not None:
                module.forward = own
            delattr(module, _WRAPPED_ATTR)


def _split_forward(module, forward):
    parameters = list(inspect.signature(inspect.unwrap(type(module).forward)).parameters)[1:]  # without self
    takes_mask = "attention_mask" in parameters
    mask_index = parameters.index("attention_mask") if takes_mask else None

    def split(*args, **kwargs):
        cache = next((v for v in (*args, *kwargs.values()) if isinstance(v, RecurrentPagedCache)), None)
        if cache is None or cache._call is not None:  # another cache, or inside a mixer that already split the step
            return forward(*args, **kwargs)
        hidden_states = args[0] if args else kwargs["hidden_states"]
        rows, q = hidden_states.shape[:2]
        outputs = []
        for call in cache.step_calls(takes_mask):
            cols = slice(call.col_start, call.col_end)
            call_args = [_columns(a, rows, q, cols) for a in args]
            call_kwargs = {k: _columns(v, rows, q, cols) for k, v in kwargs.items()}
            if takes_mask and mask_index < len(call_args):
                call_args[mask_index] = call.mask
            elif takes_mask:
                call_kwargs["attention_mask"] = call.mask
            with cache.calling(call):
                outputs.append(forward(*call_args, **call_kwargs))
        if len(outputs) == 1:
            return outputs[0]
        if isinstance(outputs[0], tuple):  # (output, extras): extras of the last call
            return (torch.cat([o[0] for o in outputs], dim=1), *outputs[-1][1:])
        return torch.cat(outputs, dim=1)

    return split


def _columns(value, rows: int, q: int, cols: slice):
    """`value` restricted to the step's columns `cols` where it is per token (`[rows, q, ...]`)."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == rows and value.shape[1] == q:
        return value[:, cols]
    if isinstance(value, tuple):
        return tuple(_columns(v, rows, q, cols) for v in value)
    return value


@dataclass
class MixerCall:
    """One call of every mixer within a step: the step's columns `[col_start, col_end)`.

    Attributes:
        slots: `[rows]` each row's history row (its id).
        read_len: `[rows]` each row's length before the call (its state is the one after that many tokens).
        write_pos: `[rows]` the row's length after the call, where its new state goes.
        write_slot: `[rows]` the history row the new state goes to; the scratch row for rows with no token here.
        mask: `[rows, col_end - col_start]` 1 for real tokens, for the chunked call; `None` for single tokens.
        all_fresh: no row has state yet (the mixer then takes its own prefill path).
    """

    col_start: int
    col_end: int
    slots: torch.Tensor
    read_len: torch.Tensor
    write_pos: torch.Tensor
    write_slot: torch.Tensor
    mask: torch.Tensor | None
    all_fresh: bool
    working: dict = field(default_factory=dict)  # (layer, kind, state_idx) -> state handed to the mixer
    results: dict = field(default_factory=dict)  # (layer, kind, state_idx) -> state the mixer wrote


class RecurrentPagedCache(PagedKVCache):
    """A `PagedKVCache` that also keeps each row's conv and recurrent states, with O(1) per-row rollback.

    Rollback is a declared capability: `rollback(seq_id, length)` returns a row to its state after `length` tokens,
    for any `length` from the row's previous rollback (or 0; at most `reach` tokens before its last step) up to its
    current length, by moving its length pointer.
    Each layer's states live in a ring `[rows + 1, H, *state]` indexed by `length % H` (the extra row is scratch);
    `H` grows when a row writes more positions than it holds between two rollbacks.
    """

    def __init__(self, *args, history: int = 8, reach: int = 64, **kwargs):
        super().__init__(*args, **kwargs)
        self.history = history
        self.reach = reach
        self.num_logits: int | None = None  # set by the runner before each step: the positions to keep states of
        self.states: dict[tuple, torch.Tensor] = {}  # (layer, kind, state_idx) -> [num_slots + 1, H, *state]
        self.conv_widths: dict[tuple, int] = {}
        self.num_slots = 0
        self._floor: dict[int, int] = {}  # row -> oldest length it may roll back to
        self._step: dict | None = None
        self._call: MixerCall | None = None
        self.num_state_writes = 0

    # --- sequences -----------------------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        super().add_sequence(seq_id)
        self._floor[seq_id] = 0

    def rollback(self, seq_id: int, length: int) -> None:
        if length < self._floor.get(seq_id, 0):
            raise RuntimeError(f"row {seq_id}'s recurrent state after {length} tokens is no longer kept (rollback "
                               f"goes back to {self._floor[seq_id]} at most)")
        super().rollback(seq_id, length)
        self._floor[seq_id] = length

    def rollback_many(self, seq_ids: list[int], lengths: list[int]) -> None:
        for seq_id, length in zip(seq_ids, lengths):  # each row's recurrent floor checked and moved
            self.rollback(seq_id, length)

    def free(self, seq_id: int) -> None:
        super().free(seq_id)
        self._floor.pop(seq_id, None)

    # --- one step ------------------------------------------------------------------------------------------------
    def plan_step(self, seq_ids, starts, num_tokens, device, tree=None, packed=False):
        if tree is not None:
            raise ValueError("draft trees are not supported with recurrent (Mamba, linear-attention) layers: a "
                             "row's state follows one path; drop speculative_tree_nodes=")
        if packed:  # the runner never asks (see `ModelRunner.packed`): recurrent layers step through padded rows
            raise ValueError("recurrent layers take padded steps only")
        plan = super().plan_step(seq_ids, starts, num_tokens, device, tree)
        if max(seq_ids) >= self.num_slots:
            self._grow_slots(max(seq_ids) + 1)
        for seq_id, start in zip(seq_ids, starts):  # a row that never rolls back must not grow its ring forever
            self._floor[seq_id] = max(self._floor.get(seq_id, 0), start - self.reach)
        span = max(s + n - self._floor[r] for r, s, n in zip(seq_ids, starts, num_tokens))
        if span >= self.history:
            self._grow_history(seq_ids, starts, span + 1)
        self._step = dict(seq_ids=list(seq_ids), starts=list(starts), counts=list(num_tokens), device=device,
                          window=self.num_logits or max(num_tokens), calls={})
        return plan

    def step_calls(self, takes_mask: bool) -> list[MixerCall]:
        """How each mixer splits this step: one chunked call over the columns no row needs per-position states of
        (only rows without state have tokens there), then one call per column."""
        step = self._step
        starts, counts = step["starts"], step["counts"]
        q = max(counts)
        with_state = [n for s, n in zip(starts, counts) if s > 0]
        per_token = min(q, max([step["window"], *with_state]))
        if not takes_mask and any(n < q for n in counts):  # padding the mixer cannot mask: no chunked call
            per_token = q
        if per_token not in step["calls"]:
            step["calls"][per_token] = self._make_calls(starts, counts, q, per_token, step["device"])
        return step["calls"][per_token]

    def _make_calls(self, starts, counts, q, per_token, device) -> list[MixerCall]:
        slots = torch.tensor(self._step["seq_ids"], device=device)
        starts_t = torch.tensor(starts, device=device)
        first = q - torch.tensor(counts, device=device)  # [rows] column of each row's first token
        scratch = torch.full_like(slots, self.num_slots)
        calls = []
        chunk = q - per_token
        if chunk > 0:
            cols = torch.arange(chunk, device=device)
            mask = (cols[None, :] >= first[:, None]).long()
            num_real = mask.sum(-1)
            calls.append(MixerCall(0, chunk, slots, starts_t, starts_t + num_real,
                                   torch.where(num_real > 0, slots, scratch), mask, all(s == 0 for s in starts)))
        for col in range(chunk, q):
            before = (col - first).clamp(min=0)
            real = col >= first
            fresh = all(s == 0 and col <= q - n for s, n in zip(starts, counts))
            calls.append(MixerCall(col, col + 1, slots, starts_t + before, starts_t + before + real.long(),
                                   torch.where(real, slots, scratch), None, fresh))
        return calls

    @contextmanager
    def calling(self, call: MixerCall):
        """The mixer runs `call`; afterwards the states it produced are written to the history."""
        self._call = call
        call.working, call.results = {}, {}
        try:
            yield
        finally:
            self._call = None
        for key in {**call.working, **call.results}:
            state = call.results.get(key, call.working.get(key))  # the decode path updates in place
            if state is not None:
                self._write(key, state, call)

    def _write(self, key, state: torch.Tensor, call: MixerCall) -> None:
        if key not in self.states:
            self.states[key] = state.new_zeros((self.num_slots + 1, self.history, *state.shape[1:]))
        pool = self.states[key]
        pool[call.write_slot.to(pool.device), (call.write_pos % self.history).to(pool.device)] = state.to(pool.dtype)
        self.num_state_writes += 1

    def _read(self, key, call: MixerCall) -> torch.Tensor | None:
        if call.all_fresh or key not in self.states:
            return None
        pool = self.states[key]
        read_len = call.read_len.to(pool.device)
        state = pool[call.slots.to(pool.device), read_len % self.history]
        fresh = (read_len == 0).view(-1, *[1] * (state.dim() - 1))
        return torch.where(fresh, torch.zeros_like(state), state)  # a new row's slot may hold an old row's state

    def _current_call(self, method: str) -> MixerCall:
        if self._call is None:
            raise UnsupportedModelError(
                f"a layer called the cache's {method} outside the recurrent layers hf_specdec found, so its state "
                "cannot be kept per row"
            )
        return self._call

    def _grow_slots(self, num_slots: int) -> None:
        num_slots = max(num_slots, 2 * self.num_slots)
        for key, pool in self.states.items():
            grown = pool.new_zeros((num_slots + 1, *pool.shape[1:]))
            grown[: self.num_slots] = pool[: self.num_slots]
            self.states[key] = grown
        self.num_slots = num_slots

    def _grow_history(self, seq_ids, starts, history: int) -> None:
        # Only states from each row's floor to its current length are live: re-index them by the new ring size, for
        # every row the cache holds (the rows of this step at the length they start it from, and the others too:
        # a newcomer's long prompt grows the ring while the running rows wait for their next step).
        history = max(history, 2 * self.history)
        current = dict(zip(seq_ids, starts))
        rows, lengths = [], []
        for seq_id, floor in self._floor.items():
            if seq_id >= self.num_slots:  # added but never stepped: no state yet (its slot comes when it steps)
                continue
            for length in range(floor, current.get(seq_id, self.length(seq_id)) + 1):
                rows.append(seq_id)
                lengths.append(length)
        for key, pool in self.states.items():
            grown = pool.new_zeros((pool.shape[0], history, *pool.shape[2:]))
            if rows:
                r, n = torch.tensor(rows, device=pool.device), torch.tensor(lengths, device=pool.device)
                grown[r, n % history] = pool[r, n % self.history]
            self.states[key] = grown
        self.history = history

    # --- transformers' recurrent-state interface -----------------------------------------------------------------
    def _get(self, layer_idx: int, kind: str, state_idx: int, method: str) -> torch.Tensor | None:
        call = self._current_call(method)
        key = (layer_idx, kind, state_idx)
        if key not in call.working:
            call.working[key] = self._read(key, call)
        return call.working[key]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._get(layer_idx, "conv", state_idx, "get_conv_state")

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._get(layer_idx, "recurrent", state_idx, "get_recurrent_state")

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        """Takes the call's new conv inputs `[rows, channels, n]`; returns what the causal convolution must see:
        the previous state then the new inputs (or, when no row has state, the new inputs alone)."""
        call = self._current_call("update_conv_state")
        key = (layer_idx, "conv", state_idx)
        previous = self._get(layer_idx, "conv", state_idx, "update_conv_state")
        width = self.conv_widths.setdefault(key, conv_kernel_size or conv_states.shape[-1])
        full = conv_states if previous is None else torch.cat([previous.to(conv_states.dtype), conv_states], dim=-1)
        state = full[..., -width:]
        if state.shape[-1] < width:
            state = torch.nn.functional.pad(state, (width - state.shape[-1], 0))
        call.results[key] = state
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self._current_call("update_recurrent_state").results[(layer_idx, "recurrent", state_idx)] = recurrent_states
        return recurrent_states

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        return self._get(layer_idx, "recurrent", 0, "get_linear_cache")

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self.update_recurrent_state(linear_cache, layer_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self._call is not None and not self._call.all_fresh

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        # The step is split into single-token calls where states must be kept (`step_calls`): a chunked call keeps
        # only its last state.
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        pass  # lengths are the block manager's

    def is_recording_past(self, layer_idx: int | None = None) -> bool:
        # Every conv update goes through `update_conv_state` (never the in-place single-token kernel), so the
        # state written for each position is the one this cache computed.
        return True

    def memory_bytes(self) -> int:
        return super().memory_bytes() + sum(p.numel() * p.element_size() for p in self.states.values())
