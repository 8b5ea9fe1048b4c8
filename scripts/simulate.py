"""Internet scale by simulation: goodput and bandwidth at 10 to 1,000,000 chips (docs/scale.md).

    python scripts/simulate.py sweep [--calibrate-from RUN_DIR] [--out DIR] [--seed N]
    python scripts/simulate.py report                  # the Decoupled DiLoCo report's cases
    python scripts/simulate.py bandwidth --params 12e9 --islands 8 --tokens-per-s 3e5 --tokens-per-step 5e5 --inner-steps 24 ...
    python scripts/simulate.py calibrate runs/chaos    # a run's measured overheads, and its faults replayed

The logic lives in experiments/sim/; this file only calls it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.sim.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="simulate.py"))
