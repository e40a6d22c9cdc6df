"""Does computing linear layers as `(W @ x.T).T` (calibration.py's small-row form), or with their weights packed for
oneDNN (`--packed`), keep greedy output equal to plain `generate` in float32? SmolLM2-135M-Instruct, the bench's
prompts (and, with `--batch`, all of them in one ragged batch), n-gram and a constant k so every verify runs the
form at 2+ rows; the form is forced at every row count, whatever this host's profile says. No timing.

    python benchmarks/thin_linear_equality.py [MAX_NEW_TOKENS] [--packed] [--batch]
"""
import sys
from contextlib import contextmanager

import torch

import hf_specdec.decode.engine
from hf_specdec.costs import calibration
from hf_specdec.models import load_model
from hf_specdec.workloads import GROUNDED, OPEN_CHAT, chat_inputs

args = [a for a in sys.argv[1:] if not a.startswith("--")]
max_new_tokens = int(args[0]) if args else 64
packed = "--packed" in sys.argv
model, tok = load_model()


@contextmanager
def every_row_count(model, speculator=None, use_profile=True):
    if packed:
        shapes = {calibration.shape_key(m.weight.shape): range(1, 4097) for m in model.modules()
                  if isinstance(m, torch.nn.Linear)}
        with calibration.thin_linear([model], (), None, None, shapes):
            yield
        return
    with calibration.thin_linear([model], range(1, 4097)):
        yield


hf_specdec.decode.engine.host_linear = every_row_count
same = 0
prompts = {**GROUNDED, **OPEN_CHAT}
for name, prompt in prompts.items():
    inputs = chat_inputs(tok, [prompt])
    plain = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, speculator="ngram",
                         num_speculative_tokens=4, speculative_schedule="constant")
    equal = torch.equal(out, plain)
    same += equal
    fork = "" if equal else f", first difference at new token {int((out[0] != plain[0]).nonzero()[0]) - inputs['input_ids'].shape[1]}"
    print(f"{name}: identical={equal}{fork}", flush=True)
print(f"{same} of {len(prompts)} identical")
if "--batch" in sys.argv:
    inputs = chat_inputs(tok, list(prompts.values()))
    plain = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, speculator="ngram",
                         num_speculative_tokens=4, speculative_schedule="constant")
    rows = [bool(torch.equal(a, b)) for a, b in zip(out, plain)]
    print(f"one batch of {len(rows)}: {sum(rows)} rows identical")
