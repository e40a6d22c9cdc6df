"""Where an EAGLE chain's drafts are accepted, and whether the head's confidence could choose the chain length.

Runs SmolLM2-135M-Instruct with a head on the benchmark's open-chat prompts (greedy, 128 new tokens, a constant
chain of --depth drafts every step, batch 1) and records, per step, the head's top-1 probability for each draft and
how many drafts the target accepted. Prints the acceptance at each chain position given the ones before it, how
acceptance tracks the head's confidence, and the modelled speedup of chain-length policies over the recorded steps:
a constant k, or drafting while the chain's cumulative confidence stays above a threshold. The model prices a step
with the CPU step-cost curve adaptive k uses (batch 1, 128 cached tokens) plus the head's measured cost per draft.
It re-prices the recorded steps and ignores that another policy would visit other positions. No wall-clock timing.

    python benchmarks/chain_depth.py [HEAD_DIR ...] [--depth 5] [--draft-cost 0.07]
"""
import argparse
from collections import defaultdict

import torch

from hf_specdec import EagleSpeculator, SpeculativeMetrics, trained_head
from hf_specdec.costs.step_cost import DEFAULT_STEP_COST
from hf_specdec.models import load_model
from hf_specdec.train_eagle import tokenize_prompts
from hf_specdec.workloads import OPEN_CHAT

parser = argparse.ArgumentParser()
parser.add_argument("heads", nargs="*", help="head directories (default: the shipped head)")
parser.add_argument("--depth", type=int, default=5, help="drafts per step while recording")
parser.add_argument("--draft-cost", type=float, default=0.07,
                    help="one head draft relative to a plain target step (0.07: measured for the shipped head)")
parser.add_argument("--new-tokens", type=int, default=128)
args = parser.parse_args()

model, tokenizer = load_model()
BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 1.0001)


def record(head_dir) -> list[tuple[torch.Tensor, int]]:
    """(the head's top-1 probability per draft `[depth]`, drafts accepted) for every full-depth step."""
    spec = EagleSpeculator.from_pretrained(head_dir)
    confidences, steps, logits = [], [], spec.head.logits

    def watched_logits(hidden, vocab):
        out = logits(hidden, vocab)
        confidences.append(torch.softmax(out.float(), -1).amax(-1)[0])
        return out

    spec.head.logits = watched_logits
    propose = spec.propose

    def watched_propose(batch, k):
        confidences.clear()
        draft = propose(batch, k)
        steps.append(torch.stack(confidences) if confidences else None)
        return draft

    spec.propose = watched_propose
    record_step = SpeculativeMetrics.record_step
    outcomes = []

    def watched_record(self, num_draft_tokens, num_accepted):
        outcomes.append((num_draft_tokens[0], num_accepted[0]))
        return record_step(self, num_draft_tokens, num_accepted)

    SpeculativeMetrics.record_step = watched_record
    try:
        pairs = []
        for ids in tokenize_prompts(tokenizer, list(OPEN_CHAT.values())):
            steps.clear()
            outcomes.clear()
            model.generate(torch.tensor([ids]), speculator=spec, num_speculative_tokens=args.depth,
                           speculative_schedule="constant", max_new_tokens=args.new_tokens, do_sample=False)
            pairs += [(c, a) for c, (n, a) in zip(steps, outcomes) if c is not None and n == args.depth == len(c)]
        return pairs
    finally:
        SpeculativeMetrics.record_step = record_step


def modelled_speedup(pairs, choose) -> tuple[float, float]:
    """(tokens per unit of cost relative to plain decoding, tokens per step) if `choose(confidences)` drafts."""
    cost_model = DEFAULT_STEP_COST["cpu"]
    tokens = cost = 0.0
    for confidence, accepted in pairs:
        k = choose(confidence)
        tokens += 1 + min(accepted, k)
        cost += float(cost_model.relative(1, torch.tensor(float(k + 1)), 128.0)) + args.draft_cost * k
    return tokens / cost, tokens / len(pairs)


def while_confident(threshold: float, most: int):
    def choose(confidence):
        k, running = 0, 1.0
        for p in confidence[:most].tolist():
            running *= p
            if running < threshold:
                break
            k += 1
        return k
    return choose


for head_dir in args.heads or [trained_head("smollm2-135m-instruct")]:
    pairs = record(head_dir)
    accepted = torch.tensor([a for _, a in pairs])
    print(f"\n{head_dir}: {len(pairs)} steps with {args.depth} drafts")
    for j in range(args.depth):
        reached, kept = int((accepted >= j).sum()), int((accepted >= j + 1).sum())
        print(f"  draft {j + 1}: reached {reached}, accepted {kept} ({kept / max(reached, 1):.3f} of those reached)")
    table = defaultdict(lambda: [0, 0])
    for confidence, a in pairs:
        for j, p in enumerate(confidence.tolist()):
            if a < j:
                break
            b = next(i for i in range(len(BINS) - 1) if BINS[i] <= p < BINS[i + 1])
            table[b][0] += 1
            table[b][1] += int(a >= j + 1)
    print("  head's top-1 probability -> acceptance of drafts reached:")
    for b in sorted(table):
        n, kept = table[b]
        print(f"    [{BINS[b]:.2f}, {min(BINS[b + 1], 1.0):.2f}): {n:4d} drafts, {kept / n:.3f} accepted")
    print("  modelled speedup over plain decoding (tokens per step):")
    for k in range(args.depth + 1):
        speed, per_step = modelled_speedup(pairs, lambda c, k=k: k)
        print(f"    constant k = {k}: {speed:.2f}x ({per_step:.2f})")
    for threshold in (0.1, 0.2, 0.3, 0.4, 0.5):
        for most in (2, 3, args.depth):
            speed, per_step = modelled_speedup(pairs, while_confident(threshold, most))
            print(f"    while confidence >= {threshold} (at most {most}): {speed:.2f}x ({per_step:.2f})")
