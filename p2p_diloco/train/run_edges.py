"""The edges of a run, before the first inner step and after the last: waiting for the agreed start and for the
peers launched together, letting the averaging in flight land, checking the last step against the groupmates', and
serving state to stragglers. A part of the learner (train/learner.py), kept out of its loop."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from p2p_diloco.core.link import Link

if TYPE_CHECKING:
    from p2p_diloco.train.learner import Learner

logger = logging.getLogger(__name__)


def wait_for_start(learner: Learner) -> None:
    wait_s = learner.config.run.start_at_unix - time.time()
    if wait_s > 0:  # peers launched together begin together (a benchmark's swarms, a planned start)
        logger.info("waiting %.0f s for the agreed start time", wait_s)
        learner.stop.wait(wait_s)


def wait_for_peers(learner: Learner, link: Link) -> None:
    """Before the first inner step, wait (bounded by ``wait_for_peers_s``) until ``wait_for_peers`` peers, this
    one included, are in the swarm: peers launched together then train together from the first round, instead
    of the first one up averaging alone (and perhaps finishing) before the others have imported torch. The
    clocks of ``max_time_s`` and tokens/s start after the wait."""
    wanted, run = learner.config.run.wait_for_peers, learner.config.run
    deadline = time.monotonic() + run.wait_for_peers_s
    present = 1
    while wanted > 1 and not learner.stop.is_set():
        # read the records now, not as of the beacon's last period: the last peer up sees the others at once, and
        # they must see it as soon too, or it trains a round's worth alone first (a small model, a 2 s period)
        link.refresh()
        present = 1 + link.round_view(learner.round_index).live_peers
        if present >= wanted:
            logger.info("%d peers in the swarm: starting", present)
            break
        if time.monotonic() >= deadline:
            logger.warning("%d of the %d peers awaited are in the swarm after %.0f s: starting with them", present,
                           wanted, run.wait_for_peers_s)
            break
        learner.stop.wait(0.2)
    learner.started = time.monotonic()


def settle_pending(learner: Learner, link: Link) -> None:
    """At the end of a run, give an averaging still in flight a bounded time to land, so that its result
    is applied and recorded (and checkpointed) rather than lost; past that, it is abandoned."""
    if learner.pending is None:
        return
    started = time.monotonic()
    wait_s = learner.config.run.shutdown_wait_s
    try:
        learner.pending.future.result(timeout=wait_s)
    except TimeoutError:
        logger.warning("abandoning the averaging of outer step %d after %.0f s", learner.pending.outer_step, wait_s)
        learner.pending = None
        return
    finally:
        learner.add_blocked(time.monotonic() - started)
    learner.complete_averaging(link)


def confirm_last_step(learner: Learner, link: Link) -> None:
    """At the planned end, wait a moment (a few progress periods at most) for the groupmates of our last round to
    report the step it made, and heal a fork there as at any round's end: the last step is checked like the
    others, so that no peer leaves with other bytes than its group's (and none goes unsaid)."""
    run = learner.config.run
    groupmates = set(learner.round_history.get(learner.outer_step - 1, ())) - {link.peer_id}
    if not (run.max_outer_steps and learner.outer_step >= run.max_outer_steps and groupmates) or learner.stop.is_set():
        return
    deadline = time.monotonic() + max(3.0, 3 * learner.config.swarm.progress_period_s)
    while groupmates - set(link.reported_sha256(learner.outer_step)) and time.monotonic() < deadline:
        if learner.stop.wait(0.2):
            return
    learner.catch_up(link)


def _to_serve(learner: Learner, link: Link) -> int:
    """Live peers behind our outer step, and the groupmates of our last round that report other bytes for it."""
    step = learner.outer_step
    groupmates = set(learner.round_history.get(step - 1, ())) - {link.peer_id}
    forked = sum(sha != learner.global_sha256 for peer, sha in link.reported_sha256(step).items() if peer in groupmates)
    return link.peers_behind(step) + forked


def serve_stragglers(learner: Learner, link: Link) -> None:
    """At the planned end (max_outer_steps reached, no stop request), stay a bounded while as a state donor
    for live peers still behind: one whose last round failed where the others' succeeded can then catch up
    to the final state, instead of finding no donor and stepping alone onto other bytes (a fork at the
    last step). So too for a groupmate of our last round that reports other bytes for it (its hardware computed
    the step differently, docs/design.md §5): it heals by downloading the step, and needs a donor; without one
    it left on its own bytes (a CI failure). The other ranks of an island have already left; the averager serves
    state by itself."""
    run = learner.config.run
    planned_end = bool(run.max_outer_steps) and learner.outer_step >= run.max_outer_steps
    if not run.straggler_wait_s or not planned_end or learner.stop.is_set():
        return
    started = time.monotonic()
    said = False  # peers finishing the same step show as behind until their next record: said only if it lasts
    behind = _to_serve(learner, link)
    while behind and time.monotonic() - started < run.straggler_wait_s and not learner.stop.wait(0.5):
        behind = _to_serve(learner, link)  # SIGTERM (learner.stop) ends the wait at once
        if behind and not said and time.monotonic() - started >= 3.0:
            logger.info("serving state up to %.0f s to %d peers behind outer step %d", run.straggler_wait_s, behind, learner.outer_step)
            said = True
    if behind:
        logger.info("leaving with %d peers still behind outer step %d", behind, learner.outer_step)
    elif said:
        logger.info("the peers behind reached outer step %d after %.1f s", learner.outer_step, time.monotonic() - started)
