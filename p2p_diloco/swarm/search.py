"""A search for a group in hivemind's averager: abandoned cleanly, and its tasks kept alive (docs/design.md §6).

``wait_for_step`` waits for a background ``averager.step`` and abandons its search when the swarm moved on;
``cancel_search`` cancels it so that the averager process sees it cancelled; ``hold_tasks`` keeps every task of the
averager's event loop referenced until it ends, so that the garbage collector cannot end an abandoned search's
clean-up half-way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from hivemind.averaging.control import AveragingStage
from hivemind.utils.mpfuture import MPFuture


class Abandoned(Exception):
    """The search for a group was cancelled because ``should_abort`` said so."""


class AveragerGone(Exception):
    """The averager process ended while a step of it was in flight."""


def wait_for_step(control: Any, should_abort: Callable[[], bool] | None, poll_s: float = 0.5,
                  alive: Callable[[], bool] | None = None) -> Any:
    """The result of a background ``averager.step``; while it is still looking for a group, poll
    ``should_abort`` and cancel the search if it says so (an all-reduce that began is never cancelled).
    ``alive``: whether the averager process still runs; a step of a dead averager never ends (a Ctrl-C that
    reached the peer's whole process group): AveragerGone."""
    while True:
        try:
            return control.result(timeout=poll_s)
        except TimeoutError:
            pass
        if alive is not None and not alive():
            raise AveragerGone()
        if should_abort is not None and control.stage == AveragingStage.LOOKING_FOR_GROUP and should_abort():
            # if a group formed between the check and the cancel, the averager either runs its all-reduce (the
            # others may apply our outer gradient while we report "stale": the learner's round history settles
            # that) or drops the group (the others' round fails or is partial, and they catch up)
            cancel_search(control)
            raise Abandoned()


def cancel_search(control: Any) -> None:
    """Cancel a background ``averager.step`` so that the averager process sees it cancelled.

    hivemind's ``StepControl.cancel()`` first wakes the averager (its cancel future) and only then marks the step
    cancelled in shared memory. An averager woken in between reads the step as not cancelled and searches on
    with it until the step's deadline (``averaging_timeout_s``): the next outer steps' searches wait behind it
    ("Another look_for_group is already in progress"), and once the group key moved on, its requests carry the
    old step and are refused. A reproduction's debug logs showed a cancelled search still sending requests 2.5 s
    after the cancel; in CI a late joiner went stale 11 rounds in a row, most likely that way. Mark, then wake."""
    MPFuture.cancel(control)  # the shared state the averager reads (we are the step's origin process)
    control.cancel()  # the trigger and the cancel future; the state is already cancelled


_HELD_TASKS: set[asyncio.Task] = set()


def hold_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Keep every task ``loop`` creates from now on referenced until it ends (docs/design.md §6).

    hivemind's averager awaits MPFutures (its DHT calls), which hivemind registers only weakly, and it cancels a
    search's matchmaking task without awaiting its clean-up, which itself awaits a DHT call (the averager's
    withdrawal from the step's key). From then on nothing outside the tasks refers to them: a collection of the
    garbage collector in that moment destroys them mid-clean-up, and the matchmaking they held stays locked for
    good. A late joiner in CI went ``stale`` 53 rounds in a row that way ("Task was destroyed but it is pending!" in
    its log, right after a search it abandoned). Idempotent; keeps a task factory already installed."""
    previous = loop.get_task_factory()
    if getattr(previous, "holds_tasks", False):
        return

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future:
        task = previous(loop, coro, **kwargs) if previous is not None else asyncio.Task(coro, loop=loop, **kwargs)
        hold(task)
        return task

    factory.holds_tasks = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)


def hold(task: asyncio.Future) -> None:
    """Keep ``task`` referenced until it ends."""
    _HELD_TASKS.add(task)
    task.add_done_callback(_HELD_TASKS.discard)
