"""Screenshot of the swarm monitor (docs/monitor.png): ``python scripts/monitor_screenshot.py --out docs/monitor.png``
runs a local swarm of 3 peers for 150 s, the first serving the monitor, and photographs the page in headless
Chromium; ``--url URL`` photographs a monitor already running. Extra flags go to every peer."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from experiments.browser import screenshot_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(screenshot_main(sys.argv[1:]))
