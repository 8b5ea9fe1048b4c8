"""The entry points: ``p2p-diloco peer`` (one learner island, peer.py) and ``p2p-diloco swarm`` (a local swarm,
launch.py), and what they share: the start-up checks (preflight.py) and the ready file (ready.py). The only layer
that composes all the others; nothing below imports it."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from p2p_diloco.cli.launch import swarm_main
    from p2p_diloco.cli.peer import peer_main

    commands = {"peer": peer_main, "swarm": swarm_main}
    if not argv or argv[0] not in commands:
        print(f"usage: p2p-diloco {{{','.join(commands)}}} [flags]  (p2p-diloco COMMAND --help for details)", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:], prog=f"p2p-diloco {argv[0]}")
