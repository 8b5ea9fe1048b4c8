"""Abandoning a search for a group (averaging.py): the averager process must find the step cancelled when it is
woken, or it searches on with the old step until the step's deadline and blocks the next outer steps' searches."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import threading
import time
import warnings
import weakref

import pytest
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils.mpfuture import MPFuture

from p2p_diloco.swarm.search import Abandoned, cancel_search, hold_tasks, wait_for_step


def _step_seen_by_the_averager() -> tuple[StepControl, list[bool]]:
    """A step as ``averager.step(wait=False)`` returns it; the list gets, at the moment the averager would be woken
    (its cancel future resolved), whether the step reads as cancelled (the averager's next check)."""
    trigger, cancel = MPFuture(), MPFuture()  # first: hivemind's futures backend starts with a plain MPFuture
    now = time.time()
    control = StepControl(scheduled_time=now + 1, deadline=now + 30, allow_retries=False, weight=1.0, data_for_gather=b"")
    control.attach(trigger, cancel)
    seen: list[bool] = []
    wake = cancel.set_result

    def set_result(result: object) -> None:
        seen.append(control.cancelled())
        wake(result)

    cancel.set_result = set_result
    return control, seen


def test_the_step_reads_as_cancelled_when_the_averager_wakes():
    control, seen = _step_seen_by_the_averager()
    cancel_search(control)
    # hivemind's own control.cancel() resolves the cancel future first: seen would be [False]
    assert seen == [True]
    assert control.cancelled() and control._cancel.done()


def test_an_abandoned_search_cancels_its_step_that_way():
    control, seen = _step_seen_by_the_averager()
    control.stage = AveragingStage.LOOKING_FOR_GROUP
    with pytest.raises(Abandoned):
        wait_for_step(control, should_abort=lambda: True, poll_s=0.01)
    assert seen == [True] and control.cancelled()


def test_a_search_is_not_cancelled_once_its_all_reduce_began():
    control, seen = _step_seen_by_the_averager()
    control.stage = AveragingStage.RUNNING_ALLREDUCE
    asked = []
    finish = threading.Timer(0.2, MPFuture.set_result, args=(control, {"peer": b""}))  # the all-reduce's result
    finish.start()
    try:
        assert wait_for_step(control, should_abort=lambda: asked.append(1) or True, poll_s=0.01) == {"peer": b""}
    finally:
        finish.join()
    assert asked == [] and seen == [] and not control.cancelled()


def _orphan_survives_a_collection(hold: bool) -> bool:
    """A task whose only references are its own (it awaits a future nothing else refers to, as hivemind's tasks
    await a DHT call's MPFuture): whether it is still there after the garbage collector ran."""
    loop = asyncio.new_event_loop()
    try:
        if hold:
            hold_tasks(loop)
            hold_tasks(loop)  # idempotent

        async def orphan() -> None:
            await loop.create_future()

        async def main() -> weakref.ref:
            task = loop.create_task(orphan())
            await asyncio.sleep(0)  # the orphan now waits on its future
            return weakref.ref(task)

        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):  # "Task was destroyed but it is pending!"
            warnings.simplefilter("ignore")
            task = loop.run_until_complete(main())
            gc.collect()
            alive = task() is not None
            if alive:
                task().cancel()
                loop.run_until_complete(asyncio.sleep(0))
        return alive
    finally:
        loop.close()


def test_held_tasks_outlive_a_collection_that_destroys_unheld_ones():
    assert not _orphan_survives_a_collection(hold=False)  # what hivemind's loop does
    assert _orphan_survives_a_collection(hold=True)
