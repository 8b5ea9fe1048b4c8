"""The monitor page in a real browser: headless Chromium driven by Playwright, for the end-to-end test and for
the screenshot in docs/monitoring.md (``scripts/monitor_screenshot.py``).

Playwright's Python package drives the machine's own Chromium (Debian's ``/usr/bin/chromium``) through its
bundled driver; nothing here downloads a browser (``playwright install`` needs the internet). Each launch gets a
fresh profile folder and flags that keep Chromium off the network except for the page it is pointed at.
``screenshot_main`` runs a real local swarm whose first peer serves the monitor, waits until the chart has
points, and saves a picture of the page.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def chromium_path() -> str | None:
    """Debian's Chromium, or whichever ``chromium`` is on the PATH."""
    return "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else shutil.which("chromium")


def unavailable_reason() -> str | None:
    """Why the browser cannot run here (a missing package), or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install playwright; ./run.sh test installs it)"
    if chromium_path() is None:
        return "no Chromium at /usr/bin/chromium or on the PATH (apt-get install chromium; ./run.sh test installs it as root)"
    return None


@contextmanager
def chromium_page(profile_dir: str | Path, width: int = 1280, height: int = 900) -> Iterator[Any]:
    """A page of a headless Chromium with a fresh profile in ``profile_dir``; the browser is closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(profile_dir),
            executable_path=chromium_path(),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport=dict(width=width, height=height),
        )
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


def chart_points(page: Any) -> int:
    """How many points the monitor page's loss chart draws now."""
    return int(page.get_attribute("#chart", "data-points") or 0)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def screenshot_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="monitor_screenshot.py", description="Save a screenshot of the swarm monitor: "
                                     "of a running monitor (--url), or of a local swarm started for it (default).")
    parser.add_argument("--out", default="docs/monitor.png", help="PNG to write (default docs/monitor.png)")
    parser.add_argument("--url", help="a monitor page already running; without it a local swarm is started")
    parser.add_argument("--peers", type=int, default=3, help="peers of the local swarm (default 3)")
    parser.add_argument("--duration-s", type=float, default=150.0, help="how long the local swarm trains before the picture")
    parser.add_argument("--run-dir", default="runs/monitor-screenshot", help="metrics and logs of the local swarm")
    args, peer_flags = parser.parse_known_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"monitor_screenshot.py: error: {reason}", file=sys.stderr)
        return 2
    if args.url:
        _save(args.url, Path(args.out), wait_s=10.0)
        return 0
    return _screenshot_local_swarm(args, peer_flags)


def _screenshot_local_swarm(args: argparse.Namespace, peer_flags: list[str]) -> int:
    from p2p_diloco.cli.peer_processes import LocalSwarm

    port = free_port()
    flags = ["--run-id", "monitor-demo", "--max-time-s", str(args.duration_s + 60), *peer_flags]
    swarm = LocalSwarm(Path(args.run_dir), flags)
    try:
        swarm.start("peer0", shard=0, num_shards=args.peers, extra=["--monitor-port", str(port)])
        for index in range(1, args.peers):
            swarm.start(f"peer{index}", shard=index, num_shards=args.peers)
        print(f"swarm of {args.peers} peers started; monitor at http://127.0.0.1:{port}/ ; picture in {args.duration_s:.0f} s",
              flush=True)
        time.sleep(args.duration_s)
        _save(f"http://127.0.0.1:{port}/", Path(args.out), wait_s=10.0)
    finally:
        swarm.stop_all()
    return 0


def _save(url: str, out: Path, wait_s: float) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="monitor-shot-") as profile, chromium_page(profile, height=1000) as page:
        page.goto(url)
        deadline = time.monotonic() + wait_s
        while chart_points(page) == 0 and time.monotonic() < deadline:
            page.wait_for_timeout(500)
        page.wait_for_timeout(2000)  # one more poll: the table's rates settle
        page.screenshot(path=str(out), full_page=True)
    print(f"saved {out}", flush=True)
