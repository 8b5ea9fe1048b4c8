"""A stop in mid-round: the averager's shutdown ends its running groups without a traceback (docs/design.md §6)."""

from __future__ import annotations

import asyncio
import types

import pytest
from hivemind.averaging import DecentralizedAverager

from p2p_diloco.swarm.averaging import DilocoAverager


class _Runner:
    def __init__(self) -> None:
        self.finalized: list[bool] = []

    def finalize(self, *, cancel: bool = False) -> None:
        self.finalized.append(cancel)


async def _stop(shutdown) -> tuple[dict, _Runner]:
    built, runner = asyncio.get_running_loop().create_future(), _Runner()
    built.set_result(runner)
    groups = {b"matched": asyncio.get_running_loop().create_future(), b"running": built}
    averager = types.SimpleNamespace(client_mode=True, _running_groups=groups)
    await shutdown(averager, None)
    return groups, runner


def test_shutdown_finalizes_running_groups_and_cancels_the_ones_not_built_yet():
    groups, runner = asyncio.run(_stop(DilocoAverager._shutdown))
    assert runner.finalized == [True]
    assert groups[b"matched"].cancelled()


def test_hivemind_own_shutdown_fails_on_the_same_groups():
    # what DilocoAverager._shutdown changes: hivemind's takes the futures for runners
    with pytest.raises(AttributeError, match="finalize"):
        asyncio.run(_stop(DecentralizedAverager._shutdown))
