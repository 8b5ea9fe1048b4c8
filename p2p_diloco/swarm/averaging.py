"""Exact, compressed, leaderless averaging over hivemind's butterfly all-reduce.

hivemind 1.1.12 has behaviours we cannot accept (docs/design.md §6), fixed here by subclassing small
pieces of it rather than copying it:

1. *Peers get different averages.* A reducer sends each sender ``average - sender's part`` and keeps the
   exact average for itself; senders add the delta. With a lossy codec the peers' results differ, and even
   in fp32 the last bit differs. Here each reducer encodes the average of its part **once**, sends those
   same bytes to every sender, decodes the same bytes for itself, and every peer *replaces* its part with
   the decoded result. Same bytes in, same bytes out: invariant 1.
2. *A partial all-reduce reports success.* When a reducer dies, hivemind fills its part with the peer's
   own value and logs a warning. Here any lost part makes the round fail, loudly, as a returned value.
3. *The 8-bit codec crashes under numpy 2* and the failure is swallowed. Our codecs
   (``core/compression.py``) are registered in hivemind's codec registry (``swarm/wire.py``) for the wire types they use.
4. *The garbage collector ends a cancelled search half-way.* Every task of the averager's loop is kept referenced
   until it ends (``search.hold_tasks``).
5. *One sender that gives up wedges a reducer for everyone.* Every sender of a part awaits the same future, bare:
   the first whose RPC is cancelled cancels it for all of them, the part never completes, and the round hangs
   until its timeout. Here each sender waits on a shield of it (``reducer.PartReducer``). Likewise a part whose average
   raises: the error reached only the sender that completed it, and the others waited for the timeout; here it
   fails the part for every sender, and our own parts count as lost at once.
6. *A stop in mid-round ends the averager's thread with a traceback* (its shutdown takes the futures it keeps of
   running groups for runners). ``DilocoAverager._shutdown`` finalizes the runners and cancels the futures; a
   runner cancelled mid-round is finalized as cancelled, not failed with the cancellation (which nobody reads).
7. *A search for a group reads the DHT once per round trip while it waits* for a leader: its lookups of the
   round's averagers are paced (``paced_lookup``, at most one per ``LEADER_POLL_S``).

This module does not decide *when* to average or what to do with the result: that is the learner's job. One round
from the learner's side (hand over the outer gradient, find a group, read the result) is ``swarm/round.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import signal
import time
import typing
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.compression import CompressionInfo, deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.streaming import combine_from_streaming
from hivemind.utils.timed_storage import ValueWithExpiration

from p2p_diloco.core.feedback import ReducerFeedback
from p2p_diloco.swarm import future_pipes
from p2p_diloco.swarm.reducer import PartReducer
from p2p_diloco.swarm.search import hold, hold_tasks
from p2p_diloco.swarm.wire import MeteredStub, TrafficCounters, WireCodec, install_wire_codecs, metered

logger = logging.getLogger(__name__)


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce whose result is bit-identical on every peer of the group.

    Outputs are *averages* (not deltas): the averager replaces its tensors with them.
    ``lost_values`` > 0 after the run means some reducer's part never arrived: the round is partial.
    """

    def __init__(self, *, wire_codec: WireCodec, traffic: TrafficCounters, feedback: ReducerFeedback | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self._wire_codec, self._traffic, self._feedback = wire_codec, traffic, feedback
        self._encoded_results: dict[int, asyncio.Future] = {}
        self.tensor_part_reducer.finished.set()  # hivemind's reducer is replaced unused: no "0% received" warning
        self.tensor_part_reducer = self._make_reducer()
        # our parts' place among all the parts of the averaging: what a reducer's residual is kept under
        own = self.ordered_peer_ids.index(self.peer_id) if self.peer_id in self.ordered_peer_ids else 0
        self._first_part = sum(self.tensor_part_container.num_parts_by_peer[:own])

    def finalize(self, *, cancel: bool = False, exception: BaseException | None = None) -> None:
        # hivemind's run() passes a cancellation (a stop in mid-round) as the runner's exception: set on a future
        # nobody reads, it ended in the peer's log as "Future exception was never retrieved" and a traceback
        if isinstance(exception, asyncio.CancelledError):
            cancel, exception = True, None
        super().finalize(cancel=cancel, exception=exception)

    def _make_reducer(self) -> PartReducer:
        return PartReducer(tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids))

    @property
    def lost_values(self) -> int:
        return self.tensor_part_container.failed_size

    def _get_peer_stub(self, peer: PeerID) -> Any:
        return MeteredStub(super()._get_peer_stub(peer), self._traffic)

    def _encode_result(self, part_index: int, averaged_part: torch.Tensor) -> asyncio.Future:
        """Encode each averaged part once; every sender, this peer included, receives these bytes."""
        if part_index not in self._encoded_results:
            if self._feedback is None:
                work = functools.partial(self._wire_codec.compress, averaged_part, CompressionInfo.from_tensor(averaged_part))
            else:  # with what our last encode of this part dropped (docs/design.md §2)
                part, feedback = self._first_part + part_index, self._feedback
                work = functools.partial(self._wire_codec.wrap, averaged_part, lambda: feedback.encode(part, averaged_part))
            self._encoded_results[part_index] = asyncio.get_event_loop().run_in_executor(None, work)
        return self._encoded_results[part_index]

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        if peer_id != self.peer_id:
            try:
                return await super()._communicate_with_peer(peer_id)  # remote results arrive already encoded once
            except Exception as e:  # hivemind says why only at DEBUG; the round is partial: say which part and why
                logger.warning("reducer %s: its part never arrived (%s)", peer_id, f"{type(e).__name__}: {e}"[:300])
                raise
        # our own part: reduce it like any other, and take the same decoded bytes the senders get
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        try:
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                averaged_part = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=self.weight
                )
                encoded = await self._encode_result(part_index, averaged_part)
                self.tensor_part_container.register_processed_part(peer_index, part_index, self._wire_codec.extract(encoded))
        except BaseException:  # hivemind's waits for the parts we reduce until the round's timeout: they are lost now
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _ban_sender(self, peer_id: PeerID) -> None:
        if peer_id not in self.banned_senders:  # hivemind says nothing: the sender's round comes back partial
            received = self.tensor_part_reducer.num_parts_received[self.sender_peer_ids.index(peer_id)]
            logger.warning("dropped sender %s from the parts we reduce after %d of %d parts", peer_id, received,
                           self.tensor_part_reducer.num_parts)
        await super()._ban_sender(peer_id)

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData], context: Any):
        async for message in super().rpc_aggregate_part(metered(stream, self._traffic.add_received), context):
            self._traffic.add_sent(message.ByteSize())
            yield message

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int):
        loop = asyncio.get_event_loop()
        part_index = 0
        try:
            async for message in stream:
                tensor_part = await loop.run_in_executor(None, deserialize_torch_tensor, message.tensor_part)
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=message.weight
                    )
                except BannedException:
                    break  # that sender was dropped in the background; it gets no more results
                encoded = await self._encode_result(part_index, averaged_part)
                part_index += 1
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded)
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])


class PartialRoundError(AllreduceException):
    """Some parts of the average never arrived; the tensors were left untouched."""


async def _keep_group_key(*_args: Any, **_kwargs: Any) -> None:
    return None


LEADER_POLL_S = 0.5  # at most this long between two lookups of a round's declared averagers (docs/design.md §6)


def paced_lookup(
    lookup: Callable[..., typing.Awaitable[Any]],
    interval_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], typing.Awaitable[Any]] = asyncio.sleep,
) -> Callable[..., typing.Awaitable[Any]]:
    """``lookup`` (hivemind's ``GroupKeyManager.get_averagers``), started at most once per ``interval_s``.

    A peer whose leader queue is empty (the first at a round's end, or the best leader itself, waiting to be
    joined) asks the DHT again as soon as its last answer came: about a DHT read per round trip, each a request to
    every node near the key, for the whole matchmaking time. A lookup after a quiet interval goes at once."""
    last = -float("inf")

    async def paced(*args: Any, **kwargs: Any) -> Any:
        nonlocal last
        wait_s = last + interval_s - clock()
        if wait_s > 0:
            await sleep(wait_s)
        last = clock()
        return await lookup(*args, **kwargs)

    return paced


class DilocoAverager(DecentralizedAverager):
    """hivemind's averager with exact results, partial-round detection, byte counters and our state.

    ``state_provider()`` returns ``(metadata, tensors)`` served to peers that download the state.
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: Any,
        *,
        wire_codec: WireCodec,
        state_provider: Callable[[], tuple[dict, Sequence[torch.Tensor]]],
        runner_class: type[ExactAllReduceRunner] = ExactAllReduceRunner,
        reducer_feedback: ReducerFeedback | None = None,
        **kwargs: Any,
    ):
        install_wire_codecs()
        self.wire_codec, self.traffic, self._state_provider = wire_codec, TrafficCounters(), state_provider
        self.reducer_feedback = reducer_feedback  # lives in the averager's process, where the parts are encoded
        self._round_step: int | None = None  # the outer step of the round being matched (set_round)
        self.runner_class = runner_class  # tests inject faults with a subclass (RPC names follow our class name)
        future_pipes.before_fork()  # hivemind forks our process within its __init__ (start=True)
        super().__init__(averaged_tensors, dht, compression=wire_codec, **kwargs)
        future_pipes.to_child(self._outer_pipe)  # a step's futures go without their answer's pipe

    def run(self) -> None:
        # the averager process belongs to its peer: a SIGTERM sent to the whole process group (systemd, a
        # launcher, kill -- -PGID) must leave it to the peer's own shutdown, which still needs it to finish.
        # So hivemind's shutdown() fallback (terminate(), a SIGTERM) no longer ends it: the owner SIGKILLs it
        # if shutdown() did not (SwarmLink.close does)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        super().run()

    async def _shutdown(self, timeout: float | None) -> None:
        # hivemind's calls finalize() on what it keeps of each running group, which is a future of its runner (and
        # finalize returns nothing to wait for): a stop in mid-round ended the averager's thread with a traceback
        if not self.client_mode:
            try:
                await self.remove_p2p_handlers(self._p2p, namespace=self.prefix)
            except Exception as e:  # p2pd went first (its control socket is gone): no handler is left to remove
                logger.debug("averaging handlers not removed at shutdown: %r", e)
        for future in list(self._running_groups.values()):
            if not future.done():
                future.cancel()  # matched, runner not built yet: a groupmate's part waiting for it gets nothing
            elif not future.cancelled() and future.exception() is None:
                future.result().finalize(cancel=True)

    async def _aggregate_with_group(self, group_info: Any, min_vector_size: int, **kwargs: Any) -> Any:
        # the group's order decides which peer reduces which part; hivemind's leader shuffles it. Every member puts
        # it in one canonical order (by peer id) instead, so that a group that stays the same gives each part to the
        # same reducer round after round: the reducer's error feedback needs it (docs/design.md §2)
        order = sorted(range(len(group_info.peer_ids)), key=lambda i: group_info.peer_ids[i].to_bytes())
        group_info = dataclasses.replace(group_info, peer_ids=tuple(group_info.peer_ids[i] for i in order),
                                         gathered=tuple(group_info.gathered[i] for i in order))
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any, group_id=None, **kwargs):
        # hivemind adds deltas as they arrive; we collect exact averages and write them only if none is missing
        group_id = group_info.group_id if group_id is None else group_id
        feedback = self.reducer_feedback
        if feedback is not None:
            feedback.begin(self._round_step)
        # one part per reducer where it fits (WireCodec.for_group): every member cuts alike, from the same fractions
        wire_codec = self.wire_codec.for_group([t.numel() for t in tensors], kwargs.get("peer_fractions", ()))
        kwargs["compression"] = wire_codec
        runner = self.runner_class(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            wire_codec=wire_codec,
            traffic=self.traffic,
            feedback=feedback,
            **kwargs,
        )
        self._running_groups[group_id].set_result(runner)
        try:
            results = [result async for result in runner]
            if runner.lost_values:
                raise PartialRoundError(f"partial all-reduce: {runner.lost_values} of {runner.tensor_part_container.total_size} values lost")
        except BaseException:
            if feedback is not None:
                feedback.abandon()  # nobody applies this round's averages: what our encodes dropped is not owed
            raise
        if feedback is not None:
            feedback.commit()
        for tensor, result in zip(tensors, results, strict=True):
            tensor.copy_(result)

    async def _step(self, **kwargs: Any) -> None:
        # runs in the averager's loop, as every step begins: from here on its tasks are held (hold_tasks); the step's
        # own task was created before the first call installed that
        hold_tasks(asyncio.get_running_loop())
        hold(asyncio.current_task())
        await super()._step(**kwargs)

    def set_round(self, outer_step: int, expected_group_size: int | None) -> None:
        """Match only with peers averaging ``outer_step``, and assemble the group as soon as
        ``expected_group_size`` peers are in it (None: wait out the whole matchmaking time, hivemind's way)."""
        future = MPFuture()
        self._outer_pipe.send(
            ("_set_round", [], dict(group_bits=outer_step_key(outer_step), target=expected_group_size, future=future))
        )
        future.result(timeout=30)

    async def _set_round(self, group_bits: str, target: int | None, future: MPFuture) -> None:
        try:
            hold_tasks(asyncio.get_running_loop())
            self._round_step = int(group_bits, 2)  # the outer step (outer_step_key)
            matchmaking = self._matchmaking
            # hivemind re-shuffles the group key after every assembled group (for gossip averaging); our key is
            # the outer step and must stay fixed while a round is retried, so the re-shuffle is switched off
            matchmaking.group_key_manager.update_key_on_group_assembled = _keep_group_key
            self._pace_leader_search()
            matchmaking.group_key_manager.group_bits = group_bits
            # a leader whose group reaches the target starts the all-reduce at once instead of waiting for the
            # matchmaking time to run out: when every live peer is in, there is nobody left to wait for
            matchmaking.target_group_size = target
            matchmaking.potential_leaders.target_group_size = target
            future.set_result(None)
        except Exception as e:
            if not future.done():
                future.set_exception(e)

    def _pace_leader_search(self) -> None:
        """Install ``paced_lookup`` on the matchmaking's key manager, once (hivemind builds the matchmaking in the
        averager's process, so the first round installs it)."""
        matchmaking = self._matchmaking
        if getattr(matchmaking, "_paced", False):
            return
        keys = matchmaking.group_key_manager
        keys.get_averagers = paced_lookup(keys.get_averagers, min(LEADER_POLL_S, matchmaking.min_matchmaking_time / 10))
        matchmaking._paced = True

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:  # hivemind reads RPC streams from typing.AsyncIterator only
        # counted apart from the averaging messages: a peer's wire bytes are its rounds' plus the states it served. A
        # state counts once its first message goes out (a peer that does not share states answers with none)
        first = True
        async for message in metered(super().rpc_download_state(request, context), self.traffic.add_state_bytes):
            if first:
                self.traffic.add_state_served()
                first = False
            yield message

    def load_state_excluding(
        self, timeout: float, exclude: Sequence[str] = (), prefer: Mapping[str, tuple[int, ...]] | None = None
    ) -> tuple[Any, Sequence[torch.Tensor], str] | None:
        """hivemind's ``load_state_from_peers``, skipping donors in ``exclude`` (base58 peer ids): a donor whose
        state failed verification is not asked again, the next one in order is. Donors are asked in the order of
        ``prefer`` (base58 peer id -> rank, highest first: what the caller's progress records say each holds), then
        of their declared priority; a declared donor missing from ``prefer`` comes after those in it. Returns
        ``(metadata, tensors, donor's peer id)`` or None."""
        future = MPFuture()
        self._outer_pipe.send(("_load_state_excluding", [], dict(future=future, exclude=tuple(exclude),
                                                                 prefer=dict(prefer or {}))))
        return future.result(timeout=timeout)

    async def _load_state_excluding(self, future: MPFuture, exclude: tuple[str, ...],
                                    prefer: dict[str, tuple[int, ...]]) -> None:
        # as DecentralizedAverager._load_state_from_peers in hivemind 1.1.12, plus the ``exclude`` filter and the
        # caller's order (``prefer``)
        hold_tasks(asyncio.get_running_loop())
        try:
            key_manager = self._matchmaking.group_key_manager
            found, _ = self.dht.get(f"{key_manager.prefix}.all_averagers", latest=True) or ({}, None)
            priority = {
                # unranked donors after ranked ones; the declared priority next; randomness breaks ties
                peer: (peer.to_base58() in prefer, prefer.get(peer.to_base58(), ()), float(info.value), random.random())
                for peer, info in _declared(found)
            }
            for peer in sorted(priority, key=priority.get, reverse=True):
                if peer == self.peer_id or peer.to_base58() in exclude:
                    continue
                try:
                    stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
                    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
                    metadata, parts, tensors = None, [], []
                    async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout):
                        if message.metadata:
                            metadata = self.serializer.loads(message.metadata)
                        if message.tensor_part.dtype and parts:  # a new tensor begins
                            tensors.append(whole_tensor(parts))
                            parts = []
                        parts.append(message.tensor_part)
                    if parts:
                        tensors.append(whole_tensor(parts))
                    if metadata:
                        future.set_result((metadata, tensors, peer.to_base58()))
                        return
                except Exception as e:
                    logger.warning("state download from %s failed: %r", peer, e)
        finally:
            if not future.done():
                future.set_result(None)

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], None]:
        metadata, tensors = self._state_provider()
        return metadata, tensors, None


def _declared(found: Any) -> list[tuple[PeerID, ValueWithExpiration]]:
    """The state donors an ``all_averagers`` read found, each with its declaration (well-formed ones only)."""
    if not isinstance(found, dict):
        return []
    declared = []
    for subkey, info in found.items():
        if not (isinstance(info, ValueWithExpiration) and isinstance(info.value, float | int)):
            continue
        try:
            declared.append((PeerID(subkey), info))
        except Exception:  # a subkey that is no peer id
            continue
    return declared


def whole_tensor(parts: list[Any]) -> torch.Tensor:
    """One streamed tensor from its chunks; a stream that ended early (the donor left or its link broke) ends
    quietly in hivemind, so count the chunks instead of failing later on a tensor of the wrong size."""
    if len(parts) != max(1, parts[0].chunks):  # an empty tensor still sends one (empty) chunk
        raise ConnectionError(f"the state stream ended after {len(parts)} of {parts[0].chunks} chunks of a tensor")
    return deserialize_torch_tensor(combine_from_streaming(parts))


def outer_step_key(outer_step: int) -> str:
    """Group-key bits for an outer step: only peers at the same outer step can be matched together."""
    return format(outer_step, "b")
