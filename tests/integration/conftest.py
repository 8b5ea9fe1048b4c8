"""Every test under tests/integration is marked ``integration`` (real DHTs, sockets, peer processes); those that need
root (network namespaces) are marked ``root`` too, and the one that drives Chromium ``browser``. ``pytest`` alone runs
tests/unit (pyproject.toml); ``./run.sh test`` runs both tiers."""

from __future__ import annotations

import pytest

_ROOT = ("test_wan.py", "test_nat.py")
_BROWSER = ("test_monitor_page_in_chromium_shows_a_live_swarm",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.integration)
        if item.path.name in _ROOT:
            item.add_marker(pytest.mark.root)
        if item.name in _BROWSER:
            item.add_marker(pytest.mark.browser)
