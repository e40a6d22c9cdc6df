"""Cost of one target forward of q tokens at 240 context: transformers DynamicCache vs our paged runner."""
import time, torch, statistics
import hf_specdec
from hf_specdec.models import load_model
from hf_specdec.model_runner import ModelRunner, paged_attention
from transformers import DynamicCache
model, tok = load_model()
ids = torch.randint(100, 40000, (1, 240))
def med(f, n=15):
    ts = []
    for _ in range(n):
        s = time.perf_counter(); f(); ts.append(time.perf_counter() - s)
    return statistics.median(ts) * 1000
with torch.no_grad():
    for q in (1, 5, 11):
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
        x = torch.randint(100, 40000, (1, q))
        def hf_step():
            model(x, past_key_values=cache, use_cache=True, logits_to_keep=q); cache.crop(-q)
        hf = med(hf_step)
        with paged_attention(model):
            r = ModelRunner(model); r.add_sequence(0)
            r.forward([0], ids, [240], 1)
            def our_step():
                r.forward([0], x, [q], q); r.rollback(0, 240)
            ours = med(our_step)
        print(f"q={q}: hf dynamic cache {hf:.1f} ms, paged runner {ours:.1f} ms")
