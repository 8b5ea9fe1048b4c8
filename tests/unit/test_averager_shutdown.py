"""A stop in mid-round: the averager's shutdown ends its running groups, and its runners, without a traceback
(docs/design.md §6)."""

from __future__ import annotations

import asyncio
import gc
import types

import pytest
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner

from p2p_diloco.swarm.averaging import DilocoAverager, ExactAllReduceRunner


class _Runner:
    def __init__(self) -> None:
        self.finalized: list[bool] = []

    def finalize(self, *, cancel: bool = False) -> None:
        self.finalized.append(cancel)


async def _gone(*_args, **_kwargs) -> None:
    raise FileNotFoundError(2, "No such file or directory")  # p2pd's control socket, removed as p2pd stopped


async def _stop(shutdown, p2pd_gone: bool = False) -> tuple[dict, _Runner]:
    built, runner = asyncio.get_running_loop().create_future(), _Runner()
    built.set_result(runner)
    groups = {b"matched": asyncio.get_running_loop().create_future(), b"running": built}
    averager = types.SimpleNamespace(client_mode=not p2pd_gone, _running_groups=groups, _p2p=None, prefix="x",
                                     remove_p2p_handlers=_gone)
    await shutdown(averager, None)
    return groups, runner


def test_shutdown_finalizes_running_groups_and_cancels_the_ones_not_built_yet():
    groups, runner = asyncio.run(_stop(DilocoAverager._shutdown))
    assert runner.finalized == [True]
    assert groups[b"matched"].cancelled()


def test_shutdown_after_p2pd_went_first_still_ends_the_groups():
    # seen in a peer's log at a SIGTERM: the DHT's shutdown had ended p2pd, and removing our handlers raised
    groups, runner = asyncio.run(_stop(DilocoAverager._shutdown, p2pd_gone=True))
    assert runner.finalized == [True] and groups[b"matched"].cancelled()
    with pytest.raises(FileNotFoundError):  # hivemind's raises there, before it reaches the groups
        asyncio.run(_stop(DecentralizedAverager._shutdown, p2pd_gone=True))


def test_hivemind_own_shutdown_fails_on_the_same_groups():
    # what DilocoAverager._shutdown changes: hivemind's takes the futures for runners
    with pytest.raises(AttributeError, match="finalize"):
        asyncio.run(_stop(DecentralizedAverager._shutdown))


class _Finalizable:
    def __init__(self) -> None:
        self.finalized = False

    def finalize(self) -> None:
        self.finalized = True


def _runner_cancelled_mid_round(runner_class: type) -> tuple[bool, list[str]]:
    """A runner (the parts of it hivemind's finalize touches) whose run() ends in a cancellation, as at a stop in
    mid-round: whether its future ended cancelled, and what asyncio logged once the runner was gone."""

    async def run() -> tuple[bool, list[str]]:
        logged: list[str] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: logged.append(context["message"]))
        runner = object.__new__(runner_class)
        runner._future = asyncio.get_running_loop().create_future()
        runner.peer_id, runner.ordered_peer_ids = "us", ("us", "them")
        runner.tensor_part_container, runner.tensor_part_reducer = _Finalizable(), _Finalizable()
        runner.finalize(exception=asyncio.CancelledError())  # run()'s `except BaseException as e: finalize(exception=e)`
        assert runner.tensor_part_container.finalized and runner.tensor_part_reducer.finalized
        cancelled = runner._future.cancelled()
        del runner
        gc.collect()  # its future, unread, goes with it: that is when asyncio logs an exception nobody retrieved
        return cancelled, logged

    return asyncio.run(run())


def test_a_runner_cancelled_mid_round_is_cancelled_not_failed_with_an_unread_exception():
    cancelled, logged = _runner_cancelled_mid_round(ExactAllReduceRunner)
    assert cancelled and logged == []


def test_hivemind_own_runner_leaves_the_cancellation_unread():
    # what ExactAllReduceRunner.finalize changes: a peer stopped mid-round logged this, with a traceback
    cancelled, logged = _runner_cancelled_mid_round(AllReduceRunner)
    assert not cancelled and logged == ["Future exception was never retrieved"]
