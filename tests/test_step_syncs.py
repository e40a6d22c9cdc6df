"""Host syncs per step: a decode step reads one small transfer back from the device (its commit's counts), and a step
with nothing to verify reads nothing else. On a CPU nothing waits, so the reads are counted: `Tensor.tolist` and the
scalar reads (`item`, `int`, `bool` of a tensor), for two calls whose lengths differ by a known number of steps, so
that what the call does once (prefill, setup) cancels out."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Reads(TorchDispatchMode):
    """Counts the tensor-to-host reads in the block: `tolist` calls and scalar reads (`_local_scalar_dense`)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        inner = torch.Tensor.tolist

        def counted(tensor, *args, **kwargs):
            self.count += 1
            return inner(tensor, *args, **kwargs)

        self._inner, torch.Tensor.tolist = inner, counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._inner
        return super().__exit__(*exc)


def _reads(model, speculator, max_new_tokens):
    ids = torch.randint(2, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), _Reads() as reads:
        out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             speculator=speculator, return_dict_in_generate=True)
    return reads.count, out.speculative_metrics.num_steps


@pytest.mark.parametrize("speculator, per_step", [("off", 1), ("ngram", 2)])
def test_reads_per_step(llama, speculator, per_step):
    """Speculation off: the commit's counts only. N-gram: the proposals' counts (adaptive k chooses on the host),
    then the commit's."""
    _reads(llama, speculator, 2)  # what a model's first call checks once (its support) is not a step's
    short, short_steps = _reads(llama, speculator, 6)
    long, long_steps = _reads(llama, speculator, 20)
    assert long_steps > short_steps
    assert long - short == per_step * (long_steps - short_steps)
