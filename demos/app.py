"""Starts the demo: `python demos/app.py [--model NAME] [--draft MODEL] [--host HOST] [--port PORT]`.

The same as `hf-specdec demo`; the app itself lives in `hf_specdec/demo/` so that it ships with the package.
"""

import sys
from pathlib import Path

try:
    from hf_specdec.demo import main
except ImportError:  # run from a checkout that was not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf_specdec.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
