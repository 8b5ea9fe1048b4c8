"""The ratio of a local swarm's tokens/s to the same N processes trained bare (no communication), in one run:
``python scripts/bench_overhead.py --out runs/overhead [--peers 3] [--inner-steps 50] [--outer-steps 6] [--threads 1]
[--batch-size 16] [--seq-len 128] [--repeats 1] [-- extra peer flags]``: bare, swarm, bare (R swarm phases with
``--repeats R``), each swarm against the bare phases around it. Writes ``overhead.json`` and ``overhead.md``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.overhead import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="bench_overhead.py"))
