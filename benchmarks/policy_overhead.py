"""Host time adaptive k spends per decode step in a loaded server: `choose_rows` (which drafts each row verifies),
`update` (acceptance counts and calibration) and the measured step cost's `observe` and refit, at 32 rows, k = 10,
n-gram's nine confidence classes and random offers and outcomes. On a GPU, where a small model's step takes a few
tens of milliseconds of host time, this is part of what a speculative step costs beyond a plain one.

    python benchmarks/policy_overhead.py [--steps 300]
"""

import argparse
import random
import statistics
import time

import torch

from hf_specdec.costs.step_cost import DEFAULT_STEP_COST
from hf_specdec.costs.adaptive import AdaptiveK


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rows", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = list(range(args.rows))
    priors = tuple(m / (m + 1.5) for m in range(9))
    policy = AdaptiveK(args.rows, 10, DEFAULT_STEP_COST["cpu"], priors=priors, packed=True, measure_steps=True,
                       calibrate=True)
    rng = random.Random(0)

    def step() -> tuple[float, float, float]:
        offered = [rng.choice([0, 0, 3, 10]) for _ in rows]
        classes = [rng.randrange(9) for _ in rows]
        t0 = time.perf_counter()
        ks = policy.choose_rows(rows, offered, classes, context=9000.0)
        t1 = time.perf_counter()
        policy.update(rows, ks, [rng.randint(0, k) for k in ks], classes)
        t2 = time.perf_counter()
        policy.measured.observe(len(rows), len(rows) + sum(ks), 9000.0, sum(ks), 0.1 + 0.001 * sum(ks))
        policy.measured.params  # the refit, as the next step's choice would trigger it
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    for _ in range(50):  # warm-up; the fit is in use from here on
        step()
    times = [step() for _ in range(args.steps)]
    parts = [statistics.median(t[i] for t in times) * 1e3 for i in range(3)]
    print(f"{args.rows} rows, medians over {args.steps} steps: choose_rows {parts[0]:.3f} ms, update {parts[1]:.3f} "
          f"ms, observe and refit {parts[2]:.3f} ms; {sum(parts):.3f} ms a step")


if __name__ == "__main__":
    main()
