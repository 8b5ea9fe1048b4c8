"""CPU per DHT read, on the caller's side and the answerer's (docs/benchmarks.md, "Where a peer's time goes"):

    python scripts/dht_op_cost.py --out runs/dht-ops [--reads 300]

The logic lives in experiments/dht_op_cost.py; this file only calls it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.dht_op_cost import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="dht_op_cost.py"))
