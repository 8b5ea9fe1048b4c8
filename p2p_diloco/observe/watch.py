"""What a person watching a swarm sees: each peer's latest progress and a short history, from progress records.

Peers publish a progress record in the DHT every period (swarm/progress.py). Besides what the rounds need (outer step,
round tokens, rate, sha256), the record carries ``stats``: a compact summary of the peer's last metrics record,
packed here by ``pack_stats`` and read back by ``unpack_stats`` (one list of small numbers instead of named
fields: every peer reads every record every second, so its size is background traffic).

``SwarmWatch`` polls a function returning ``{peer_id: record}`` (a training peer's own view of the swarm, or a
read-only monitor's DHT reads) from a daemon thread, and keeps per peer the latest values and the points of a
loss chart. ``snapshot()`` is what the terminal display and the web monitor show. Records come from strangers
in an open swarm: every value is checked and bounded here, and a malformed one is treated as missing.

This module knows nothing of hivemind, sockets or terminals.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

MAX_PEERS = 256  # peers tracked at most: records of an open swarm are anyone's, and memory must stay bounded
_MAX_COUNT = 2**53
_RATE_WINDOW_S = 30.0  # tokens/s is measured over the records of about the last 30 s


def pack_stats(record: dict) -> list:
    """A metrics record (learner.py) -> ``[outer_step, loss_milli, eval_loss_milli, group_size, bytes_sent,
    bytes_received]``: losses in thousandths as ints (3 bytes in msgpack instead of 9), bytes cumulative."""
    return [
        int(record["outer_step"]),
        _milli(record.get("loss")),
        _milli(record.get("eval_loss")),
        int(record.get("group_size") or 0),
        int(record.get("bytes_sent_total") or 0),
        int(record.get("bytes_received_total") or 0),
    ]


def unpack_stats(value: object) -> dict[str, Any] | None:
    """``pack_stats``'s list -> named values (None where a value is missing or malformed); None if not a list."""
    if not isinstance(value, list | tuple) or len(value) < 6:
        return None
    step, loss, eval_loss, group, sent, received = value[:6]
    return dict(
        stats_step=_count(step),
        loss=_from_milli(loss),
        eval_loss=_from_milli(eval_loss),
        group_size=_count(group),
        bytes_sent=_count(sent),
        bytes_received=_count(received),
    )


def _milli(loss: object) -> int | None:
    return round(1000 * loss) if isinstance(loss, int | float) and math.isfinite(loss) and abs(loss) < 1e6 else None


def _from_milli(value: object) -> float | None:
    count = _count(value, low=-(10**9))
    return None if count is None or abs(count) >= 10**9 else count / 1000


def _count(value: object, low: int = 0) -> int | None:
    """An integer in [low, 2**53], or None (bools, floats, strings and huge numbers are not counts)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and low <= value <= _MAX_COUNT else None


def _finite(value: object, high: float = 1e15) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= high:
        return float(value)
    return None


def short_id(peer_id: str) -> str:
    """The end of a peer id, enough to tell the peers of one swarm apart (the start is the same key type)."""
    return peer_id[-8:]


@dataclass
class PeerTrack:
    """What the watch remembers of one peer."""

    peer_id: str
    first_seen: float
    last_seen: float
    latest: dict[str, Any] = field(default_factory=dict)  # checked values of its latest record
    tokens_samples: deque = field(default_factory=lambda: deque(maxlen=64))  # (record time, tokens)
    # [unix time, outer step, loss, eval loss], one per metrics record, oldest first; thinned when full
    history: list = field(default_factory=list)
    last_stats: tuple | None = None
    eval_loss: float | None = None  # the last held-out loss it reported (not every record has one)


class SwarmWatch:
    """Polls ``read_records`` every ``period_s`` once started; ``snapshot()`` is safe from any thread."""

    def __init__(
        self,
        run_id: str,
        self_id: str | None = None,
        period_s: float = 1.0,
        history_points: int = 1000,
        forget_after_s: float = 600.0,
        clock: Callable[[], float] = time.time,
    ):
        self.run_id, self.self_id = run_id, self_id
        self._period_s, self._history_points, self._forget_after_s = period_s, history_points, forget_after_s
        self._clock = clock
        self._tracks: dict[str, PeerTrack] = {}
        self._live: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._read: Callable[[], dict[str, dict]] | None = None

    def start(self, read_records: Callable[[], dict[str, dict]], self_id: str | None = None) -> None:
        """Begin polling ``read_records`` (``{peer_id: progress record}``) from a daemon thread."""
        self._read, self.self_id = read_records, self_id or self.self_id
        self._thread = threading.Thread(target=self._loop, name="swarm-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                assert self._read is not None
                self.observe(self._read())
            except Exception as e:  # a watcher must never take the peer down: skip this poll
                logger.debug("watching the swarm failed: %r", e)
            self._stop.wait(self._period_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._period_s + 1)

    def observe(self, records: dict[str, dict]) -> None:
        """Take in one read of the swarm's progress records (public for tests and for one-shot readers)."""
        now = self._clock()
        with self._lock:
            self._live = set()
            for peer_id, record in list(records.items())[: 4 * MAX_PEERS]:
                if isinstance(peer_id, str) and isinstance(record, dict) and 0 < len(peer_id) <= 128:
                    self._observe_one(peer_id, record, now)
            for peer_id in [p for p, t in self._tracks.items() if now - t.last_seen > self._forget_after_s]:
                del self._tracks[peer_id]

    def _new_track(self, peer_id: str, now: float) -> PeerTrack:
        return PeerTrack(peer_id, first_seen=now, last_seen=now)

    def _observe_one(self, peer_id: str, record: dict, now: float) -> None:
        track = self._tracks.get(peer_id)
        if track is None:
            if len(self._tracks) >= MAX_PEERS:
                return
            track = self._tracks[peer_id] = self._new_track(peer_id, now)
        track.last_seen = now
        self._live.add(peer_id)
        sha = record.get("global_sha256")
        latest = dict(
            outer_step=_count(record.get("outer_step")),
            round_tokens=_count(record.get("round_tokens")),
            tokens=_count(record.get("tokens")),
            rate=_finite(record.get("rate")),
            global_sha256=sha[:64] if isinstance(sha, str) else None,
        )
        record_time = _finite(record.get("time"), high=1e11)
        latest["age_s"] = round(max(0.0, now - record_time), 1) if record_time is not None else None
        stats = unpack_stats(record.get("stats"))
        latest.update(stats or {})
        tokens = latest["tokens"]
        if tokens is not None and record_time is not None:
            samples = track.tokens_samples
            if samples and (tokens < samples[-1][1] or record_time < samples[-1][0]):
                samples.clear()  # a restarted peer counts from its checkpoint again
            if not samples or record_time > samples[-1][0]:
                samples.append((record_time, tokens))
        if stats is not None:
            self._add_point(track, stats, now)
        track.latest = latest

    def _add_point(self, track: PeerTrack, stats: dict[str, Any], now: float) -> None:
        """One more point of the chart if ``stats`` summarise a metrics record not seen yet. A full history keeps
        every other point (the latest always): the chart spans the whole run at half the resolution."""
        if stats["eval_loss"] is not None:
            track.eval_loss = stats["eval_loss"]
        key = tuple(stats.values())
        if key != track.last_stats:
            track.last_stats = key
            track.history.append([round(now, 3), stats["stats_step"], stats["loss"], stats["eval_loss"]])
            if len(track.history) > self._history_points:
                track.history = track.history[(len(track.history) - 1) % 2 :: 2]

    def write(self, record: dict) -> None:
        """This peer's own metrics records (the watch is a metrics sink too): its chart gets every one of them,
        also when two come within one poll, as the others' records are only sampled every period."""
        if self.self_id is None:
            self.self_id = str(record.get("peer_id"))
        now = self._clock()
        with self._lock:
            track = self._tracks.get(self.self_id)
            if track is None:
                track = self._tracks[self.self_id] = self._new_track(self.self_id, now)
            stats = unpack_stats(pack_stats(record))
            assert stats is not None
            self._add_point(track, stats, now)

    def _tokens_per_s(self, track: PeerTrack) -> float | None:
        samples = [s for s in track.tokens_samples if s[0] >= track.tokens_samples[-1][0] - _RATE_WINDOW_S] \
            if track.tokens_samples else []
        if len(samples) >= 2 and samples[-1][0] > samples[0][0]:
            return (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])
        return track.latest.get("rate")

    def snapshot(self, since: float = 0.0) -> dict[str, Any]:
        """The swarm as JSON-able values: peers (this one first, then by first sight) with their chart points
        newer than ``since`` (unix time), and swarm-wide figures."""
        now = self._clock()
        with self._lock:
            tracks = sorted(self._tracks.values(), key=lambda t: (t.peer_id != self.self_id, t.first_seen, t.peer_id))
            peers = [self._describe(track, now, since) for track in tracks]
        live = [p for p in peers if p["live"]]
        steps = [p["outer_step"] for p in live if p["outer_step"] is not None]
        shas_by_step: dict[int, list[str]] = {}
        for p in live:
            if p["outer_step"] is not None and p["global_sha256"]:
                shas_by_step.setdefault(p["outer_step"], []).append(p["global_sha256"])
        shared = [set(shas) for shas in shas_by_step.values() if len(shas) >= 2]
        return dict(
            run_id=self.run_id,
            self_id=self.self_id,
            time=round(now, 3),
            swarm=dict(
                live_peers=len(live),
                outer_step=max(steps, default=None),
                tokens_per_s=round(sum(p["tokens_per_s"] or 0.0 for p in live), 1),
                tokens=sum(p["tokens"] or 0 for p in live),
                # do live peers at the same outer step hold the same global params? (invariant 1; None: no two
                # peers are at one step now)
                agree=all(len(shas) == 1 for shas in shared) if shared else None,
            ),
            peers=peers,
        )

    def _describe(self, track: PeerTrack, now: float, since: float) -> dict[str, Any]:
        rate = self._tokens_per_s(track)
        return dict(
            track.latest,
            peer_id=track.peer_id,
            short_id=short_id(track.peer_id),
            is_self=track.peer_id == self.self_id,
            live=track.peer_id in self._live,
            seen_s_ago=round(now - track.last_seen, 1),  # when the watch last found its record
            tokens_per_s=round(rate, 1) if rate is not None else None,
            eval_loss=track.eval_loss,
            history_points=len(track.history),
            history=_points_after(track.history, since),
        )


def _points_after(history: list, since: float) -> list:
    """The points newer than ``since`` (history is oldest first): a page's poll costs what is new, not all."""
    if not history or since < history[0][0]:
        return list(history)
    start = len(history)
    while start > 0 and history[start - 1][0] > since:
        start -= 1
    return history[start:]
