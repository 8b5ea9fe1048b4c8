"""p2p-diloco against synchronous data parallel, hivemind.Optimizer and a bare PyTorch loop on one emulated WAN
(root): ``python scripts/bench.py --out runs/bench [--quick] [--peers 4] [--bandwidth-mbit 20] [peer flags]``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="bench.py"))
