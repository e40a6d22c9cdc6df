"""How much of an EAGLE head's accuracy comes from its attention over its own earlier entries: teacher-forced
top-1 agreement with the target (as `head_agreement.py`) when each entry may attend only to its newest W entries
(itself included), for several W. An idle row keeps only its newest `EagleSpeculator.IDLE_WINDOW` states and the
head's cache starts again from them when drafting resumes, so this is what a window of that size costs at worst
(every entry limited; after a resume the cache grows back). No timing.

    python benchmarks/head_window.py [HEAD_DIR] [--windows 1,2,4,8,16,32,64] [--new-tokens 96]
"""

import argparse

import torch

from hf_specdec import EagleSpeculator, trained_head
from hf_specdec.models import DEFAULT_MODEL, load_model
from hf_specdec.cache.paged import ATTENTION_NAME
from hf_specdec.train_eagle import tokenize_prompts
from hf_specdec.workloads import GROUNDED, HELD_OUT, OPEN_CHAT


def band_mask(length: int, window: int | None) -> torch.Tensor:
    """`[1, 1, length, length]` additive mask: causal, and at most `window` entries back (itself included)."""
    i = torch.arange(length)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    return torch.zeros(length, length).masked_fill(~allowed, float("-inf"))[None, None]


@torch.no_grad()
def agreement(model, tokenizer, head, prompts: list[str], windows: list[int | None], new_tokens: int) -> list[float]:
    """Mean agreement over `prompts` for each window (None: the whole context)."""
    attention, masks = head.layer.self_attn, {}
    forward = attention.forward
    # The head's layer passes no mask of its own (its cache decides what it sees): give it the band.
    attention.forward = lambda *args, attention_mask=None, **kwargs: forward(*args, attention_mask=masks["now"],
                                                                            **kwargs)
    attention.config._attn_implementation = "sdpa"
    layers = head.config["target_hidden_states"]["layers"]
    scores = [[] for _ in windows]
    try:
        for ids in tokenize_prompts(tokenizer, prompts):
            seq = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
            out = model(seq, output_hidden_states=True)
            labels = out.logits.argmax(-1)
            length, start = seq.shape[1] - 1, len(ids) - 1  # entry `start` reads the first generated token
            features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)[:, :-1]
            for window, window_scores in zip(windows, scores):
                masks["now"] = band_mask(length, window)
                hidden = head(seq[:, 1:], torch.arange(length)[None], None, features)
                predicted = head.logits(hidden, model.config.vocab_size).argmax(-1)
                window_scores.append((predicted[0, start:] == labels[0, start + 1:]).float().mean().item())
    finally:
        attention.forward = forward
        attention.config._attn_implementation = ATTENTION_NAME
    return [sum(s) / len(s) for s in scores]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("head", nargs="?", default=None, help="head directory (default: the shipped head)")
    parser.add_argument("--windows", default="1,2,4,8,16,32,64")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(DEFAULT_MODEL)
    head = EagleSpeculator.from_pretrained(args.head or trained_head(DEFAULT_MODEL)).head
    head.bind(model)
    windows = [int(w) for w in args.windows.split(",")] + [None]
    print(f"{'prompt group':22s} " + " ".join(f"{'W=' + str(w) if w else 'whole':>7s}" for w in windows))
    groups = {"held-out hand-written": HELD_OUT, "benchmark open chat": list(OPEN_CHAT.values()),
              "benchmark grounded": list(GROUNDED.values())}
    for name, prompts in groups.items():
        scores = agreement(model, tokenizer, head, prompts, windows, args.new_tokens)
        print(f"{name:22s} " + " ".join(f"{s:7.3f}" for s in scores), flush=True)


if __name__ == "__main__":
    main()
