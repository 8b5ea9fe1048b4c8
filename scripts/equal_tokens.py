"""Loss at equal tokens, without a network: DiLoCo at several H against synchronous data parallel.

    python scripts/equal_tokens.py --out runs/equal-tokens [--tokens 1700000] [--inner-steps 10 25 100] [--peers 4]

The logic lives in experiments/equal_tokens.py; this file only calls it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.equal_tokens import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="equal_tokens.py"))
