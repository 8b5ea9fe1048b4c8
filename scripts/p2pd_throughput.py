"""How fast one stream between two ``p2pd`` daemons carries data, for each ``--p2pd-threads`` value:

    python scripts/p2pd_throughput.py [--threads 1 0] [--messages 300] [--message-mib 1] [--out FILE.json]

The logic lives in experiments/p2pd_throughput.py; this file only calls it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.p2pd_throughput import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="p2pd_throughput.py"))
