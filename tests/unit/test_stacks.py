"""cli/stacks.py: which processes handle the stack-dump signal (a process that does not would die of it)."""

from __future__ import annotations

import faulthandler
import os
import sys

import pytest

from p2p_diloco.cli import stacks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or stacks.DUMP_SIGNAL is None,
                                reason="SigCgt is read from Linux's /proc")


def test_catches_reads_whether_a_handler_is_installed():
    signum = stacks.DUMP_SIGNAL
    faulthandler.unregister(signum)  # a known start: an earlier test may have run a peer's main in this process
    assert not stacks.catches(os.getpid(), signum)  # SIGUSR1 back to its default action
    assert stacks.enable()
    try:
        assert stacks.catches(os.getpid(), signum)
    finally:
        faulthandler.unregister(signum)
    assert not stacks.catches(os.getpid(), signum)


def test_catches_and_dump_before_kill_on_a_process_that_is_gone():
    assert not stacks.catches(2**22 + 12345, stacks.DUMP_SIGNAL)  # above pid_max's default: no such process
    assert not stacks.dump_before_kill(2**22 + 12345, wait_s=0)
