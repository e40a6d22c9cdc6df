"""How a CPU's BLAS handles linear layers over a few rows, the shape of a verify step (k + 1 tokens per row).

Times `F.linear(x, W)` for 1-4 rows against the same product computed as `(W @ x.T).T`, for SmolLM2-135M's matrix
shapes, then a whole target forward of 1-4 new tokens over 64 cached tokens with its linear layers computed each
way. Where the BLAS runs a 2- or 3-row product far slower than a 1-row one, verifying drafts costs several plain
steps and speculation cannot pay. No change to hf_specdec; a measurement only.

    python benchmarks/small_row_linear.py
"""
import time

import torch
import torch.nn.functional as F

from hf_specdec.models import load_model

torch.set_num_threads(2)
ROWS = (1, 2, 3, 4)


def median_ms(fn, repeats: int = 15) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(1000 * sorted(times)[len(times) // 2], 3)


print("linear, ms per call:", ", ".join(f"{r} row(s)" for r in ROWS))
for out_features, in_features in ((576, 576), (1536, 576), (576, 1536), (49152, 576)):
    w = torch.randn(out_features, in_features)
    xs = [torch.randn(r, in_features) for r in ROWS]
    stock = [median_ms(lambda x=x: F.linear(x, w)) for x in xs]
    thin = [median_ms(lambda x=x: (w @ x.t()).t()) for x in xs]
    print(f"  {out_features} x {in_features}: F.linear {stock}   (W @ x.T).T {thin}")


class ThinLinear(torch.nn.Module):
    """A linear layer computed as `(W @ x.T).T`: the same product, another BLAS call shape."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        y = (self.linear.weight @ flat.t()).t()
        if self.linear.bias is not None:
            y = y + self.linear.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


model, _ = load_model()
ids = torch.randint(1000, (1, 64 + max(ROWS)))


@torch.no_grad()
def forward_ms(tokens: int) -> float:
    cache = model(ids[:, :64], use_cache=True).past_key_values

    def step():
        model(ids[:, 64:64 + tokens], past_key_values=cache, use_cache=True)
        cache.crop(-tokens)

    return median_ms(step, repeats=7)


print("target forward over 64 cached tokens, ms:", ", ".join(f"{r} new token(s)" for r in ROWS))
print("  stock:", [forward_ms(r) for r in ROWS])
model.lm_head = ThinLinear(model.lm_head)
print("  LM head as (W @ x.T).T:", [forward_ms(r) for r in ROWS])
for parent, name, child in [(m, n, c) for m in model.model.modules() for n, c in m.named_children()
                            if isinstance(c, torch.nn.Linear)]:
    setattr(parent, name, ThinLinear(child))
print("  every linear as (W @ x.T).T:", [forward_ms(r) for r in ROWS])
