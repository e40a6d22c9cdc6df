"""Sweep n-gram settings on the embedded default model against plain generate and transformers prompt lookup."""
import time, statistics, torch, hf_specdec
from hf_specdec.models import load_model
from hf_specdec.workloads import GROUNDED, chat_inputs
model, tok = load_model()
inputs = chat_inputs(tok, [GROUNDED["repeat_summarise"]])
def t(**kw):
    ts = []
    for _ in range(2):
        s = time.perf_counter(); out = model.generate(**inputs, max_new_tokens=128, do_sample=False, **kw); ts.append(time.perf_counter() - s)
    return statistics.median(ts), out
model.generate(**inputs, max_new_tokens=4)
base, ref = t()
n = ref.shape[1] - inputs["input_ids"].shape[1]
print(f"plain {n/base:.1f} tok/s", flush=True)
pl, o = t(prompt_lookup_num_tokens=10); print(f"hf prompt_lookup=10 {n/pl:.1f} tok/s {base/pl:.2f}x same={torch.equal(o, ref)}", flush=True)
for (lo, hi) in [(1, 4), (2, 4), (3, 6)]:
    for k in (4, 7, 10):
        sp = hf_specdec.NgramSpeculator(lo, hi)
        tt, o = t(speculator=sp, num_speculative_tokens=k, return_dict_in_generate=True)
        m = o.speculative_metrics
        print(f"ngram({lo},{hi}) k={k}: {n/tt:.1f} tok/s {base/tt:.2f}x acc={m.acceptance_rate:.2f} mal={m.mean_acceptance_length:.2f} steps={m.num_steps} draft={m.draft_time_s:.2f}s verify={m.verify_time_s:.2f}s same={torch.equal(o.sequences, ref)}", flush=True)
