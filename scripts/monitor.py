"""Read-only swarm monitor: ``python scripts/monitor.py --run-id R --initial-peers MULTIADDR --port 8470``.

Joins the run's DHT without training and serves the live monitor page (p2p_diloco/observe/monitor.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from p2p_diloco.cli.monitor import monitor_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(monitor_main(sys.argv[1:], prog="monitor.py"))
