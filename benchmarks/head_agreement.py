"""Teacher-forced agreement of an EAGLE head with its target: for each prompt the target continues greedily (64
tokens), then one forward gives its hidden states and argmax at every position, and the head, run over the whole
sequence, predicts each next argmax from the target's own states. The share it gets right is an upper bound on the
first draft's acceptance. Prompt groups: ones the head was trained on, unseen ones from the same built-in set, and
the benchmark's workloads. No timing.

    python benchmarks/head_agreement.py HEAD_DIR [HEAD_DIR ...] [--trained N]   (N: the --self-distill count)
        [--model TARGET] [--threads N]
"""
import argparse

import _common  # benchmarks/, this script's folder
import torch

from hf_specdec import EagleSpeculator
from hf_specdec.cache.attention import ATTENTION_NAME
from hf_specdec.train_eagle import tokenize_prompts
from hf_specdec.train_eagle.prompts import built_in_prompts, max_prompts

parser = argparse.ArgumentParser()
parser.add_argument("heads", nargs="+", help="head directories, compared on the same target sequences")
parser.add_argument("--trained", type=int, default=3000, help="how many built-in prompts the heads were trained on")
parser.add_argument("--new-tokens", type=int, default=64)
_common.add_model_args(parser, threads=None, options=("model", "threads"))  # the heads' target
args = parser.parse_args()

model, tokenizer = _common.load(args)
heads = [EagleSpeculator.from_pretrained(path).head for path in args.heads]
for head in heads:
    head.bind(model)
    head.layer.self_attn.config._attn_implementation = "sdpa"  # plain causal attention over whole sequences


@torch.no_grad()
def agreement(prompts: list[str]) -> list[float]:
    """Each head's mean agreement over `prompts`, all heads scored on the same target sequences."""
    scores = [[] for _ in heads]
    for ids in tokenize_prompts(tokenizer, prompts):
        seq = model.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False)
        out = model(seq, output_hidden_states=True)
        labels = out.logits.argmax(-1)
        positions = torch.arange(seq.shape[1] - 1)[None]
        start = len(ids) - 1  # the entry reading the first generated token
        for head, head_scores in zip(heads, scores):
            layers = head.config["target_hidden_states"]["layers"]
            features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
            # Entry p reads the state at p and the token at p + 1 and predicts the target's argmax at p + 1.
            hidden = head(seq[:, 1:], positions, None, features[:, :-1])
            predicted = head.logits(hidden, model.config.vocab_size).argmax(-1)
            head_scores.append((predicted[0, start:] == labels[0, start + 1:]).float().mean().item())
    return [sum(s) / len(s) for s in scores]


groups = {
    "trained built-in prompts": built_in_prompts(args.trained)[-6:],
    **({"unseen built-in prompts": built_in_prompts(max_prompts())[-6:]} if args.trained + 6 <= max_prompts() else {}),
    "held-out hand-written": _common.prompt_texts("held_out"),
    "benchmark open chat": _common.prompt_texts("open_chat"),
    "benchmark grounded": _common.prompt_texts("grounded"),
}
print(f"{'prompt group':28s} " + " ".join(f"{i:>8d}" for i in range(len(heads))) + "   (top-1 agreement per head)")
for i, path in enumerate(args.heads):
    print(f"  head {i}: {path}")
for name, prompts in groups.items():
    print(f"{name:28s} " + " ".join(f"{a:8.3f}" for a in agreement(prompts)) + f"   ({len(prompts)} prompts)")
for head in heads:
    head.layer.self_attn.config._attn_implementation = ATTENTION_NAME
