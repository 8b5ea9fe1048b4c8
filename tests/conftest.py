"""Shared fixtures: every test gets a reaper that kills leftover peer process groups, even on failure."""

from __future__ import annotations

import os
import signal

import pytest


@pytest.fixture
def reaper():
    """Collects process-group ids; at teardown SIGKILLs every group still alive."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
