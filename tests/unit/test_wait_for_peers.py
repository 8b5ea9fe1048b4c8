"""run_edges.wait_for_peers reads the others' records afresh each time it looks (Link.refresh), not as of the beacon's
last period: the last peer up sees the others at once, and they must see it as soon, or it trains a round alone."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

from p2p_diloco.core.link import RoundView
from p2p_diloco.train.run_edges import wait_for_peers


class _Link:
    """Records that reached this peer's storage (``arrived``) count only once read (``refresh``), as a beacon's do."""

    def __init__(self, arrived: int):
        self.arrived, self.read, self.refreshes = arrived, 0, 0

    def refresh(self) -> None:
        self.refreshes += 1
        self.read = self.arrived

    def round_view(self, round_index: int) -> RoundView:
        return RoundView(live_peers=self.read, tokens_by_others=0, peers_ahead=0)


def _learner(wanted: int, wait_s: float) -> SimpleNamespace:
    run = SimpleNamespace(wait_for_peers=wanted, wait_for_peers_s=wait_s)
    return SimpleNamespace(config=SimpleNamespace(run=run), stop=threading.Event(), round_index=0, started=None)


def test_the_wait_reads_afresh_and_starts_as_soon_as_the_records_are_here(caplog):
    link, learner = _Link(arrived=2), _learner(wanted=3, wait_s=30.0)
    with caplog.at_level(logging.INFO, logger="p2p_diloco.train.run_edges"):
        wait_for_peers(learner, link)
    assert link.refreshes == 1 and learner.started is not None
    assert "3 peers in the swarm: starting" in caplog.text and "starting with them" not in caplog.text


def test_the_wait_ends_at_its_deadline_with_the_peers_there(caplog):
    link, learner = _Link(arrived=1), _learner(wanted=3, wait_s=0.3)
    with caplog.at_level(logging.INFO, logger="p2p_diloco.train.run_edges"):
        wait_for_peers(learner, link)
    assert link.refreshes >= 2  # one read per look
    assert "2 of the 3 peers awaited are in the swarm after 0 s: starting with them" in caplog.text


def test_one_peer_awaited_does_not_read_at_all():
    link, learner = _Link(arrived=0), _learner(wanted=1, wait_s=30.0)
    wait_for_peers(learner, link)
    assert link.refreshes == 0 and learner.started is not None
