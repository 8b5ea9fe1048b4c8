"""Bytes on the wire of the DHT's parts of a peer's upkeep, each alone (root):

    sudo .venv/bin/python scripts/dht_traffic.py --out runs/dht-traffic [--members 4] [--period-s 1 5]

The logic lives in experiments/dht_traffic.py; this file only calls it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.dht_traffic import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="dht_traffic.py"))
