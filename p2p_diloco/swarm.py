"""The swarm as one peer sees it: a hivemind DHT, progress records, averaging and state download.

``SwarmLink`` is what the learner talks to. It owns the DHT and the averager, publishes this peer's
progress (outer step, global params' sha256, tokens) under the run's DHT key from a background thread (pushed
straight to the peers it knows with ``--progress-transport push``: ``ProgressBeacon``, ``ProgressReader``), reads
the others', averages outer gradients with the peers at the same outer step, and downloads and
verifies state from a peer that is ahead. It does not train, and it holds no policy about what a failed
round means: it reports what happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from p2p_diloco import history
from p2p_diloco.averaging import WireCodec, part_norms_of, part_values_for, run_averaging
from p2p_diloco.compression import ErrorFeedback, make_codec
from p2p_diloco.config import SwarmConfig
from p2p_diloco.guarded import GuardedAllReduceRunner, GuardedAverager
from p2p_diloco.joining import SwarmStartError, first_line, join_swarm, start_dht  # noqa: F401 (re-exported)
from p2p_diloco.link import AveragingOutcome, RoundView, SwarmState, codec_round_trip
from p2p_diloco.membership import RunMembership
from p2p_diloco.outer import state_sha256
from p2p_diloco.robust import TokenLedger, banned_by_majority
from p2p_diloco.verify import state_problem

logger = logging.getLogger(__name__)
_DHT_TIMEOUT_S = 10.0
_NEAR_PERIODS = 3  # within this many idle periods of a round's end (or of a change), progress records go fast
# with the push transport, every this many periods a record also goes the DHT's way and a read asks the DHT: peers
# not yet known (and those that know nobody who knows us) show up, and the key's nearest nodes, which a client-mode
# peer reads from, hold every record
_DHT_EVERY = 10
_PUSH_LIMIT = 64  # a record is pushed to at most this many known peers (the nearest to the key first)
_INTRODUCE_LIMIT = 8  # peers pinged per DHT read at most (chosen at random: anyone can write records under any id)
_INTRODUCE_AGAIN_S = 60.0  # a peer pinged is not pinged again for this long
_CLAIMS_TO_BAN = 3  # checks at which a peer may be found making an unbacked claim before it is banned (history.py)


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
            if isinstance(item, ValueWithExpiration) and _well_formed(item.value) and not item.value.get("left"):
                peers[str(peer)] = (item.value, float(item.expiration_time))
    return peers


_PLAN_FIELDS = frozenset({"round_budget", "round_deadline"})  # what ends this peer's round; read by the others' pace
_NUMERIC_FIELDS = ("round", "outer_step", "round_tokens", "round_budget", "rate", "time", "period", "round_deadline")


def _well_formed(record: object) -> bool:
    """A progress record whose numeric fields, where present, are finite numbers: anyone can write one, and an
    infinite ``round`` or ``rate`` (msgpack carries them) raised OverflowError in the training loop's arithmetic."""
    if not isinstance(record, dict):
        return False
    for name in _NUMERIC_FIELDS:
        value = record.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)):
            return False
    return True


async def _push_record(dht: DHT, node: DHTNode, key: str, subkey: str, value: dict, expiration_time: float) -> int:
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


async def _introduce(dht: DHT, node: DHTNode, peer_ids: Sequence[str]) -> int:
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

    ``push``: a record goes straight to the peers this node knows (``_push_record``), and every ``_DHT_EVERY``-th
    one (the first included) with a DHT store; otherwise every record is a DHT store.
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
    ):
        self._dht, self._key, self._period_s, self._ttl_s = dht, key, period_s, ttl_s
        self._push, self._published = push, 0
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

    def own_record(self) -> dict:
        with self._lock:
            return dict(self._record)

    def publish_now(self, dht_store: bool = False) -> Future | None:
        """Publish this peer's record now: pushed, or stored in the DHT (``dht_store``, no ``push``, every
        ``_DHT_EVERY``-th time, and often enough that the key's nearest nodes always hold an unexpired copy).
        The future says how many peers took it (push) or whether the store went."""
        record = self.own_record()
        if not record:
            return None
        self._published += 1
        due = (self._published - 1) % _DHT_EVERY == 0 or time.monotonic() - self._last_dht_store >= 0.75 * self._ttl_s
        return self._send(record, dht_store or not self._push or due)

    def _send(self, record: dict, dht_store: bool) -> Future:
        subkey, expiration_time = self._dht.peer_id.to_base58(), get_dht_time() + self._ttl_s
        if dht_store:
            self._last_dht_store = time.monotonic()
            return self._dht.store(self._key, subkey=subkey, value=record, expiration_time=expiration_time, return_future=True)
        push = partial(_push_record, key=self._key, subkey=subkey, value=record, expiration_time=expiration_time)
        return self._dht.run_coroutine(push, return_future=True)

    def wake(self) -> None:
        """Publish and read now rather than at the end of the current wait (which may be an idle period)."""
        self._wake.set()

    def _loop(self) -> None:
        period_s = self._period_s
        while True:
            self._wake.wait(period_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.peers = self._read_peers()
                self._remember_or_rejoin()
            except Exception as e:  # a DHT hiccup must not kill the beacon
                logger.debug("reading progress failed: %r", e)
            period_s = self._next_period(period_s)
            try:
                self.publish_now()
            except Exception as e:
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

    With ``push``: the records pushed to this node, read locally. A read asks the DHT instead every
    ``_DHT_EVERY``-th time, and whenever the local read finds nobody else or lacks a peer the last read had (one
    that did not say it left: pushes between it and us may have stopped, the DHT's other nodes may still hold it).
    A peer found in the DHT whose record was not renewed here since the last DHT read does not push to us (it does
    not know us: a joiner, a routing table that dropped us, a swarm too large for every table to hold everyone):
    it gets a ping, which puts each in the other's routing table, so that its records reach us and ours reach it.

    A DHT read also leaves what it found in this node's storage (hivemind merges the answers into the stored
    dictionary), so renewals are counted only between two local reads."""

    def __init__(self, dht: DHT, key: str, push: bool):
        self._dht, self._key, self._push = dht, key, push
        self._own = dht.peer_id.to_base58()
        self._local_reads = 0  # local reads since the last DHT read (two threads read: a miscount is harmless)
        self._seen: frozenset[str] = frozenset()  # the peers the last read returned
        self._expirations: dict[str, float] = {}  # each peer's record's expiration at the last local read
        self._renewed: set[str] = set()  # peers whose record was renewed here between local reads since the last DHT read
        self._introduced: dict[str, float] = {}  # peer -> when (monotonic) it was last pinged
        self.introductions = 0  # peers pinged because they did not push to us

    def __call__(self) -> dict[str, dict]:
        if self._push and self._local_reads < _DHT_EVERY - 1:
            items = read_progress_items(self._dht, self._key, local=True)
            items.pop(self._own, None)
            self._local_reads += 1
            for peer, (_, expiration) in items.items():
                if expiration > self._expirations.get(peer, math.inf):
                    self._renewed.add(peer)
            self._expirations = {peer: expiration for peer, (_, expiration) in items.items()}
            if items and self._seen <= items.keys():
                self._seen = frozenset(items)
                return {peer: record for peer, (record, _) in items.items()}
        self._local_reads = 0
        items = read_progress_items(self._dht, self._key)
        items.pop(self._own, None)
        if self._push:
            self._introduce(items)
            self._renewed, self._expirations = set(), {}
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
        chosen = random.sample(strangers, min(len(strangers), _INTRODUCE_LIMIT))
        self._introduced.update(dict.fromkeys(chosen, now))
        self.introductions += len(chosen)
        self._dht.run_coroutine(partial(_introduce, peer_ids=chosen), return_future=True)


def _log_rejoin(future: Future) -> None:
    try:
        answered = future.result()
        (logger.info if answered else logger.debug)("rejoin: %d known peers answered a ping", answered)
    except Exception as e:
        logger.debug("rejoin failed: %r", e)


class SwarmLink:
    """The learner's connection to the swarm; see the module docstring."""

    runner_class: type[GuardedAllReduceRunner] = GuardedAllReduceRunner  # adversary.py swaps in a misbehaving one

    def __init__(
        self,
        config: SwarmConfig,
        template: Sequence[torch.Tensor],
        state_provider: Callable[[], tuple[dict, Sequence[torch.Tensor]]],
        fragments: int = 1,
    ):
        self.config = config
        try:
            membership = RunMembership.from_files(config.swarm_key_file, config.allow_list_file, config.identity_path)
        except ValueError as e:
            raise SwarmStartError(str(e)) from None
        self.dht, self.reachability = join_swarm(config, membership.validators)
        client = self.reachability.mode == "client"
        self.peer_id = self.dht.peer_id.to_base58()
        self._progress_key = f"{config.run_id}.progress"
        self._fragments, self._ledger = fragments, TokenLedger()
        self._template_shapes = [tuple(t.shape) for t in template]  # what one averaging carries (a served average too)
        logger.info(membership.describe())
        self.codec = make_codec(config.compression)
        # one residual per streaming fragment: outer step r carries fragment r % fragments
        self._error_feedback = [ErrorFeedback(self.codec) for _ in range(fragments)] if config.compression == "int4" else None
        self._averager: GuardedAverager | None = None
        self._banned: frozenset[str] = frozenset()  # peers our averager banned (bad averages): not live to us any more
        # peers that most of the others banned (their progress records say so): not live to us either, never our
        # leader nor let into our groups, though we never saw them misbehave (robust.banned_by_majority)
        self._shunned: frozenset[str] = frozenset()
        # peers proven to have averaged: our groups' members, and those a verified downloaded state's history names.
        # Only they vote on bans (anyone can write a progress record under any subkey)
        self._participants: frozenset[str] = frozenset()  # replaced whole, never changed in place (two threads)
        # senders whose parts our reducer left out of our latest averaging: they add nothing to the outer step,
        # so they don't count in our round's budget (see round_view)
        self._left_out: frozenset[str] = frozenset()
        # peers whose claims of the swarm's history no majority backed, or whose states did not verify (history.py)
        self._history_banned: frozenset[str] = frozenset()
        self._claims: dict[str, tuple[set[history.Node], int]] = {}  # peer -> (unbacked heads said, checks it claimed at)
        self._bad_states: dict[str, int] = {}  # donor -> states of its that did not verify
        self._anchors = frozenset(_peer_ids(config.initial_peers))  # a fresh peer breaks a tie by their word
        self._beacon: ProgressBeacon | None = None
        # the beacon's pace (_pace): fast until then (monotonic), and the live peers it saw
        self._fast_until = time.monotonic() + _NEAR_PERIODS * config.idle_period_s
        self._paced_members: dict[str, float] = {}  # peer id -> when (monotonic) the beacon last saw its record
        self._averaging_in_flight = False
        self._period_now = config.progress_period_s  # the beacon's current period
        # progress records pushed to the peers we know, each read where it landed; a client-mode peer takes no
        # pushes (nobody can dial it): it reads from the DHT
        self._push = config.progress_transport == "push"  # a client-mode peer pushes too: it can dial the others
        self._reader = ProgressReader(self.dht, self._progress_key, self._push and not client)
        previous_sigint = signal.getsignal(signal.SIGINT)
        try:
            self._averager = GuardedAverager(
                [torch.zeros_like(t) for t in template],  # what one averaging carries (all params, or a fragment)
                self.dht,
                wire_codec=WireCodec(self.codec, part_values_for(self.codec, sum(t.numel() for t in template))),
                state_provider=state_provider,
                runner_class=self.runner_class,
                membership=membership.check(self.dht, self._progress_key),
                prefix=f"{config.run_id}_averaging",
                start=True,
                min_matchmaking_time=config.matchmaking_time_s,
                request_timeout=min(1.0, config.matchmaking_time_s / 2),
                next_chunk_timeout=config.chunk_timeout_s,
                allreduce_timeout=config.averaging_timeout_s,
                client_mode=client,  # reduces no part; hivemind leaves its share to the others
                allow_state_sharing=not client,
                # a new outer step re-declares at once (refresh_donor_priority); this only keeps the declaration alive
                declare_state_period=config.idle_period_s * 2,
                shutdown_timeout=5,
            )
            self._beacon = ProgressBeacon(
                self.dht,
                self._progress_key,
                config.progress_period_s,
                config.progress_ttl_s,
                self._read_progress,
                bootstrap=config.initial_peers,
                pace=self._pace,
                push=self._push,
            )
            if client:
                self._beacon.update(client=True)  # others know this peer can't reduce: see average()
        except BaseException:
            self.close()
            raise
        finally:
            signal.signal(signal.SIGINT, previous_sigint)

    def visible_maddrs(self) -> list[str]:
        return [str(addr) for addr in self.dht.get_visible_maddrs()]

    # progress records -----------------------------------------------------------------------------

    def publish(self, **fields: object) -> None:
        """Set fields of this peer's progress record; published by the beacon (and now, if the step moved)."""
        assert self._beacon is not None
        before = self._beacon.own_record()
        if set(fields) <= _PLAN_FIELDS:
            self._beacon.update(**fields)  # no new tokens: the record's time stays that of its round_tokens
        else:
            self._beacon.update(**fields, time=get_dht_time())
        if any(name in fields and fields[name] != before.get(name) for name in ("round", *_PLAN_FIELDS)):
            self._beacon.wake()  # a new round or a nearer end: the idle wait must not hide it for seconds
        if "outer_step" in fields:
            self._beacon.publish_now()
            self.refresh_donor_priority(int(fields["outer_step"]), str(fields.get("global_sha256", "")))

    def refresh_donor_priority(self, outer_step: int, global_sha256: str) -> None:
        """Donors are tried highest priority first: the furthest outer step. (A priority is anyone's word: a
        downloader checks the state it gets against the one it chose, and asks the next donor if it differs.)"""
        assert self._averager is not None
        if self.reachability.mode == "client":
            return  # a client serves no state
        self._averager.state_sharing_priority = float(outer_step)

    def reported_sha256(self, outer_step: int) -> dict[str, str]:
        """The state sha256 each live peer reports for ``outer_step``, by peer id."""
        return history.reported_sha256(self.live_peers(), outer_step)

    def swarm_target(self, chain: Sequence[history.Node], fresh: bool) -> history.Target | None:
        """The state this peer should take, by what the live peers vouch for (history.choose_target); notes, says once
        and in the end bans the peers that claim steps no majority backs."""
        records = self.live_peers()
        target = history.choose_target(self._unbanned(records), chain, fresh, self.peer_id, self._anchors)
        if target is None and not fresh:  # nothing to follow: heads far ahead are claims the swarm does not back
            self._note_claims(records, chain)
        if target is not None and target.step <= chain[-1][0]:  # a fork or another history: say who vouches for what
            heads = {peer[-8:]: [f"{step}:{sha[:8]}" for step, sha in history.chain_of(r)] for peer, r in records.items()}
            logger.info("our head %d:%s; the others' chains: %s", chain[-1][0], chain[-1][1][:8], heads)
        return target

    def _note_claims(self, records: dict[str, dict], chain: Sequence[history.Node]) -> None:
        """Say each unbacked claim once; ban a peer found claiming at ``_CLAIMS_TO_BAN`` of our checks (one per round's
        end, or failed round): a claim kept up, or one made anew each time."""
        for peer, node in history.unbacked_claims(records, chain, self.peer_id).items():
            said, checks = self._claims.get(peer, (set(), 0))
            if node not in said:
                logger.warning("ignoring outer step %d claimed by %s: no majority of the swarm vouches for it", node[0], peer)
            self._claims[peer] = (said | {node}, checks + 1)
            if checks + 1 >= _CLAIMS_TO_BAN and peer not in self._history_banned:
                logger.warning("banning %s: it claimed outer steps that no majority of the swarm vouches for, at %d "
                               "of our checks", peer, checks + 1)
                self._history_banned = self._history_banned | {peer}
                self._publish_bans()

    def refuse_donor(self, donor: str, reason: str) -> None:
        """A state the learner could not verify (a next step that did not recompute, or whose average failed the
        checks): a donor that serves two such states is banned."""
        self._bad_states[donor] = self._bad_states.get(donor, 0) + 1
        if self._bad_states[donor] >= 2 and donor not in self._history_banned:
            logger.warning("banning %s: it served states that did not verify (%s)", donor, reason)
            self._history_banned = self._history_banned | {donor}
            self._publish_bans()

    def _publish_bans(self) -> None:
        if self._beacon is not None:  # the others take our word for it once most of them agree
            self._beacon.update(banned=sorted(self._banned | self._history_banned))

    def live_peers(self) -> dict[str, dict]:
        """Progress records of the other peers whose record has not expired, who have not said they left and whom
        our averager has not banned."""
        return self._unbanned(self._all_progress())

    def _all_progress(self) -> dict[str, dict]:
        """The other peers' unexpired progress records, banned peers' included; the beacon's last read if the DHT
        does not answer."""
        try:  # bounded: a DHT process that died (or a p2pd that did) must not hang the training loop
            return self._reader()
        except Exception as e:
            logger.debug("reading progress records failed: %r", e)
            return dict(self._beacon.peers) if self._beacon is not None else {}

    def _unbanned(self, peers: dict[str, dict]) -> dict[str, dict]:
        # banned peers can't join our groups: waiting for them would stall every round
        excluded = self._banned | self._shunned | self._history_banned
        return {peer: record for peer, record in peers.items() if peer not in excluded}

    def progress_records(self) -> dict[str, dict]:
        """This peer's progress record and the others' as of the beacon's last read (no DHT access: for watchers)."""
        beacon = self._beacon
        if beacon is None:
            return {}
        return {self.peer_id: beacon.own_record(), **beacon.peers}

    def peers_behind(self, outer_step: int) -> int:
        """Live peers whose last progress record is at an earlier outer step (as of the beacon's last read)."""
        beacon = self._beacon
        if beacon is None:
            return 0
        return sum(int(r.get("outer_step", -1)) < outer_step for r in list(beacon.peers.values()))

    # averaging ------------------------------------------------------------------------------------

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        """Average with the live peers of this outer step; alone in the swarm, the group is just us.

        Peers that are alive but behind are waited for (they catch up by downloading state and join this
        outer step), so that a fast peer never runs off on its own while others are there.
        """
        self._averaging_in_flight = True  # progress records go fast meanwhile (_pace)
        if self._beacon is not None:
            self._beacon.wake()
        try:
            return self._average(tensors, weight, outer_step)
        finally:
            self._averaging_in_flight = False

    def _average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        residual, feedback = None, None
        if self._error_feedback is not None:
            feedback = self._error_feedback[outer_step % len(self._error_feedback)]
            tensors, residual = feedback.prepare(list(tensors))
        live = self._read_progress()
        if self.reachability.mode == "client" and all(r.get("client") for r in live.values()):
            # a client can only send to reducers. Among clients alone (or when the DHT, whose records only
            # reachable peers hold, answers nobody) no group can form, and each client stepping alone would
            # fork the swarm. The progress stays local and flows into a later round
            outcome = AveragingOutcome(None, (), 0.0, "no_group", "no peer that can reduce is alive")
        elif live:
            outcome = self._average_with(live, tensors, weight, outer_step)
            if self.reachability.mode == "client" and outcome.averaged is not None and len(outcome.peers) < 2:
                # hivemind gives a client that found no reducer a group of itself; two clients doing that at
                # once would fork the swarm. Only a group with a reducer in it counts for a client
                outcome = AveragingOutcome(None, (), 0.0, "no_group", "no peer that reduces joined this client's group")
        elif self._beacon is not None and self._beacon.peers:
            # the DHT answered "nobody" while the beacon's last view had peers: a DHT that is reconnecting (after a
            # freeze, say), not an empty swarm. Averaging alone now would race ahead of the others on its own
            # outer steps, one instant round after another; fail this round instead (the progress is kept)
            outcome = AveragingOutcome(None, (), 0.0, "no_group", "the swarm's progress records could not be read")
        else:
            outcome = self.average_alone(tensors, weight)
        if feedback is not None and residual is not None and outcome.averaged is not None:
            feedback.commit(residual)
        return outcome

    def _average_with(self, live: dict[str, dict], tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        """One averaging with the live peers; each sender's weight is bounded by the tokens it published for the
        round (two rounds per fragment: a failed round's progress flows into the next), and what the reducers
        rejected comes back in the outcome."""
        assert self._averager is not None
        try:
            self._averager.take_rejections()  # left over from an abandoned attempt
            self._averager.set_allowed_weights(self._ledger.allowed(outer_step, rounds=2 * self._fragments),
                                               self._shunned | self._history_banned)
        except Exception as e:  # the averager process is gone or stuck: run_averaging reports it
            logger.debug("could not pass the weight limits to the averager: %r", e)
        base = self._base()
        outcome = run_averaging(
            self._averager, tensors, weight, outer_step, self.config.averaging_timeout_s, 1 + len(live),
            lambda: self._moved_past(outer_step), base=str(base) if base else None,
            part_norms=part_norms_of(tensors, self._averager.wire_codec.part_values),
        )
        rejected = tuple(self._averager.take_rejections())
        if outcome.averaged is not None:
            self._participants = self._participants | set(outcome.peers)
        banned = self._averager.banned_peers()
        if banned != self._banned:
            self._banned = banned
            self._publish_bans()
        self._left_out = self._averager.left_out_senders()
        return dataclasses.replace(outcome, rejected=rejected) if rejected else outcome

    def _base(self) -> str | None:
        """The sha256 of the state our outer gradient was measured from: the one we last published."""
        beacon = self._beacon
        return beacon.own_record().get("global_sha256") if beacon is not None else None

    def _read_progress(self) -> dict[str, dict]:
        """The live peers' progress records, noting the tokens each peer published per round (weight limits).

        Banned peers' tokens are noted too: a groupmate that has not banned one can still let it into a group
        with us, and its declared weight must then be bounded by its progress like anyone's (a banned garbage
        reducer that had chased the swarm for 15 rounds declared 663k tokens against the others' ~45k, and with
        no record of its progress only the cap of 10x the group's median, 430k, applied)."""
        peers, now = self._all_progress(), get_dht_time()
        for peer, record in peers.items():
            self._ledger.observe(peer, record.get("round"), _tokens_now(record, now, self._horizon_s(record)))
        shunned = banned_by_majority(peers, self.peer_id, self._banned, self._participants)
        for peer in sorted(shunned - self._shunned):
            logger.warning("%s was banned by most peers of the swarm: not grouping with it either", peer)
        self._shunned = shunned
        return self._unbanned(peers)

    def _moved_past(self, outer_step: int) -> bool:
        """A group for ``outer_step`` will not form any more: a majority took a later step on our history, or every
        other peer is past it (history.moved_past). A claim of a later step that no majority backs does not count."""
        beacon = self._beacon
        if beacon is None:  # closing: the averaging in flight is abandoned
            return True
        chain = history.chain_of(beacon.own_record())
        if not chain or chain[-1][0] != outer_step:
            return False
        return history.moved_past(self._unbanned(dict(beacon.peers)), chain, self.peer_id)

    def average_async(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> Future:
        """Start averaging in a background thread and return at once; the future holds the outcome."""
        future: Future = Future()
        tensors = [t.detach().clone() for t in tensors]

        def work() -> None:
            try:
                future.set_result(self.average(tensors, weight, outer_step))
            except Exception as e:  # a bug, not a network failure: report it as a failed round, loudly
                logger.exception("averaging crashed")
                future.set_result(AveragingOutcome(None, (), 0.0, "error", f"{type(e).__name__}: {e}"))

        threading.Thread(target=work, name=f"averaging-{outer_step}", daemon=True).start()
        return future

    def round_view(self, round_index: int) -> RoundView:
        """The others' progress in ``round_index``, leaving out the peers whose parts our reducer refused in our
        latest averaging: their tokens add nothing to the outer step, so they neither count towards the round's
        budget nor end it (a peer whose parts are refused cannot shorten the rounds by training or reporting
        many tokens, or by running ahead)."""
        assert self._beacon is not None
        left_out = self._left_out
        peers = [record for peer, record in list(self._beacon.peers.items()) if peer not in left_out]
        now = get_dht_time()
        return RoundView(
            live_peers=len(peers),
            tokens_by_others=sum(_tokens_now(r, now, self._horizon_s(r)) for r in peers if r.get("round") == round_index),
            peers_ahead=sum(int(r.get("round", -1)) > round_index for r in peers),
        )

    def _horizon_s(self, record: dict) -> float:
        """How far ahead a peer's record is extrapolated: two periods, of the longer of the one it says it was
        published under and the one we read at now (a record read every 5 s may be 6 s old though published every
        second), within our own two periods (a record can't stretch its tokens further by claiming a long one)."""
        fast, idle = self.config.progress_period_s, self.config.idle_period_s
        period = record.get("period", fast)
        if isinstance(period, bool) or not isinstance(period, int | float) or not math.isfinite(period):
            period = fast
        return 2 * min(max(period, self._period_now, fast), idle)

    def _pace(self) -> float:
        """The beacon's next period: the short one (``progress_period_s``) while anything is near or changing,
        the idle one otherwise. Near: the round's end is less than 3 idle periods away by the records at hand.
        Changing: the first 3 idle periods after start, or after a peer joined (it must be seen by all alike
        before the round ends), and while an averaging is in flight (its group forms, and a
        step others take must be seen at once). Published records carry this period (see ``_horizon_s``)."""
        self._period_now = self._choose_pace()
        return self._period_now

    def _choose_pace(self) -> float:
        fast, idle = self.config.progress_period_s, self.config.idle_period_s
        beacon = self._beacon
        if idle <= fast or beacon is None:
            return fast
        now = time.monotonic()
        # a joiner: a peer not seen within a record's lifetime. A known peer missing from one read (a partial DHT
        # answer) is no change; a peer that left or died shrinks the round's budget, which brings its end nearer
        joined = [peer for peer in beacon.peers if now - self._paced_members.get(peer, -math.inf) > self.config.progress_ttl_s]
        self._paced_members.update((peer, now) for peer in beacon.peers)
        if joined:
            self._fast_until = max(self._fast_until, now + _NEAR_PERIODS * idle)
        if now < self._fast_until or self._averaging_in_flight:
            return fast
        return idle if self._seconds_to_round_end(beacon.own_record(), dict(beacon.peers)) > _NEAR_PERIODS * idle else fast

    def _seconds_to_round_end(self, own: dict, peers: dict[str, dict]) -> float:
        """When this peer's round ends, by the records: the soonest of the budgets (ours and those the others in
        our round published, which may be smaller) less the round's tokens over the round's rate, and of the
        round deadlines published. 0 when unknown (no budget published yet, nobody training) or when a peer is
        already past our round. A hostile budget or deadline can only make this peer publish more often."""
        try:
            round_index, budget = int(own["round"]), int(own["round_budget"])
        except (KeyError, TypeError, ValueError, OverflowError):
            return 0.0
        now, tokens, rate, deadline = get_dht_time(), 0, 0.0, float("inf")
        for record in [own, *peers.values()]:
            if not _well_formed(record):
                continue
            their_round, their_rate = int(record.get("round", -1)), float(record.get("rate", 0.0))
            if their_round > round_index:
                return 0.0
            if their_round == round_index:
                tokens += _tokens_now(record, now, self._horizon_s(record))
                rate += max(0.0, their_rate)
                if record.get("round_budget"):
                    budget = min(budget, int(record["round_budget"]))
                if record.get("round_deadline"):
                    deadline = min(deadline, float(record["round_deadline"]))
        by_tokens = max(0, budget - tokens) / rate if rate > 0 else 0.0
        return max(0.0, min(by_tokens, deadline - now))

    def average_alone(self, tensors: Sequence[torch.Tensor], weight: float) -> AveragingOutcome:
        # a group of one still goes through the codec, exactly as its own reducer would encode the result
        return AveragingOutcome(codec_round_trip(self.codec, tensors), (self.peer_id,), weight, "ok")

    def traffic(self) -> tuple[int, int]:
        assert self._averager is not None
        return self._averager.traffic.totals()

    # state download -------------------------------------------------------------------------------

    def download_state(self, shapes: Sequence[Sequence[int]], target: history.Target) -> SwarmState | None:
        """Download ``target``'s state from a donor that holds it and verify it whole (verify.state_problem) and
        against ``target``'s sha256. A donor that serves anything else is refused and the next one asked; once every
        donor was asked, the target is chosen again from fresh records (the swarm may have moved on). Returns None if
        no donor gave a verifiable state within ``state_timeout_s``."""
        assert self._averager is not None
        deadline = time.monotonic() + self.config.state_timeout_s
        refused: set[str] = set()  # donors whose state failed verification: the next one in priority is asked
        reasons: dict[str, str] = {}  # every donor refused during this download, and why (for the metrics)
        while time.monotonic() < deadline:
            remaining = deadline - time.monotonic()
            try:
                loaded = self._averager.load_state_excluding(timeout=remaining, exclude=sorted(refused))
            except Exception as e:
                logger.warning("state download failed: %s", first_line(e))
                loaded = None
            if loaded is None:
                refused.clear()  # nobody else had it: give everyone another chance, for what the swarm holds now
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                target = self._retarget(target)
                if target is None:
                    return None
                continue
            metadata, tensors, donor = loaded
            state = self._verified_state(metadata, tensors, shapes, donor, target)
            if isinstance(state, SwarmState):
                self._participants = self._participants.union(*state.round_history.values())
                return dataclasses.replace(state, refused_donors=tuple(sorted(reasons.items())))
            logger.warning("donor %s: %s; asking another donor", donor, state)
            refused.add(donor)
            reasons.setdefault(donor, state)
        return None

    def _retarget(self, target: history.Target) -> history.Target | None:
        """What to download now, for the chain we published and the freshness ``target`` implies."""
        beacon = self._beacon
        chain = history.chain_of(beacon.own_record()) if beacon is not None else ()
        if not chain:
            return target
        return self.swarm_target(chain, fresh=target.how == "fresh")

    def _verified_state(
        self, metadata: object, tensors: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]], donor: str,
        target: history.Target,
    ) -> SwarmState | str:
        """The donor's state if it is whole (verify.state_problem) and hashes to ``target``'s sha256 at its outer step,
        otherwise why not."""
        count = len(shapes)
        if not isinstance(metadata, dict) or len(tensors) not in (2 * count, 2 * count + len(self._template_shapes)):
            return "malformed state"
        params, momentum = list(tensors[:count]), list(tensors[count : 2 * count])
        problem = state_problem(metadata, params, momentum, shapes)
        if problem is not None:
            return problem
        digest = state_sha256(params, momentum)
        if (metadata["outer_step"], digest) != target.node or digest != metadata.get("global_sha256"):
            return f"its state is not outer step {target.step} with the sha256 the swarm vouches for ({target.how})"
        average = list(tensors[2 * count :]) or None
        if average is not None and [tuple(t.shape) for t in average] != self._template_shapes:
            average = None  # not an average of ours: the state stands, no next step can be recomputed from it
        parent = metadata.get("parent_sha256")
        chain = history.chain_of(dict(outer_step=metadata["outer_step"], global_sha256=digest, recent=metadata.get("recent")))
        return SwarmState(
            outer_step=metadata["outer_step"],
            global_params=params,
            momentum=momentum,
            outer_steps_taken=metadata["outer_steps_taken"],
            steps_into_round=metadata["steps_into_round"],
            global_sha256=digest,
            donor=donor,
            round_history=_parse_history(metadata.get("round_history")),
            chain=chain,
            parent_sha256=parent if isinstance(parent, str) else None,
            last_average=[t.float() for t in average] if average is not None else None,
            how=target.how,
        )

    def close(self) -> None:
        """Leave the swarm: say so in the progress record, stop publishing, shut the averager and the DHT (and
        its p2pd) down."""
        if self._beacon is not None:
            self._beacon.leave()
            self._beacon = None
        if self._averager is not None:
            if self._averager.is_alive():
                self._averager.shutdown()
            _kill_if_alive(self._averager)
            self._averager = None
        if self.dht is not None:
            close_dht(self.dht)
            self.dht = None


def close_dht(dht: DHT) -> None:
    """Stop a DHT started by ``start_dht`` and its ``p2pd``."""
    if dht.is_alive():
        dht.shutdown()
    _kill_if_alive(dht)


def _kill_if_alive(process: Any, wait_s: float = 5.0) -> None:
    """hivemind's shutdown ends with terminate() (SIGTERM), which our children ignore: finish the job."""
    process.join(timeout=wait_s)
    if process.is_alive():
        process.kill()
        process.join(timeout=wait_s)


def reap_descendants() -> int:
    """SIGKILL every process descended from this one (Linux /proc; elsewhere nothing); returns how many."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))  # fields: state, ppid, ...
    found, stack = [], list(children.get(os.getpid(), []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(found)


def _tokens_now(record: dict, now: float, horizon_s: float) -> int:
    """A peer's round tokens now: what it published, plus its rate times the record's age (at most
    ``horizon_s``). Records are a period or two old; without this, short rounds overshoot their budget."""
    try:
        tokens, rate, age = int(record.get("round_tokens", 0)), float(record.get("rate", 0.0)), now - float(record.get("time", now))
    except (TypeError, ValueError, OverflowError):
        return 0
    tokens = max(0, tokens)
    extra = max(0.0, rate) * min(max(0.0, age), horizon_s)
    if not math.isfinite(extra):
        return tokens  # a hostile or broken record (rate inf or 1e308: int() of it raised in the learner's loop)
    return tokens + int(extra)


def _peer_ids(addresses: Sequence[str]) -> list[str]:
    """The peer ids in multiaddrs' /p2p/ parts (malformed ones skipped)."""
    found = []
    for address in addresses:
        try:
            found.append(str(Multiaddr(address)["p2p"]))
        except Exception:
            continue
    return found


def _parse_history(value: object) -> dict[int, tuple[str, ...]]:
    """A donor's round history, keeping only well-formed entries (it is a hint, never trusted for bytes)."""
    history: dict[int, tuple[str, ...]] = {}
    if isinstance(value, dict):
        for step, peers in value.items():
            if isinstance(step, int | str) and str(step).isdigit() and isinstance(peers, list | tuple):
                history[int(step)] = tuple(str(p) for p in peers)
    return history


def check_multiaddr(text: str, need_peer_id: bool) -> str:
    """Return ``text`` if it is a valid multiaddr (with a /p2p/ peer id if asked); raise ValueError otherwise."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        protocols = [p.name for p in Multiaddr(text).protocols()]
    except Exception as e:
        raise ValueError(f"bad multiaddr {text!r}: {first_line(e)}") from None
    if need_peer_id and "p2p" not in protocols:
        raise ValueError(f"initial peer {text!r} lacks its /p2p/<peer id> part (copy the whole address a peer printed)")
    return text
