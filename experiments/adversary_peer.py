"""TEST ONLY: a peer that misbehaves on purpose: ``python experiments/adversary_peer.py --adversary KIND [peer flags]``.

The peer of ``p2p-diloco peer`` with one of adversary.py's swarm links in place of the honest one; everything else
(the learner, its loop, its flags) is the honest peer's. Used by scripts/attack.py and tests/integration/test_robust.py
(through the launcher's ``entry``). Nothing of it is reachable from the installed package.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.adversary import ADVERSARIES, link_class  # noqa: E402
from p2p_diloco.cli.peer import peer_main  # noqa: E402

PATH = str(Path(__file__).resolve())


def main(argv: list[str]) -> int:
    if "--adversary" not in argv or argv.index("--adversary") + 1 >= len(argv):
        print(f"adversary_peer.py: error: --adversary KIND is required (one of {', '.join(ADVERSARIES)})", file=sys.stderr)
        return 2
    at = argv.index("--adversary")
    kind, rest = argv[at + 1], argv[:at] + argv[at + 2 :]
    if kind not in ADVERSARIES:
        print(f"adversary_peer.py: error: unknown adversary {kind!r} (one of {', '.join(ADVERSARIES)})", file=sys.stderr)
        return 2
    return peer_main(rest, prog="adversary_peer.py", link_class=link_class(kind))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
