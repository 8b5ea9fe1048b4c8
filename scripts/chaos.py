"""Chaos harness: kill (SIGKILL) and freeze (SIGSTOP) peers of a local swarm on a schedule, restart them with
--resume, and compare with a calm swarm of the same peers.

    python scripts/chaos.py --peers 4 --duration-s 300 --kill-every-s 30 --restart-after-s 10 --out runs/chaos [peer flags]

Writes OUT/chaos.json (goodput, stalls, time to contribute again, invariant 1, eval loss vs calm) and
OUT/chaos.png (timeline). See experiments/chaos.py for how each figure is computed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.chaos import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="chaos.py"))
