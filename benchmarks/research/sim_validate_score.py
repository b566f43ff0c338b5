"""Score simulator validations: cells within the tolerance, the misses, and the repeat spread.

What counts as a cell, the spread and `--against-mean` are described in
pdserve.sim.validation.score, which this runs.

    .venv/bin/python benchmarks/research/sim_validate_score.py \\
        benchmarks/results/sim/validation-cpu-colocated-13/r1-fit-on-r2/validation.json \\
        --spread-from benchmarks/results/sim/validation-cpu-colocated-13/r2-fit-on-r1/validation.json
"""

import sys

from pdserve.sim.validation.score import main

if __name__ == "__main__":
    sys.exit(main())
