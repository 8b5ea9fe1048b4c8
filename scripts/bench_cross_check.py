"""What cross-checked averaging (the default) costs against ``--no-cross-check``: a local swarm of 3 peers, phases
alternated with the same seed: ``python scripts/bench_cross_check.py --out runs/cross-check-cost [--pairs 2]
[--outer-steps 6] [-- extra peer flags]``. Writes OUT/cross_check_cost.json; see experiments/cross_check_cost.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.cross_check_cost import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="bench_cross_check.py"))
