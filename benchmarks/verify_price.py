"""What a verify of R rows x q tokens costs against what a first-call profile prices it at (issue 50, batch 16).

Measures a first-call profile in a fresh cache directory, then times forwards of `--rows` rows x 1-4 tokens over
`--context` cached tokens a row, with that profile's linear forms, and prints each one's cost in plain steps beside
the profile's price for it.

    python benchmarks/verify_price.py --rows 16 --context 128
"""

import argparse
import os
import tempfile

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    os.environ["HF_SPECDEC_CACHE"] = tempfile.mkdtemp()
    from hf_specdec.costs import calibration
    from hf_specdec.costs.step_cost import measure_step_cost
    from hf_specdec.models import load_model

    torch.set_num_threads(args.threads)
    model, _ = load_model()
    profile = calibration.calibrate(model, [], retry=False, **calibration.FIRST_CALL_GRID)
    if profile is None or profile.step_cost is None:
        raise SystemExit("no step cost was measured steadily on this host (see the warning above); nothing to compare")
    tokens = (1, 2, 3, 4)
    with torch.no_grad(), calibration.host_linear(model):
        _, measured = measure_step_cost(model, (args.rows,), tokens, (args.context,), 5)
    plain = measured.medians["step", args.rows, 1, args.context]
    for q in tokens[1:]:
        price = float(profile.step_cost.relative(args.rows, torch.tensor(float(q)), args.rows * args.context))
        cost = measured.medians["step", args.rows, q, args.context] / plain
        print(f"{args.rows} rows x {q} tokens: costs {cost:.2f} plain steps, priced at {price:.2f}")


if __name__ == "__main__":
    main()
