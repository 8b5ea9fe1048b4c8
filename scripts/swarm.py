"""Local multiprocess swarm: ``python scripts/swarm.py --peers 3 --out runs/demo [peer flags]``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from p2p_diloco.cli.launch import swarm_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(swarm_main(sys.argv[1:], prog="swarm.py"))
