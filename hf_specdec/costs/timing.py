"""Timing this host's costs so that one noisy moment cannot poison them (calibration.py caches what passes).

A loaded host (other processes, a throttled CPU) slows some timings and not others, and a profile fitted to them
prices drafting wrongly for every later call: one measured under load priced a 1-draft verify at 4.6 plain steps.
So every measurement here is
- interleaved: a round times every cell once (each (rows, tokens, context) forward; each linear row count in both
  forms, side by side), so a slow moment hits a round rather than one cell, and the median over rounds is kept;
- repeated and checked: when a cell's repeats disagree (the middle ones differ by more than `SPREAD`) the whole grid
  is measured again, up to `attempts` times in all;
- bounded by physics: a forward of B rows of q tokens does at most the work of B * q one-token forwards (it reads
  the weights once instead of B * q times), so it may cost at most `BOUND` times that much, and no less than
  `FLOOR` times a one-token forward (not 1: on some hosts a one-row product runs a slower kernel than a few rows,
  e.g. MKL on an AMD EPYC, where a 4-token forward took 0.76 of a one-token one); the same holds for a linear layer
  over r rows, down to `LINEAR_FLOOR`.
What still fails comes back as `Measurement.problem`, and the caller keeps the static default instead. Timings go
through a `Timer`, `timer(key, fn) -> seconds`, which tests replace with made-up numbers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

SPREAD = 1.3  # the middle repeats of one timing may differ by at most this factor
BOUND = 1.25  # slack on the physical bounds above
FLOOR = 0.5  # the least a forward of more tokens may cost, in one-token ones
# The least a linear layer over more rows may cost, in one-row products: read from memory, as a forward reads its
# weights, a one-row product through MKL on an AMD EPYC took 2.4 times a two-row one (a slow matrix-vector kernel).
LINEAR_FLOOR = 0.25
ATTEMPTS = 2  # measurements of a grid before giving up on it

Timer = Callable[[tuple, Callable[[], object]], float]


def wall_timer(device: torch.device) -> Timer:
    """Times `fn()` by the wall clock, waiting for `device` before and after."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timer(key: tuple, fn: Callable[[], object]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start
    return timer


@dataclass
class Measurement:
    """Medians of repeated timings, and why they cannot be trusted (`problem`; None when they can)."""

    medians: dict[tuple, float]
    problem: str | None = None
    attempts: int = 1


def spread(values: list[float]) -> float:
    """How far a timing's middle repeats lie apart (the lowest and highest quarter left out), as a ratio."""
    low, high = middle(values)
    return high / max(low, 1e-12)


def middle(values) -> tuple[float, float]:
    """The lowest and highest of the middle repeats (the lowest and highest quarter left out)."""
    values = sorted(values)
    cut = len(values) // 4
    return values[cut], values[-1 - cut]


def name(key: tuple) -> str:
    if key[0] == "step":
        return f"a forward of {key[1]} row(s) x {key[2]} token(s) over {key[3]} cached"
    if key[0] == "linear":
        return f"a {key[2]}-row linear layer ({key[1]} form)"
    if key[0] == "packed":
        return f"a {key[2]}-row linear layer of shape {key[3]} ({key[1]} form)"
    return "a drafted token's cost" if key == ("draft",) else " ".join(map(str, key))


def _show(key: tuple, value: float) -> str:
    return f"{value:.4g} plain steps" if key == ("draft",) else f"{1000 * value:.4g} ms"


def _disagreement(samples: dict[tuple, list[float]]) -> str | None:
    spreads = {key: spread(values) for key, values in samples.items() if len(values) >= 3}
    noisy = [key for key, s in spreads.items() if s > SPREAD]
    if not noisy:
        return None
    worst = max(noisy, key=spreads.get)
    values = sorted(samples[worst])
    return (f"{len(noisy)} of {len(samples)} timings disagree between repeats (worst: {name(worst)}, "
            f"{_show(worst, values[0])} to {_show(worst, values[-1])}; at most {SPREAD}x apart is accepted)")


def measure_repeated(run_round: Callable[[int], dict[tuple, float]], repeats: int,
                     check: Callable[[dict[tuple, float]], str | None] | None = None,
                     attempts: int = ATTEMPTS,
                     agree: Callable[[dict[tuple, list[float]]], str | None] | None = None) -> Measurement:
    """Runs `repeats` rounds (`run_round(i) -> {key: seconds}`) and keeps each key's median, when the repeats agree
    (`agree(samples)` says why not; by default no key's middle repeats may lie more than `SPREAD` apart) and
    `check(medians)` finds nothing implausible; otherwise measures all again, `attempts` times in all."""
    agree = agree or _disagreement
    for attempt in range(1, attempts + 1):
        samples: dict[tuple, list[float]] = {}
        for i in range(repeats):
            for key, value in run_round(i).items():
                samples.setdefault(key, []).append(value)
        medians = {key: statistics.median(values) for key, values in samples.items()}
        problem = agree(samples) or (check(medians) if check is not None else None)
        if problem is None:
            return Measurement(medians, None, attempt)
    return Measurement(medians, f"{problem}; measured {attempts} time(s)", attempts)


def timed_round(cells: dict[tuple, Callable[[], object]], timer: Timer, start: int = 0,
                after: Callable[[tuple], None] | None = None) -> dict[tuple, float]:
    """Times each cell once, beginning with the `start`-th (rounds rotate so no cell always comes first); `after`
    runs untimed after each."""
    keys = list(cells)
    start %= max(len(keys), 1)
    out = {}
    for key in keys[start:] + keys[:start]:
        out[key] = timer(key, cells[key])
        if after is not None:
            after(key)
    return out


def out_of_bounds(cost: float, work: float, unit: float, what: str, floor: float = FLOOR) -> str | None:
    """`cost` of `work` times the work that costs `unit`: physical when within [floor * unit, BOUND * work * unit]."""
    if cost > BOUND * work * unit or cost < floor * unit:
        return (f"{what} took {cost / unit:.2f} times the one-token (one-row) cost, outside the physical range "
                f"[{floor:.2f}, {BOUND * work:.2f}]")
    return None
