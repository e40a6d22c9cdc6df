"""What a newcomer's step costs a speculator that reads the target's hidden states (EAGLE): 19 rows feeding one
token beside a newcomer feeding a 180-token prompt, packed, with the three states the shipped head reads kept
either padded (every row made as wide as the newcomer: `[rows, 180, 1728]`, the layout before) or picked from the
packed stream (`packed_states=True`, `TargetHiddenStates.ragged`). Each repeat times both, in turn, on the same
rows (rolled back after each step); the medians of the whole forward plus the states' picking are printed.

    python benchmarks/packed_states.py [REPEATS]
"""

import statistics
import sys
import time

import torch

from hf_specdec import EagleSpeculator
from hf_specdec.runners.model_runner import ModelRunner, committed_hidden_states, paged_attention
from hf_specdec.models import DEFAULT_MODEL, load_model, trained_head


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    torch.set_num_threads(2)
    model, _ = load_model(DEFAULT_MODEL)
    layers = EagleSpeculator.from_pretrained(trained_head(DEFAULT_MODEL)).hidden_state_layers
    rows, context, prompt = 20, 150, 180
    g = torch.Generator().manual_seed(0)
    times = {False: [], True: []}
    with torch.no_grad(), paged_attention(model):
        runner = ModelRunner(model, packed=True)
        for row in range(rows):
            runner.add_sequence(row)
        ids = torch.randint(2, model.config.vocab_size, (rows, context), generator=g)
        runner.forward(list(range(rows)), ids, [context] * rows, num_logits=1)  # the running rows' context
        counts = [1] * (rows - 1) + [prompt]
        ids = torch.randint(2, model.config.vocab_size, (rows, prompt), generator=g)
        committed = [0] * (rows - 1) + [prompt - 1]  # a newcomer's prompt: all but its newest token
        for _ in range(repeats):
            for packed_states in (False, True):
                start = time.perf_counter()
                out = runner.forward(list(range(rows)), ids, counts, num_logits=1, output_hidden_states=layers,
                                     packed_states=packed_states)
                states = committed_hidden_states(out.hidden_states, layers, list(range(rows)), counts,
                                                 [context] * rows, committed, getattr(out, "states_packed", False))
                times[packed_states].append(time.perf_counter() - start)
                assert states.row(rows - 1).shape[0] == prompt - 1
                for row in range(rows):
                    runner.rollback(row, context)
    for packed_states, label in ((False, "padded [rows, 180, 1728]"), (True, "picked from the stream")):
        print(f"{label}: median {1e3 * statistics.median(times[packed_states]):.1f} ms "
              f"({', '.join(f'{1e3 * t:.0f}' for t in times[packed_states])})")


if __name__ == "__main__":
    main()
