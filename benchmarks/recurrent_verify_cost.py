"""What keeping a recurrent state after every verified position costs (hf_specdec/recurrent_state.py).

One row at 64 cached tokens, 4-layer models (hidden 256, float32, one thread), median of 15 forwards each:
a one-token step; a 4-token verify that keeps the state after each position (the recurrent layers run it one token
at a time); the same 4 tokens with only the last position's logits (3 through the model's own chunked path, 1 more).
Run: `python benchmarks/recurrent_verify_cost.py`.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, Mamba2Config, Mamba2ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM,
)

from hf_specdec.runners.model_runner import ModelRunner, paged_attention

COMMON = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=4, pad_token_id=0, eos_token_id=None)
ATTENTION = dict(intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                 max_position_embeddings=512)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, **ATTENTION)),
    "mamba2": lambda: Mamba2ForCausalLM(Mamba2Config(**COMMON, num_heads=8, head_dim=64, n_groups=1, state_size=64,
                                                     expand=2)),
    "qwen3_next": lambda: Qwen3NextForCausalLM(Qwen3NextConfig(
        **COMMON, **ATTENTION, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32, mlp_only_layers=[0, 1, 2, 3])),
}


def main() -> None:
    torch.set_num_threads(1)
    for name, build in MODELS.items():
        torch.manual_seed(0)
        model = build().eval()
        with torch.no_grad(), paged_attention(model):
            runner = ModelRunner(model)
            runner.add_sequence(0)
            runner.forward([0], torch.randint(3, 1000, (1, 64)), [64], num_logits=1)

            def timed(q: int, num_logits: int) -> float:
                times = []
                for _ in range(15):
                    start = time.perf_counter()
                    runner.forward([0], torch.randint(3, 1000, (1, q)), [q], num_logits=num_logits)
                    times.append(time.perf_counter() - start)
                    runner.rollback(0, 64)
                return statistics.median(times) * 1e3

            one, verify, chunked = timed(1, 1), timed(4, 4), timed(4, 1)
            print(f"{name}: 1 token {one:.2f} ms; 4-token verify, state after each {verify:.2f} ms "
                  f"({verify / one:.2f}x); 4 tokens, chunked + last {chunked:.2f} ms ({chunked / one:.2f}x)")


if __name__ == "__main__":
    main()
