"""Host syncs per step: a decode step reads one small transfer back from the device (its commit's counts), and a step
with nothing to verify reads nothing else. On a CPU nothing waits, so the reads are counted: `Tensor.tolist` and the
scalar reads (`item`, `int`, `bool` of a tensor), for two calls whose lengths differ by a known number of steps, so
that what the call does once (prefill, setup) cancels out."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_specdec.costs.step_cost import HOST_FORMS_CPU_STEP_COST


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


def _reads(model, speculator, max_new_tokens, **kwargs):
    ids = torch.randint(2, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), _Reads() as reads:
        out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                             speculator=speculator, return_dict_in_generate=True, **kwargs)
    return reads.count, out.speculative_metrics.num_steps


@pytest.mark.parametrize("speculator, kwargs, per_step", [
    ("off", {}, 1), ("ngram", dict(num_speculative_tokens=3, speculative_schedule="constant"), 2)])
def test_reads_per_step(llama, speculator, kwargs, per_step):
    """Speculation off: the commit's counts only. N-gram drafting every step: the proposals' counts (adaptive k
    chooses on the host), then the commit's."""
    _reads(llama, speculator, 2, **kwargs)  # what a model's first call checks once (its support) is not a step's
    short, short_steps = _reads(llama, speculator, 6, **kwargs)
    long, long_steps = _reads(llama, speculator, 20, **kwargs)
    assert long_steps > short_steps
    assert long - short == per_step * (long_steps - short_steps)


def test_an_idle_lookup_is_skipped(llama, monkeypatch):
    """Adaptive k after rejected drafts: a step that verified nothing looks up proposals only where the likeliest
    ones could pay, so some steps decline without a lookup; a step reads the proposals' counts back only after a
    lookup, and the output is the target's own."""
    from hf_specdec.speculators.ngram import NgramSpeculator

    lookups = []  # proposals asked for (k > 0): each a lookup
    real = NgramSpeculator.propose

    def counted(self, batch, k):
        if k:
            lookups.append(k)
        return real(self, batch, k)

    monkeypatch.setattr(NgramSpeculator, "propose", counted)
    phrase = torch.randint(2, llama.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    ids = phrase.repeat(1, 6)  # every row offers drafts; the random model does not follow the phrase at first

    def call(new_tokens):
        lookups.clear()
        with torch.no_grad(), _Reads() as reads:
            out = llama.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 speculator="ngram", return_dict_in_generate=True, speculative_step_cost=cheap)
        plain = llama.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        assert torch.equal(out.sequences, plain)
        return reads.count, out.speculative_metrics.num_steps, len(lookups), out.speculative_metrics.k_per_step

    # A measured CPU's verifies (a second token nearly free at one row), where the likeliest class pays and others do
    # not; the static curve, timed with the stock linear forms, prices nearly every lookup at a loss.
    cheap = HOST_FORMS_CPU_STEP_COST

    call(2)  # what a model's first call checks once (its support) is not a step's
    short_reads, short_steps, short_lookups, _ = call(8)
    reads, steps, lookups_made, k_per_step = call(40)
    assert k_per_step.count(0) >= 4 and lookups_made < steps  # some idle steps looked nothing up
    # What the longer call did more: a read per step (its commit) and one per lookup (the proposals' counts).
    assert reads - short_reads == (steps - short_steps) + (lookups_made - short_lookups)
