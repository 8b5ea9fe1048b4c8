"""The learning study: DiLoCo's loss gap to tuned sync DP against wire bytes per token (docs/learning.md).

    python scripts/learning_study.py run --out docs/learning [--jobs 2] [--phase tune-syncdp outer-grid seeds]
    python scripts/learning_study.py probe --out docs/learning [--jobs 2]
    python scripts/learning_study.py report --out docs/learning

The logic lives in experiments/learning.py; this file only calls it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.learning import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="learning_study.py"))
