"""Assembles a deployable Space folder: this folder's files plus the hf_specdec package vendored beside them.

    python demos/space/build.py build/space
    hf upload <user>/<space> build/space . --repo-type space

The package is copied as it installs (its kernels included), without
caches or tests, so the Space needs nothing from this repository at run time but what `requirements.txt` lists.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

SPACE = Path(__file__).resolve().parent
REPO = SPACE.parents[1]
SPACE_FILES = ("README.md", "app.py", "requirements.txt")
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")


def build(out: Path) -> Path:
    """Writes the Space folder to `out` (replacing an earlier build there) and returns it."""
    out = Path(out)
    resolved = out.resolve()
    if resolved in (REPO, SPACE, *REPO.parents) or (REPO / "hf_specdec") in (resolved, *resolved.parents):
        raise ValueError(f"{out} would overwrite the sources: build into a separate folder, such as build/space")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in SPACE_FILES:
        shutil.copy2(SPACE / name, out / name)
    shutil.copytree(REPO / "hf_specdec", out / "hf_specdec", ignore=IGNORE)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write (replaced if it exists)")
    print(f"wrote {build(parser.parse_args(argv).out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
