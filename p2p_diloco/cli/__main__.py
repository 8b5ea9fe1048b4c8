"""``python -m p2p_diloco.cli {peer,swarm} [flags]``: what the installed ``p2p-diloco`` command runs."""

import sys

from p2p_diloco.cli import main

if __name__ == "__main__":
    sys.exit(main())
