"""Chaos soak of a running pdserve service: `pdserve bench chaos` (pdserve/bench/chaos.py) as a script.

Every flag is `pdserve bench chaos`'s; see benchmarks/README.md ("Chaos soak") for the CPU runs:

    .venv/bin/python benchmarks/chaos.py --write-reference /tmp/ref.json --url http://127.0.0.1:8000
    .venv/bin/python benchmarks/chaos.py --url http://127.0.0.1:8001 --reference /tmp/ref.json \\
        --rate 1 --duration-s 300 --kill-interval-s 60 --out benchmarks/results/chaos/DATE
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["chaos", *sys.argv[1:]]))
