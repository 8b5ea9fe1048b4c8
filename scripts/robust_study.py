"""The clipping radius against a sender just under the thresholds, and its cost on honest peers, without a network.

    python scripts/robust_study.py --out runs/robust-study [--seeds 0 1] [--outer-steps 20] [--clip-ratios 2 1]

The logic lives in experiments/robust_study.py; this file only calls it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.robust_study import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="robust_study.py"))
