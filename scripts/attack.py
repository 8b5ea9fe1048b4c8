"""Attacks on a local swarm: 3 honest peers plus one adversary of each kind (NaN outer gradient, gradient x1e4,
weight x1e6, a reducer returning garbage, a donor serving wrong params, a non-member in a closed run), each against
a calm run of the same honest swarm.

    python scripts/attack.py --out runs/attack [--outer-steps 8] [--scenarios nan scaled ...] [peer flags]

Writes OUT/attack.json and OUT/attack.md (a table). See experiments/attack.py for how each figure is computed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.attack import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="attack.py"))
