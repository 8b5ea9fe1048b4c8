"""Progress records: how a peer tells the swarm where it is (outer step, state sha256, round, tokens, rate) and learns
where the others are, through the run's DHT key.

``ProgressBeacon`` publishes this peer's record and reads the others' from a daemon thread, every period its pace
gives (core/swarm_view.py ``ProgressPace``), so the training loop never waits on the DHT. Records go as DHT stores,
or (``--progress-transport push``) straight to the peers this node knows, read from what they pushed
(``ProgressReader``), with a DHT store and read every ``DHT_EVERY``-th time. What records *mean* is decided in
core/swarm_view.py and core/history.py; this module only moves them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from p2p_diloco.core.swarm_view import PLAN_FIELDS, well_formed
from p2p_diloco.swarm.hivemind_api import CALL_FAILED
from p2p_diloco.swarm.processes import lower_this_thread

logger = logging.getLogger(__name__)
_DHT_TIMEOUT_S = 10.0
# with the push transport, every this many periods a record also goes the DHT's way and a read asks the DHT: peers
# not yet known (and those that know nobody who knows us) show up, and the key's nearest nodes, which a client-mode
# peer reads from, hold every record
DHT_EVERY = 10
_FORGET_EXPIRED_S = 60.0  # how long after a record expired a reader still knows it did
_PUSH_LIMIT = 64  # a record is pushed to at most this many known peers (the nearest to the key first)
INTRODUCE_LIMIT = 8  # peers pinged per DHT read at most (chosen at random: anyone can write records under any id)
_INTRODUCE_AGAIN_S = 60.0  # a peer pinged is not pinged again for this long


def read_progress(dht: DHT, key: str, timeout_s: float = _DHT_TIMEOUT_S, local: bool = False) -> dict[str, dict]:
    """The unexpired progress records under ``key`` of peers that have not said they left (a record with
    ``left``), by peer id; raises on a DHT failure or after ``timeout_s``. ``local``: what this node holds (its
    own record and those stored or pushed to it), with no request on the network once it has published one."""
    return {peer: record for peer, (record, _) in read_progress_items(dht, key, timeout_s, local).items()}


def read_progress_items(
    dht: DHT, key: str, timeout_s: float = _DHT_TIMEOUT_S, local: bool = False
) -> dict[str, tuple[dict, float]]:
    """``read_progress``, each record with its expiration time (DHT time)."""
    found = dht.get(key, latest=not local, return_future=True).result(timeout=timeout_s)
    peers = {}
    if found is not None and isinstance(found.value, dict):
        for peer, item in found.value.items():
            if isinstance(item, ValueWithExpiration) and well_formed(item.value) and not item.value.get("left"):
                peers[str(peer)] = (item.value, float(item.expiration_time))
    return peers


async def push_record(dht: DHT, node: DHTNode, key: str, subkey: str, value: dict, expiration_time: float) -> int:
    """Store a progress record in this node's storage and send it straight to the peers in its routing table, one
    store request each (at most ``_PUSH_LIMIT``, the nearest to the key first); the number of peers that took it.
    Runs in the DHT's process (``run_coroutine``).

    What a DHT store does, less its search: hivemind's ``store`` first asks the nearest nodes for the key, and each
    answers with the whole dictionary of records (every peer's, signed) and a list of its neighbours; then it stores.
    Each receiver checks the record as a DHT store (the run's validators: signature, membership) and keeps it in its
    storage, where a local read finds it."""
    protocol = node.protocol
    key_id = DHTID.generate(source=key)
    value_bytes = protocol.serializer.dumps(value)
    record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), value_bytes, expiration_time)
    if protocol.record_validator is not None:
        value_bytes = protocol.record_validator.sign_value(record)
        record = dataclasses.replace(record, value=value_bytes)
        if not protocol.record_validator.validate(record):
            return 0
    protocol.storage.store(key_id, value_bytes, expiration_time, subkey=subkey)
    peers = [peer for _, peer in protocol.routing_table.get_nearest_neighbors(key_id, _PUSH_LIMIT, exclude=node.node_id)]
    # each request is bounded by the DHT's own timeout, and a peer that does not answer is marked as such in the
    # routing table (a dead one leaves it), as after any DHT request
    stores = (protocol.call_store(peer, [key_id], [value_bytes], [expiration_time], subkeys=[subkey]) for peer in peers)
    answers = await asyncio.gather(*stores, return_exceptions=True)
    # an answer: store_ok per record (protobuf's repeated field), or None if the peer did not answer
    return sum(answer is not None and not isinstance(answer, BaseException) and all(answer) for answer in answers)


async def introduce(dht: DHT, node: DHTNode, peer_ids: Sequence[str]) -> int:
    """Ping each peer (a validated ping: the callee adds us to its routing table once it has reached us in turn, and
    we add it once it answers); the number that answered. Runs in the DHT's process (``run_coroutine``)."""
    peers = []
    for name in peer_ids:
        try:
            peers.append(PeerID.from_base58(name))
        except Exception:  # a record under a subkey that is no peer id
            continue
    pings = (node.protocol.call_ping(peer, validate=True, strict=False) for peer in peers)
    answers = await asyncio.gather(*pings, return_exceptions=True)
    return sum(answer is not None and not isinstance(answer, BaseException) for answer in answers)


async def _rejoin(dht: DHT, node: DHTNode, peer_ids: Sequence[str], bootstrap: Sequence[str], timeout_s: float) -> int:
    """Ping peers this node once knew so that its routing table and theirs hold each other again; the number that
    answered. Runs in the DHT's process (``run_coroutine`` pickles it: a module-level function, plain arguments).

    A node drops from its routing table every peer whose request timed out, and they drop it likewise. A peer
    frozen for a few seconds (a stopped process, a suspended laptop, a network that went away) finds on waking
    that every request in flight timed out at once: its table is empty, the others' lack it, and nothing in
    hivemind ever brings them together again. An incoming ping adds the caller to the callee's table, and an
    answered one adds the callee to the caller's: one round of pings heals both sides.
    """
    for address in bootstrap:  # the initial peers' addresses, for a peerstore that forgot them
        try:
            maddr = Multiaddr(address)
            peer = PeerID.from_base58(maddr["p2p"])
            # p2pd wants the transport part alone: the python Multiaddr re-encodes some peer ids in a form it refuses
            transport = Multiaddr(address.split("/p2p/")[0])
            await asyncio.wait_for(node.p2p._client.connect(peer, [transport]), timeout_s)
        except Exception as e:
            logger.debug("could not reconnect to %s: %r", address, e)
    peers = {PeerID.from_base58(peer) for peer in peer_ids}
    peers |= {PeerID.from_base58(Multiaddr(address)["p2p"]) for address in bootstrap}
    peers.discard(node.protocol.p2p.peer_id)
    node.blacklist.clear()  # peers that timed out while we were away are not to be skipped now that we are back
    # validate, as hivemind's own bootstrap does: the callee adds us only once it has reached us in turn
    pings = (node.protocol.call_ping(peer, validate=True, strict=False) for peer in peers)
    answers = await asyncio.gather(*(asyncio.wait_for(ping, timeout_s) for ping in pings), return_exceptions=True)
    return sum(answer is not None and not isinstance(answer, BaseException) for answer in answers)


class ProgressBeacon:
    """Every ``period_s``, from a daemon thread: reads the other peers' progress records and publishes this
    peer's latest one in the DHT, so the training loop never waits on the DHT to know where the swarm is.
    ``pace``, if given, is asked for the next period after each read (``SwarmLink._pace``); every record says
    the period it was published under (``period``), so that readers extrapolate it as far as it may be stale.
    ``wake`` ends the current wait at once (a new round, a nearer end, an averaging that starts).

    When the read finds nobody else although peers were seen before (or initial peers were given), the beacon
    pings them (``_rejoin``), at most once per ``rejoin_every_s``: a DHT that lost its routing table reconnects.

    ``push``: a record goes straight to the peers this node knows (``push_record``), and the first one and at the
    latest every ``DHT_EVERY``-th one after the last stored with a DHT store; otherwise every record is a DHT store.
    """

    def __init__(
        self,
        dht: DHT,
        key: str,
        period_s: float,
        ttl_s: float,
        read_peers: Callable[[], dict[str, dict]],
        bootstrap: Sequence[str] = (),
        pace: Callable[[], float] | None = None,
        push: bool = False,
        nice: int = 0,
    ):
        self._dht, self._key, self._period_s, self._ttl_s = dht, key, period_s, ttl_s
        self._nice = nice  # lowers this beacon's thread (swarm/processes.py)
        self._push = push
        # records published since the last that went the DHT's way, that one counted (the first goes that way), and
        # when that was
        self._since_dht_store = DHT_EVERY
        self._last_dht_store = -math.inf  # monotonic
        self._read_peers, self._pace = read_peers, pace
        self.peers: dict[str, dict] = {}  # the other peers' records as of the last period (read by the learner)
        self._bootstrap = list(bootstrap)
        self._seen: dict[str, float] = {}  # peer id -> when (monotonic) its record was last read: whom to re-ping
        self._last_rejoin = float("-inf")
        self._alone = False
        self.rejoins = 0  # how many times the beacon found itself alone and pinged the peers it knew
        self._record: dict = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set to end the current wait early (stop, or the pace may have changed)
        self._idled = False  # the pace went idle at least once (said once at INFO)
        self._thread = threading.Thread(target=self._loop, name="progress-beacon", daemon=True)
        self._thread.start()

    def update(self, **fields: object) -> None:
        with self._lock:
            self._record.update(fields)

    def set(self, **fields: object) -> None:
        """Set fields of this peer's record. A record's ``time`` dates its tokens: fields that only plan the round
        (``PLAN_FIELDS``) keep it; any other update renews it. A new round or a nearer end wakes the beacon at once:
        the idle wait must not hide it for seconds."""
        before = self.own_record()
        if set(fields) <= PLAN_FIELDS:
            self.update(**fields)
        else:
            self.update(**fields, time=get_dht_time())
        if any(name in fields and fields[name] != before.get(name) for name in ("round", *PLAN_FIELDS)):
            self.wake()

    def own_record(self) -> dict:
        with self._lock:
            return dict(self._record)

    def read_now(self) -> None:
        """Read the others' records now rather than at the end of the current period: a start that waits for the
        swarm sees a peer as soon as its first record reaches us, not up to a period later (run_edges.wait_for_peers)."""
        try:
            self.peers = self._read_peers()
        except CALL_FAILED as e:
            logger.debug("reading progress failed: %r", e)

    def publish_now(self, dht_store: bool = False) -> Future | None:
        """Publish this peer's record now: pushed, or stored in the DHT (``dht_store``, no ``push``, at the latest
        the ``DHT_EVERY``-th record after the last stored, and often enough that the key's nearest nodes always hold
        an unexpired copy). The future says how many peers took it (push) or whether the store went."""
        record = self.own_record()
        if not record:
            return None
        # both bounds count from the last store: counted from the start, the two fell apart and stored twice as often
        # as either asks (docs/benchmarks.md, "Fewer DHT requests")
        due = self._since_dht_store >= DHT_EVERY or time.monotonic() - self._last_dht_store >= 0.75 * self._ttl_s
        self._since_dht_store += 1
        return self._send(record, dht_store or not self._push or due)

    def _send(self, record: dict, dht_store: bool) -> Future:
        subkey, expiration_time = self._dht.peer_id.to_base58(), get_dht_time() + self._ttl_s
        if dht_store:
            self._last_dht_store = time.monotonic()
            self._since_dht_store = 1
            return self._dht.store(self._key, subkey=subkey, value=record, expiration_time=expiration_time, return_future=True)
        push = partial(push_record, key=self._key, subkey=subkey, value=record, expiration_time=expiration_time)
        return self._dht.run_coroutine(push, return_future=True)

    def wake(self) -> None:
        """Publish and read now rather than at the end of the current wait (which may be an idle period)."""
        self._wake.set()

    def _loop(self) -> None:
        lower_this_thread(self._nice)
        period_s = self._period_s
        while True:
            self._wake.wait(period_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.peers = self._read_peers()
                self._remember_or_rejoin()
            except CALL_FAILED as e:  # a DHT hiccup must not kill the beacon
                logger.debug("reading progress failed: %r", e)
            period_s = self._next_period(period_s)
            try:
                self.publish_now()
            except CALL_FAILED as e:
                logger.debug("publishing progress failed: %r", e)

    def _next_period(self, period_s: float) -> float:
        if self._pace is None:
            return self._period_s
        try:
            paced_s = self._pace()
        except Exception as e:  # a bug or a record nobody foresaw: never stop publishing over it
            logger.debug("pacing failed: %r", e)
            paced_s = self._period_s
        if paced_s != period_s:
            first = paced_s > self._period_s and not self._idled
            self._idled = self._idled or paced_s > self._period_s
            (logger.info if first else logger.debug)(
                "progress records every %.1f s from now%s", paced_s, " (while a round's end is far)" if first else ""
            )
        self.update(period=paced_s)  # before publishing: the next record is at most this old
        return paced_s

    def _remember_or_rejoin(self) -> None:
        now = time.monotonic()
        for peer in self.peers:
            self._seen[peer] = now
        if self.peers:
            self._alone = False
        forget_after_s = 30 * self._ttl_s  # a peer gone this long is not worth a ping every few seconds
        self._seen = {peer: seen for peer, seen in self._seen.items() if now - seen < forget_after_s}
        rejoin_every_s = max(5.0, 2 * self._period_s)
        if self.peers or not (self._seen or self._bootstrap) or now - self._last_rejoin < rejoin_every_s:
            return
        self._last_rejoin = now
        self.rejoins += 1
        log = logger.debug if self._alone else logger.info  # said once each time the others vanish, not every try
        self._alone = True
        log("no other peer visible in the DHT: pinging the %d peers known before", len(self._seen) + len(self._bootstrap))
        coroutine = partial(_rejoin, peer_ids=sorted(self._seen), bootstrap=self._bootstrap, timeout_s=rejoin_every_s)
        future = self._dht.run_coroutine(coroutine, return_future=True)
        future.add_done_callback(_log_rejoin)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2 * self._period_s)

    def leave(self) -> None:
        """Close, then publish a last record that says this peer left: the others stop counting it at once (in
        a round's budget, a group's expected size, the peers a finishing peer waits for), not when it expires."""
        self.close()
        self.update(left=True, time=get_dht_time())
        deadline = time.monotonic() + 2.0
        try:  # both ways at once: the peers this one knows (first: most read only what reached them) and the
            # key's nearest nodes (read by clients and joiners); 2 s for both
            record = self.own_record()
            futures = [*([self._send(record, dht_store=False)] if self._push else []), self._send(record, dht_store=True)]
        except Exception as e:  # leaving anyway: the record expires by itself
            logger.debug("could not publish the departure: %r", e)
            return
        for future in futures:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:
                logger.debug("could not publish the departure: %r", e)


class ProgressReader:
    """Reads the other peers' progress records (``read_progress``, this node's own left out).

    With ``push``: the records pushed to this node, read locally. A read asks the DHT instead the first time and
    every ``DHT_EVERY``-th time after, and whenever the local read finds nobody else or lacks a peer the last read had (one
    that did not say it left: pushes between it and us may have stopped, the DHT's other nodes may still hold it).
    A peer found in the DHT whose record was not renewed here since the last DHT read does not push to us (it does
    not know us: a joiner, a routing table that dropped us, a swarm too large for every table to hold everyone):
    it gets a ping, which puts each in the other's routing table, so that its records reach us and ours reach it.

    A DHT read also leaves what it found in this node's storage (hivemind merges the answers into the stored
    dictionary), so renewals are counted only between two local reads."""

    def __init__(self, dht: DHT, key: str, push: bool):
        self._dht, self._key, self._push = dht, key, push
        self._own = dht.peer_id.to_base58()
        # local reads since the last DHT read (two threads read: a miscount is harmless). The first read asks the DHT:
        # what was pushed to a joiner so far is whoever pushed first, perhaps a lone liar (core/history.py)
        self._local_reads = DHT_EVERY - 1
        self._seen: frozenset[str] = frozenset()  # the peers the last read returned
        self._renewed: set[str] = set()  # peers whose record was renewed here between local reads since the last DHT read
        self._introduced: dict[str, float] = {}  # peer -> when (monotonic) it was last pinged
        self.introductions = 0  # peers pinged because they did not push to us
        # peer -> (its record's latest expiration, when (monotonic, ours) a read first saw that one): a record renewed
        # carries a later expiration, so a peer's silence is timed on our clock, not on its (and who pushes to us,
        # from the renewals between two local reads)
        self._renewal: dict[str, tuple[float, float]] = {}
        self._last_read = -math.inf  # when (monotonic) the latest read that answered was made
        # peer -> the latest expiration (DHT time) a read found for its record, kept after the record is gone: a peer
        # whose record expired is gone, not missed by a partial read (``expired``)
        self._expires: dict[str, float] = {}
        self._renewal_lock = threading.Lock()  # two threads read (the beacon's and a round's)

    def silent_s(self, peer: str) -> float:
        """How long ``peer``'s record had gone unrenewed as of our latest read that answered (0 for a peer not read
        yet). As of that read, not now: a read of ours that stalls or fails makes nobody look silent."""
        seen = self._renewal.get(peer)
        return 0.0 if seen is None else max(0.0, self._last_read - seen[1])

    def expired(self, peer: str) -> bool:
        """Whether the latest record of ``peer`` a read found has expired by now (DHT time, as the DHT drops it): a
        read that lacks it for that reason is no partial read (SwarmView.target's ``gone``)."""
        expiration = self._expires.get(peer)
        return expiration is not None and expiration <= get_dht_time()

    def _note_renewals(self, items: dict[str, tuple[dict, float]]) -> set[str]:
        """Note this read's expirations; the peers whose record it found renewed since an earlier read."""
        with self._renewal_lock:
            dht_now = get_dht_time()
            expires = {peer: at for peer, at in self._expires.items() if at > dht_now - _FORGET_EXPIRED_S}
            for peer, (_, expiration) in items.items():
                expires[peer] = max(expiration, expires.get(peer, -math.inf))
            self._expires = expires
            now, before = time.monotonic(), self._renewal
            renewal, renewed = {}, set()
            for peer, (_, expiration) in items.items():
                seen = before.get(peer)
                if seen is not None and expiration <= seen[0]:
                    renewal[peer] = seen
                else:
                    renewal[peer] = (expiration, now)
                    if seen is not None:
                        renewed.add(peer)
            self._renewal, self._last_read = renewal, now
        return renewed

    def __call__(self) -> dict[str, dict]:
        if self._push and self._local_reads < DHT_EVERY - 1:
            items = read_progress_items(self._dht, self._key, local=True)
            items.pop(self._own, None)
            renewed = self._note_renewals(items)
            if self._local_reads > 0:  # the read before was local too: a renewal in between was pushed to us
                self._renewed |= renewed
            self._local_reads += 1
            if items and self._seen <= items.keys():
                self._seen = frozenset(items)
                return {peer: record for peer, (record, _) in items.items()}
        self._local_reads = 0
        items = read_progress_items(self._dht, self._key)
        items.pop(self._own, None)
        self._note_renewals(items)
        if self._push:
            self._introduce(items)
            self._renewed = set()
        self._seen = frozenset(items)
        return {peer: record for peer, (record, _) in items.items()}

    def _introduce(self, items: dict[str, tuple[dict, float]]) -> None:
        # a client-mode peer can't be dialled; anyone can write a record under any id: a few at random, not again soon
        now = time.monotonic()
        self._introduced = {peer: at for peer, at in self._introduced.items() if now - at < _INTRODUCE_AGAIN_S}
        strangers = [peer for peer, (record, _) in items.items()
                     if peer not in self._renewed and peer not in self._introduced and not record.get("client")]
        if not strangers:
            return
        chosen = random.sample(strangers, min(len(strangers), INTRODUCE_LIMIT))
        self._introduced.update(dict.fromkeys(chosen, now))
        self.introductions += len(chosen)
        self._dht.run_coroutine(partial(introduce, peer_ids=chosen), return_future=True)


def _log_rejoin(future: Future) -> None:
    try:
        answered = future.result()
        (logger.info if answered else logger.debug)("rejoin: %d known peers answered a ping", answered)
    except Exception as e:
        logger.debug("rejoin failed: %r", e)
