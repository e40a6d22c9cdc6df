"""Summaries shared by the benchmark scripts that time variants in turn with plain `generate`."""

import statistics


def report(times: dict[str, list[float]], extra: dict[str, str] | None = None, base: str = "plain") -> None:
    """Prints each variant's speedup over `base`: the ratio of medians, then each repeat's paired ratio (the variant
    timed right after `base` in the same repeat), then `extra[name]` if given."""
    reference = statistics.median(times[base])
    for name, seconds in times.items():
        if name == base:
            continue
        paired = [b / t for b, t in zip(times[base], seconds)]
        tail = f", {extra[name]}" if extra and name in extra else ""
        print(f"{name}: median {reference / statistics.median(seconds):.3f}x, per repeat "
              f"{', '.join(f'{r:.2f}x' for r in paired)}{tail}")
