"""Every causal LM architecture transformers knows: lossless, refused up front, or not buildable (tests/model_sweep.py).

The sweep runs in two worker processes (about a minute on 2 cores). Its table is in docs/reliability.md and the README
quotes its count; the last test keeps both in step with what the installed transformers gives.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import transformers

import model_sweep
from model_sweep import FAILURES, LOSSLESS, OTHER_REFERENCE, REFERENCE_DIFFERS, REFUSED, UNBUILDABLE

pytestmark = pytest.mark.slow  # every architecture transformers can build

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def results():
    return model_sweep.sweep(jobs=2)


def test_every_architecture_is_lossless_refused_up_front_or_not_buildable(results):
    assert len(results) == len(model_sweep.architectures())
    failures = {name: result for name, result in results.items() if result[0] in FAILURES}
    assert not failures, "crashes or mismatches:\n" + model_sweep.markdown(failures)
    for name, (outcome, detail) in results.items():
        if outcome == REFUSED:  # the reason is spelled out, for the target and the draft alike
            assert detail.startswith("the target model") and len(detail) > 60, (name, detail)


def test_plain_generate_is_replaced_as_the_reference_only_where_documented(results):
    """Where transformers' own generate is wrong on the batch, ours must equal its uncached output or each row alone;
    `REFERENCE_DIFFERS` must list exactly those architectures, with the reason."""
    found = {name for name, (outcome, _) in results.items() if outcome == OTHER_REFERENCE}
    assert found == set(REFERENCE_DIFFERS)


def test_the_sweep_sees_mismatches_and_crashes(monkeypatch):
    """The classification can fail: a speculator that changes the output is a mismatch, an exception a crash."""
    from transformers import GenerationMixin

    original = GenerationMixin.generate

    def wrong(self, *args, speculator=None, **kwargs):
        out = original(self, *args, speculator=speculator, **kwargs)
        if speculator is not None:
            out = out.clone()
            out[0, -1] = (out[0, -1] + 1) % model_sweep.VOCAB
        return out

    monkeypatch.setattr(GenerationMixin, "generate", wrong)
    assert model_sweep.check("llama")[0] == model_sweep.MISMATCH

    def crash(self, *args, speculator=None, **kwargs):
        if speculator is not None:
            raise IndexError("index out of range in self")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", crash)
    assert model_sweep.check("llama")[0] == model_sweep.CRASH


def _documented_outcomes() -> tuple[str, dict[str, str]]:
    text = (ROOT / "docs" / "reliability.md").read_text()
    section = text[text.index("## Every causal LM architecture"):]
    version = re.search(r"transformers (\d+\.\d+\.\d+)", section).group(1)
    rows = re.findall(r"^\| ([\w.-]+) \| ([a-z ()]+) \|", section, flags=re.M)
    return version, {name: outcome.strip() for name, outcome in rows if name != "architecture"}


def test_docs_table_and_readme_follow_the_sweep(results):
    version, documented = _documented_outcomes()
    if version != transformers.__version__:
        pytest.skip(f"docs/reliability.md was measured with transformers {version}, {transformers.__version__} "
                    "is installed")
    assert documented == {name: outcome for name, (outcome, _) in results.items()}
    num_lossless = sum(outcome in (LOSSLESS, OTHER_REFERENCE) for outcome, _ in results.values())
    num_unbuildable = sum(outcome == UNBUILDABLE for outcome, _ in results.values())
    readme = (ROOT / "README.md").read_text()
    claim = f"{num_lossless} of the {len(results) - num_unbuildable}"
    assert claim in readme, f"the README's model-support claim should say {claim!r}"
