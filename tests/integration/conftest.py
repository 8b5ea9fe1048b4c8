"""Every test under tests/integration is marked ``integration`` (real DHTs, sockets, peer processes); those that need
root (network namespaces) are marked ``root`` too, and the one that drives Chromium ``browser``. ``pytest`` alone runs
tests/unit (pyproject.toml); ``./run.sh test`` runs both tiers."""

from __future__ import annotations

import os

import pytest

from p2p_diloco.cli.peer_processes import PEER_COMMAND, peer_environment

from . import harness
from .warm_start import WarmStarter

_ROOT = ("test_wan.py", "test_nat.py")
_BROWSER = ("test_monitor_page_in_chromium_shows_a_live_swarm",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.integration)
        if item.path.name in _ROOT:
            item.add_marker(pytest.mark.root)
        if item.name in _BROWSER:
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session", autouse=True)
def _warm_starts():
    """The fork server the harness's peers start from (warm_start.py), started before any test's own processes
    (so the per-test reaper keeps it) and stopped by its pid at the end of the session."""
    if os.environ.get("P2P_DILOCO_TEST_COLD_STARTS") == "1":  # every peer a fresh interpreter, to compare
        yield
        return
    harness.WARM = WarmStarter(PEER_COMMAND, peer_environment())
    harness.WARM.start()
    yield
    harness.WARM.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if harness.WARM is not None:  # so that a run in which the tests' peers silently started fresh shows it
        terminalreporter.write_line(harness.WARM.summary())
