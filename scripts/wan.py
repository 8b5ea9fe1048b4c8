"""A local swarm over an emulated wide-area network (root): ``python scripts/wan.py --peers 4 --bandwidth-mbit 20
--out runs/wan [peer flags]``; ``--cleanup`` removes what a crashed run left."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.wan import wan_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(wan_main(sys.argv[1:], prog="wan.py"))
