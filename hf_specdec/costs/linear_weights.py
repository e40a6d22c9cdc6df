"""Which linear layers the CPU forms apply to, and their weights packed once for oneDNN: a layer's alone, or sibling
layers' stacked (q/k/v, gate/up) to run as one product. The copies are kept between calls and dropped when the weights
change (linear_forms.py measures where each form pays and switches them in)."""

from __future__ import annotations

import logging
import weakref

import torch

logger = logging.getLogger("hf_specdec")


def thin_linear_candidate(module: torch.nn.Module) -> bool:
    """Whether a module is a plain full-precision `torch.nn.Linear` whose product runs on the CPU: its weight is
    there, or accelerate's hook brings it there (an offloaded layer's weight sits on `meta` until the hook streams it
    in for the forward). Quantized and wrapped layers are not."""
    if not (type(module) is torch.nn.Linear and type(module.weight) is torch.nn.Parameter
            and module.weight.is_floating_point()):
        return False
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    return torch.device(device if device is not None else module.weight.device).type == "cpu"


def packed_linear_supported(weight: torch.Tensor) -> bool:
    """Whether oneDNN can multiply by `weight` in a packed layout here: a float32 CPU weight, torch built with
    oneDNN."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered once into oneDNN's blocked layout (a copy, opaque: only `packed_linear` reads it)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, W, bias)` with `W` packed by `pack_linear_weight`: the product runs without repacking the
    weight, which is what the stock call spends most of its time on at a few rows."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# Packed weights kept between calls (packing SmolLM2-135M's layers takes about 1.5 s here, longer than many calls):
# layer -> (what identifies its weight's contents, the packed copy). An in-place change of the weight bumps its
# version and the layer is packed again.
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weight_identity(weight: torch.Tensor) -> tuple:
    """What tells a weight's contents apart, cheaply: its data, version, shape, dtype and device. A change made
    through `weight.data` bumps no version: after one, `clear_packed_weights` (or a new weight tensor)."""
    return weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, weight.device


def clear_packed_weights(model: torch.nn.Module | None = None) -> None:
    """Drops the packed copies kept for `model`'s layers (every model's with None): their memory is freed and the
    next call packs again from the weights as they are then."""
    if model is None:
        _PACKED.clear()
        _FUSED.clear()
        return
    for m in model.modules():
        _PACKED.pop(m, None)
        _FUSED.pop(m, None)


def _prune_packed(modules) -> None:
    """Drops kept copies that no longer stand for their layer's weight (replaced, changed in place, cast, moved), so
    they do not hold memory."""
    for root in modules:
        for m in root.modules():
            entry = _PACKED.get(m)
            if entry is not None and (not isinstance(getattr(m, "weight", None), torch.Tensor)
                                      or entry[0] != _weight_identity(m.weight)):
                del _PACKED[m]
    if _FUSED:
        for g in linear_groups(modules):
            entry = _FUSED.get(g[0])
            if entry is not None and entry[0] != _group_identity(g):
                del _FUSED[g[0]]


def _room_for(need: int, what: str) -> bool:
    """Whether copies of `need` bytes take at most half the memory available now; if not, a warning says `what`
    (e.g. "linear layers keep their unpacked forms: packing their weights") needs more."""
    if not need:
        return True
    import psutil

    available = psutil.virtual_memory().available
    if need > available / 2:
        logger.warning(f"{what} needs {need / 2**30:.1f} GiB, more than half the {available / 2**30:.1f} GiB "
                       "available now")
        return False
    return True


def _packed_weights(layers: list[torch.nn.Linear]) -> dict[int, torch.Tensor]:
    """The packed copy of each layer's weight (`id(layer)` -> copy), packing those not kept yet (layers sharing one
    weight share one copy), unless the copies would take more than half the memory available now (then none: a
    warning says so and the layers keep the other forms)."""
    missing = [m for m in layers if m not in _PACKED or _PACKED[m][0] != _weight_identity(m.weight)]
    kept = {entry[0]: entry[1] for entry in _PACKED.values()}
    distinct = {_weight_identity(m.weight): m.weight for m in missing if _weight_identity(m.weight) not in kept}
    if not _room_for(sum(w.numel() * w.element_size() for w in distinct.values()),
                     "linear layers keep their unpacked forms: packing their weights"):
        return {}
    for m in missing:
        identity = _weight_identity(m.weight)
        if identity not in kept:
            kept[identity] = pack_linear_weight(m.weight)
        _PACKED[m] = (identity, kept[identity])
    return {id(m): _PACKED[m][1] for m in layers}


# Sibling layers that read one input, computed as one product ------------------------------------------------------
# Children of one module with these names read the same input in a forward (attention's q/k/v, an MLP's gate/up);
# `_FusedGroup` still checks it on every call.
GROUP_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("query", "key", "value"), ("w1", "w3"))


def linear_groups(modules) -> list[tuple[torch.nn.Linear, ...]]:
    """Groups of sibling linear layers (`GROUP_NAMES`) that can run as one packed product: plain float32 CPU layers
    not under an accelerate hook, of one input width, all with a bias or none."""
    groups, seen = [], set()
    for root in modules:
        for parent in root.modules():
            if id(parent) in seen:
                continue
            seen.add(id(parent))
            children = dict(parent.named_children())
            for names in GROUP_NAMES:
                members = tuple(children.get(n) for n in names)
                if all(m is not None and thin_linear_candidate(m) and packed_linear_supported(m.weight)
                       and getattr(m, "_hf_hook", None) is None for m in members) \
                        and len({m.in_features for m in members}) == 1 and len({m.bias is None for m in members}) == 1:
                    groups.append(members)
    return groups


def shape_key(weight_shape) -> str:
    """A linear weight's shape as profiles name it: `"out x in"`."""
    return "x".join(str(int(n)) for n in weight_shape)


def group_key(members) -> str:
    """A group as profiles name it: its members' weight shapes in order, `"576x576+192x576+192x576"`."""
    return "+".join(shape_key(m.weight.shape) for m in members)


# A group's packed copy of its members' weights stacked, kept between calls as `_PACKED` is: first member ->
# (what identifies every member's weight and bias, the packed copy, the stacked bias or None).
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _group_identity(members) -> tuple:
    return tuple((_weight_identity(m.weight), None if m.bias is None else _weight_identity(m.bias)) for m in members)


def _fused_weights(groups) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """Each group's packed copy and stacked bias (`id(first member)` -> both), packing those not kept yet, unless the
    copies would take more than half the memory available now (then none, with a warning)."""
    missing = [g for g in groups if g[0] not in _FUSED or _FUSED[g[0]][0] != _group_identity(g)]
    if not _room_for(sum(m.weight.numel() * m.weight.element_size() for g in missing for m in g),
                     "sibling linear layers keep their own products: stacking their weights"):
        return {}
    with torch.no_grad():
        for g in missing:
            bias = None if g[0].bias is None else torch.cat([m.bias.detach() for m in g])
            _FUSED[g[0]] = (_group_identity(g), pack_linear_weight(torch.cat([m.weight.detach() for m in g])), bias)
    return {id(g[0]): _FUSED[g[0]][1:] for g in groups}


class _FusedGroup:
    """Sibling layers computed as one packed product: the first member called with an input computes every
    member's output and hands each other member its own when that one is called with the same input (the same
    tensor, unchanged since). A member called with another input, or an output never taken, shows the members do
    not share their input here: for the rest of the block each computes its own. Where the table says no, or the
    copy cannot stand for the weights now (changed in place, replaced, an input not float32, gradients wanted),
    each member computes its own as well."""

    def __init__(self, members, table: list[bool], packed: torch.Tensor, bias: torch.Tensor | None):
        self.members, self.table, self.packed, self.bias = members, table, packed, bias
        self.identity = _group_identity(members)
        self.widths = [m.out_features for m in members]
        self.pending = None  # (input, its version, {member index: output}) for members not called yet
        self.shared = True

    def forward(self, index: int, own):
        def forward(x):
            pending, self.pending = self.pending, None
            if pending is not None:
                if pending[0] is x and pending[1] == x._version and index in pending[2]:
                    y = pending[2].pop(index)
                    if pending[2]:
                        self.pending = pending
                    return y
                self.shared = False
            n = x.numel() // max(x.shape[-1], 1) if x.dim() else len(self.table)
            if (self.shared and n < len(self.table) and self.table[n] and x.dtype == torch.float32
                    and not (torch.is_grad_enabled() and (x.requires_grad or any(
                        m.weight.requires_grad for m in self.members)))
                    and _group_identity(self.members) == self.identity):
                y = packed_linear(x if x.is_contiguous() else x.contiguous(), self.packed, self.bias)
                parts = [part.contiguous() for part in y.split(self.widths, -1)]
                self.pending = (x, x._version, {j: part for j, part in enumerate(parts) if j != index})
                return parts[index]
            return own(x)
        return forward
