"""The peer's stop request can be set by a signal handler at any point of its main thread (cli/peer.py, stop_event)."""

from __future__ import annotations

import threading

from p2p_diloco.cli.peer import stop_event


def _set_while_holding_its_lock(event: threading.Event, done: list[bool]) -> None:
    with event._cond:  # where a signal finds the main thread inside the first handler's set(), or inside wait()
        event.set()  # what the second handler does
    done.append(True)


def test_a_handler_s_set_returns_while_the_interrupted_code_holds_the_event_s_lock():
    for event, should_finish in ((stop_event(), True), (threading.Event(), False)):
        done: list[bool] = []
        thread = threading.Thread(target=_set_while_holding_its_lock, args=(event, done), daemon=True)
        thread.start()
        thread.join(timeout=2)
        # the stop event returns at once; threading.Event's own waits for itself (the hang seen in CI): the
        # daemon thread left blocked on a lock nobody else ever uses
        assert (done == [True]) is should_finish and event.is_set() is should_finish


def test_it_is_an_event_still():
    event = stop_event()
    assert not event.wait(0.01)
    threading.Timer(0.05, event.set).start()
    assert event.wait(5) and event.is_set()
    event.clear()
    assert not event.is_set()
