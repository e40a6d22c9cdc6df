"""A SmolLM2 step through the paged runner with this host's calibrated linear forms (`hf-specdec calibrate` first),
with them but no packed weights (`HF_SPECDEC_PACKED_LINEAR=off`) and with the stock form, in turn, 14 repeats each;
medians. `python benchmarks/linear_forms.py`."""
import os
import statistics
import time

import torch

from hf_specdec.models import load_model
from hf_specdec.costs import calibration
from hf_specdec.runners.model_runner import ModelRunner, paged_attention
torch.set_num_threads(2)
model, tok = load_model("smollm2-135m-instruct")
profile = calibration.load_profile(model)
print("profile", profile.thin_linear_rows, profile.thin_linear_shapes, profile.packed_linear_shapes)


def unpacked():
    os.environ["HF_SPECDEC_PACKED_LINEAR"] = "off"
    try:
        return calibration.host_linear(model)
    finally:
        del os.environ["HF_SPECDEC_PACKED_LINEAR"]


forms = {"stock": lambda: calibration.thin_linear([model], ()), "unpacked": unpacked,
         "profile": lambda: calibration.host_linear(model)}
g = torch.Generator().manual_seed(0)
results = {}
with torch.no_grad(), paged_attention(model):
    for rows, q in ((1, 1), (1, 4), (4, 3), (8, 1), (16, 1), (8, 3), (16, 3), (32, 1)):
        runner = ModelRunner(model)
        for r in range(rows):
            runner.add_sequence(r)
        ctx = torch.randint(100, 40000, (rows, 128), generator=g)
        runner.forward(list(range(rows)), ctx, [128] * rows, num_logits=1)
        times = {name: [] for name in forms}
        for i in range(14):
            names = list(forms)
            for form in names[i % 3:] + names[:i % 3]:
                ids = torch.randint(100, 40000, (rows, q), generator=g)
                with forms[form]():
                    t = time.perf_counter()
                    runner.forward(list(range(rows)), ids, [q] * rows, num_logits=q)
                    times[form].append(time.perf_counter() - t)
                for r in range(rows):
                    runner.rollback(r, 128)
        s, u, p = (statistics.median(times[name]) * 1e3 for name in ("stock", "unpacked", "profile"))
        print(f"{rows} rows x {q} tokens: stock {s:.1f} ms, profile without packing {u:.1f} ms ({u / s:.3f}), "
              f"profile {p:.1f} ms ({p / s:.3f}; {p / u:.3f} of without packing)", flush=True)
