"""What a volunteer runs: one p2p-diloco learner island. ``python peers/peer.py --help`` lists the flags."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from p2p_diloco.cli.peer import peer_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(peer_main(prog="peer.py"))
