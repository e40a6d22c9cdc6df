"""Tensor parallelism (transformers' `tp_plan` under `torchrun`): every rank runs the same decode loop, and the
step's decisions are rank 0's.

Each rank holds a shard of the target and feeds it the same tokens; the shards meet in the model's own collectives.
A step's decisions must therefore be identical on every rank, or the ranks feed different tokens (or different
numbers of them) into the same collective and hang or compute garbage. Identical seeds are not enough: a rank whose
logits differ in the last bit (another reduction order), or whose random state was advanced by anything else, would
drift. So rank 0 decides and the others take its decisions: after drafting, the drafts (token ids, counts, draft
probabilities) are broadcast from rank 0, and after verifying, the accepted and recovered or bonus tokens are.
Everything else a step decides (adaptive k, stopping, what to roll back) follows from those and the batch, which then
agree on every rank. Two small broadcasts per step; with one process nothing happens.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import torch

_MAX_DIMS = 4
_DTYPES = (torch.int64, torch.bool, torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32)


def tp_group(model):
    """The process group of a tensor-parallel model (loaded with `tp_plan` / `distributed_config`), or `None`."""
    if not (getattr(model, "_tp_size", None) or 1) > 1:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    manager = getattr(model, "_mesh_manager", None)
    try:
        return manager.get_mesh("tp").get_group() if manager is not None else dist.group.WORLD
    except (AttributeError, KeyError, RuntimeError, ValueError):
        return dist.group.WORLD


class RankZeroDecides:
    """Makes a value rank 0's on every rank of `group` (`None`: a single process, values pass unchanged).

    Args:
        group: the tensor-parallel process group.
        device: where the model's inputs live on this rank (NCCL sends CUDA tensors; gloo sends host tensors).
    """

    def __init__(self, group=None, device: torch.device | None = None):
        self.group = group
        if group is not None:
            import torch.distributed as dist

            self._dist = dist
            self._source = dist.get_global_rank(group, 0)
            self._device = torch.device("cpu") if dist.get_backend(group) == "gloo" else device

    def __call__(self, value):
        """`value`: a tensor, a dataclass of tensors (`DraftProposal`, `VerifyResult`, `DraftTree`), or a tuple of
        those. Returns rank 0's, on this rank's devices."""
        if self.group is None:
            return value
        slots = list(_tensor_slots(value))
        header = torch.full((len(slots), 2 + _MAX_DIMS), -1, dtype=torch.long)
        for i, tensor in enumerate(slots):
            if tensor is not None:
                if tensor.dim() > _MAX_DIMS:
                    raise ValueError(f"cannot broadcast a {tensor.dim()}-dimensional tensor")
                header[i, 0], header[i, 1] = _DTYPES.index(tensor.dtype), tensor.dim()
                header[i, 2: 2 + tensor.dim()] = torch.tensor(tensor.shape)
        header = self._broadcast(header)
        received = []
        for i, tensor in enumerate(slots):
            code, ndim = int(header[i, 0]), int(header[i, 1])
            if code < 0:
                received.append(None)
                continue
            shape = header[i, 2: 2 + ndim].tolist()
            home = tensor.device if tensor is not None else self._device
            buffer = tensor if tensor is not None and list(tensor.shape) == shape else None
            buffer = buffer if buffer is not None and buffer.dtype == _DTYPES[code] else torch.empty(
                shape, dtype=_DTYPES[code], device=home)
            received.append(self._broadcast(buffer.contiguous()).to(home))
        return _rebuild(value, iter(received))

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        moved = tensor.to(self._device)
        self._dist.broadcast(moved, src=self._source, group=self.group)
        return moved


def _tensor_slots(value):
    if isinstance(value, tuple):
        for item in value:
            yield from _tensor_slots(item)
    elif is_dataclass(value):
        for f in fields(value):
            item = getattr(value, f.name)
            if item is None or isinstance(item, torch.Tensor):
                yield item
    else:
        yield value


def _rebuild(value, received):
    if isinstance(value, tuple):
        return tuple(_rebuild(item, received) for item in value)
    if is_dataclass(value):
        changes = {f.name: next(received) for f in fields(value)
                   if getattr(value, f.name) is None or isinstance(getattr(value, f.name), torch.Tensor)}
        return replace(value, **changes)
    return next(received)
