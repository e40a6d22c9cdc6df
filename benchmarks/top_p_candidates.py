"""Top-p on the PyTorch path, on a CPU: a full-vocabulary sort (`TopPLogitsWarper`'s way) against the cut looked for
among each row's highest scores first (`kernels/sampling/reference.py`), on SmolLM2-135M-Instruct's own logits at
the serving engine's shapes: every position of a few chat continuations, temperature 0.7, top_p 0.9 and 0.95.
Checks both keep the same tokens, counts the rows that still needed a sort, and times both (medians).

    python benchmarks/top_p_candidates.py [--rows 26,80] [--threads 2]
"""
import argparse
import statistics
import time

import torch

import hf_specdec.kernels.sampling.reference as reference
from hf_specdec.models import DEFAULT_MODEL, load_model

PROMPTS = ["Write a short story about a lighthouse keeper.", "What are the benefits of regular exercise?",
           "Explain how a refrigerator works.", "Give me three ideas for a birthday party."]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="26,80")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(DEFAULT_MODEL)
    logits = []
    with torch.no_grad():
        for prompt in PROMPTS:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=False)
            ids = tokenizer(text, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=40, do_sample=False)
            logits.append(model(out).logits[0, ids.shape[1] - 1:-1].float())
    logits = torch.cat(logits) / 0.7
    for rows in (int(r) for r in args.rows.split(",")):
        x = logits[torch.arange(rows) % len(logits)]
        for p in (0.9, 0.95):
            top_p = torch.full((rows,), p)
            sorted_rows = []
            sort = reference._top_p_remove
            reference._top_p_remove = lambda s, q, seen=sorted_rows, sort=sort: seen.append(len(s)) or sort(s, q)
            fast = reference._top_p_remove_from_candidates(x, top_p)
            reference._top_p_remove = sort
            assert torch.equal(fast, sort(x, top_p)), "different tokens kept"
            times = {"sort": [], "candidates": []}
            for _ in range(7):
                for name, way in (("sort", sort), ("candidates", reference._top_p_remove_from_candidates)):
                    start = time.perf_counter()
                    way(x, top_p)
                    times[name].append(time.perf_counter() - start)
            kept = (~fast).sum(1).float()
            print(f"{rows} rows, top_p {p}: sort {1e3 * statistics.median(times['sort']):.1f} ms, candidates "
                  f"{1e3 * statistics.median(times['candidates']):.1f} ms; {sum(sorted_rows)} rows sorted; tokens "
                  f"kept per row median {kept.median():.0f}, max {kept.max():.0f}", flush=True)


if __name__ == "__main__":
    main()
