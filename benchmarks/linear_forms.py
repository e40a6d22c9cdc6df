"""A SmolLM2 step through the paged runner with this host's calibrated linear forms (`hf-specdec calibrate` first) and
with the stock form, alternating, 14 repeats each; medians. `python benchmarks/linear_forms.py`."""
import statistics
import time

import torch

from hf_specdec.models import load_model
from hf_specdec import calibration
from hf_specdec.model_runner import ModelRunner, paged_attention
torch.set_num_threads(2)
model, tok = load_model("smollm2-135m-instruct")
profile = calibration.load_profile(model)
print("profile", profile.thin_linear_rows, profile.thin_linear_shapes)
g = torch.Generator().manual_seed(0)
results = {}
with torch.no_grad(), paged_attention(model):
    for rows, q in ((1, 1), (1, 4), (4, 3), (8, 1), (16, 1), (8, 3), (16, 3), (32, 1)):
        runner = ModelRunner(model)
        for r in range(rows):
            runner.add_sequence(r)
        ctx = torch.randint(100, 40000, (rows, 128), generator=g)
        runner.forward(list(range(rows)), ctx, [128] * rows, num_logits=1)
        times = {"stock": [], "profile": []}
        for i in range(14):
            for form in (("stock", "profile") if i % 2 else ("profile", "stock")):
                ids = torch.randint(100, 40000, (rows, q), generator=g)
                ctxm = calibration.host_linear(model) if form == "profile" else calibration.thin_linear([model], ())
                with ctxm:
                    t = time.perf_counter()
                    runner.forward(list(range(rows)), ids, [q] * rows, num_logits=q)
                    times[form].append(time.perf_counter() - t)
                for r in range(rows):
                    runner.rollback(r, 128)
        s, p = statistics.median(times["stock"]) * 1e3, statistics.median(times["profile"]) * 1e3
        print(f"{rows} rows x {q} tokens: stock {s:.1f} ms, profile {p:.1f} ms, ratio {p / s:.3f}")
