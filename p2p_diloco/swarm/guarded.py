"""The averager a peer runs in a swarm it cannot trust: robust reducers, checked results, members only.

Built on averaging.py's exact all-reduce (same bytes for every peer), with guarded_runner.py's runner (robust
reducers; every averaged part checked before it is applied, a bad one failing the round on our side: "partial
all-reduce", the failed-round path, after which the learner catches up from the swarm).

- ``GuardedAverager``: passes the weight limits for the round to its runner, hands the rejections back to the
  parent process, and in a closed run (``membership``) refuses every averaging RPC from a non-member. A reducer
  that returned bad averages is banned: never led by, never let into a group we lead, and named in each of our
  group requests, so that it reduces no part in any group with us in it (``bans.demote_reducers``), even one
  that a groupmate who has not banned it let it into.

With ``cross_check`` every round runs a second all-reduce over the same values, each share reduced by another
reducer, and is applied only where both agree (core/cross_check.py, docs/design.md §7).

It does not decide who is a member (membership.py) nor what a failed round means (the learner does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import multiprocessing as mp
from collections.abc import Sequence
from typing import Any, AsyncIterator  # noqa: UP035 -- hivemind reads RPC stream types from typing.AsyncIterator only

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.mpfuture import MPFuture

from p2p_diloco.core.bans import demote_reducers
from p2p_diloco.core.cross_check import agreed_limits, disagreeing_shares, second_order, suspects
from p2p_diloco.core.robust import RobustPolicy
from p2p_diloco.swarm.averaging import DilocoAverager, PartialRoundError
from p2p_diloco.swarm.guarded_runner import GuardedAllReduceRunner, RobustPartReducer, RoundGuard, declared_part_norms

__all__ = ["GuardedAllReduceRunner", "GuardedAverager", "RobustPartReducer", "RoundGuard"]

logger = logging.getLogger(__name__)


class GuardedAverager(DilocoAverager):
    """DilocoAverager with ``GuardedAllReduceRunner`` and membership checks; see the module docstring.

    ``membership``: an object with ``async refusal(peer_id, what) -> str | None`` (None: admitted), or None for an
    open run. ``policy``: the robust thresholds.
    """

    def __init__(self, *args: Any, membership: Any = None, policy: RobustPolicy | None = None, cross_check: bool = False,
                 **kwargs: Any):
        self.membership, self.policy, self.cross_check = membership, policy or RobustPolicy(), cross_check
        self._allowed: dict[str, float] = {}
        self._view: dict[str, float] = {}  # the parent's copy of the weight limits, declared when cross-checking
        self._banned: set[str] = set()  # reducers that returned a bad average: never grouped with again (this process)
        self._shunned: frozenset[str] = frozenset()  # peers most of the swarm banned: treated like ours (not named)
        # rounds in which each reducer returned a bad average: a peer that caught up a moment ago sends a tiny
        # outer gradient, and an honest average can then look 100x too large to it once; a garbage reducer does
        # it every round. So a reducer is banned at its second bad round (at once for a non-finite or misshapen
        # one, or one more than result_ban_excess times over the limit)
        self._strikes: dict[str, int] = {}
        # child -> parent, one per all-reduce: its (peer, reason) list and the senders our reducer left out
        self._rejections = mp.SimpleQueue()
        self._left_out_here: frozenset[str] = frozenset()  # the parent's copy of the latest all-reduce's left-out
        self._bans = mp.SimpleQueue()  # child -> parent: each peer id as it is banned
        self._banned_here: set[str] = set()  # the parent's copy of ``_banned``
        self._demoted_before: set[str] = set()  # peers we saw demoted already (logged once)
        kwargs.setdefault("runner_class", GuardedAllReduceRunner)
        super().__init__(*args, **kwargs)

    def set_allowed_weights(self, allowed: dict[str, float], shunned: frozenset[str] = frozenset()) -> None:
        """Weight limits (peer id -> tokens its progress supports) for the next all-reduce, and the peers that most
        of the swarm banned: refused as leaders and joiners like our own banned peers, but not named in our group
        requests (a groupmate demotes only on its own evidence or that of someone in the group)."""
        self._view = dict(allowed)  # declared with our group requests when cross-checking (agreed_limits)
        future = MPFuture()
        self._outer_pipe.send(("_set_allowed_weights", [], dict(allowed=dict(allowed), shunned=frozenset(shunned), future=future)))
        future.result(timeout=30)

    async def _set_allowed_weights(self, allowed: dict[str, float], future: MPFuture, shunned: frozenset[str] = frozenset()) -> None:
        self._allowed, self._shunned = allowed, shunned
        future.set_result(None)

    def take_rejections(self) -> list[tuple[str, str]]:
        """Rejections of the all-reduces since the last call (oldest first), as (peer id, reason); the senders the
        latest of them left out are then ``left_out_senders()``."""
        found: list[tuple[str, str]] = []
        while not self._rejections.empty():
            rejected, left_out = self._rejections.get()
            found.extend(rejected)
            self._left_out_here = frozenset(left_out)
        return found

    def left_out_senders(self) -> frozenset[str]:
        """(Parent process) the senders whose parts our reducer left out of the latest all-reduce that
        ``take_rejections`` collected (non-finite, misshapen, far too large, or an unusable weight)."""
        return self._left_out_here

    def banned_peers(self) -> frozenset[str]:
        """(Parent process) the peers our averager banned so far, reducers that returned bad averages. The swarm
        link stops counting them as live (no group waits for them, no round budget includes them), and each
        group request carries them, so that no group with one of us in it lets them reduce (``demote_reducers``)."""
        while not self._bans.empty():
            self._banned_here.add(self._bans.get())
        return frozenset(self._banned_here)

    def step(self, gather: Any = None, **kwargs: Any) -> Any:
        if isinstance(gather, dict):
            gather = {**gather, "banned": sorted(self.banned_peers()), "cross_check": self.cross_check}
            if self.cross_check:
                gather["view"] = self._view
        return super().step(gather=gather, **kwargs)

    def _gathered(self, group_info: Any) -> list[dict]:
        """Each member's own data from its group request (``run_averaging``'s gather), {} where unreadable."""
        found: list[dict] = []
        for entry in group_info.gathered:
            try:
                user = self.serializer.loads(self.serializer.loads(entry)[2])
            except Exception:  # hivemind parsed the same bytes before us: only a hostile entry gets here
                user = None
            found.append(user if isinstance(user, dict) else {})
        return found

    def _weight_ratio(self, group_info: Any, gathered: list[dict], guard: RoundGuard) -> float:
        """The largest weight a groupmate declared (bounded by its published progress) over ours; 1 if unknown."""
        names = [peer.to_base58() for peer in group_info.peer_ids]
        own = names.index(self.peer_id.to_base58()) if self.peer_id in group_info.peer_ids else None
        weights = []
        for name, data in zip(names, gathered):
            weight = data.get("weight")
            if not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
                weights.append(0.0)
                continue
            limit = guard.allowed.get(name)
            weights.append(min(float(weight), limit * guard.policy.weight_margin) if limit is not None else float(weight))
        if own is None or weights[own] <= 0:
            return 1.0
        return max(weights) / weights[own]

    def _demote_banned(self, group_info: Any, gathered: list[dict], fractions: Sequence[float]) -> tuple[float, ...]:
        """The reducer shares of this group once the peers a groupmate banned are given none (robust.py)."""
        peer_ids = [peer.to_base58() for peer in group_info.peer_ids]
        bans = [data.get("banned") for data in gathered]
        demoted_fractions, demoted = demote_reducers(peer_ids, fractions, bans)
        for peer, accusers in demoted.items():
            (logger.info if peer not in self._demoted_before else logger.debug)(
                "%s reduces no part in this group: banned by %s", peer, accusers
            )
            self._demoted_before.add(peer)
        return demoted_fractions

    async def _run_allreduce_inplace_(self, tensors: Sequence[torch.Tensor], group_info: Any, group_id=None, **kwargs):
        gathered = self._gathered(group_info)
        names = [peer.to_base58() for peer in group_info.peer_ids]
        # cross-checking, both reducers of a share must clamp weights alike: by the limits the group agrees on
        allowed = agreed_limits(names, [data.get("view") for data in gathered]) if self.cross_check else dict(self._allowed)
        guard = RoundGuard(self.policy, allowed)
        guard.weight_ratio = self._weight_ratio(group_info, gathered, guard)
        guard.part_norms = [declared_part_norms(data.get("part_norms")) for data in gathered]
        if "peer_fractions" in kwargs:
            kwargs["peer_fractions"] = self._demote_banned(group_info, gathered, kwargs["peer_fractions"])
        group_id = group_info.group_id if group_id is None else group_id
        # cross-checked (core/cross_check.py): the same values averaged a second time, each share by another reducer
        reducers = [name for name, f in zip(names, kwargs.get("peer_fractions", ()), strict=False) if f > 0]
        checking = self.cross_check and len(reducers) >= 2
        check_id = group_id + b".cross-check"
        if checking:  # registered before the first all-reduce: a groupmate may begin the second one before us
            self._running_groups[check_id] = asyncio.get_running_loop().create_future()
        try:
            refusal = self._uncheckable(gathered, reducers) if self.cross_check else None
            if refusal is not None:
                raise PartialRoundError(f"partial all-reduce: {refusal}")
            originals = [tensor.detach().clone() for tensor in tensors] if checking else []
            await super()._run_allreduce_inplace_(tensors, group_info, group_id, guard=guard, **kwargs)
            if checking:
                share_values = self._running_groups[group_id].result().share_values  # the first all-reduce's runner
                try:
                    await self._cross_check(tensors, originals, group_info, names, check_id, share_values, guard, kwargs)
                except BaseException:  # a second all-reduce that failed or disagreed: the first's average is unchecked
                    for tensor, original in zip(tensors, originals, strict=True):
                        tensor.copy_(original)
                    raise
        except PartialRoundError as e:
            if not guard.bad_results:
                raise
            raise PartialRoundError(f"{e}; refused the averages of {', '.join(dict.fromkeys(guard.bad_results))}") from None
        finally:
            second = self._running_groups.pop(check_id, None)
            if second is not None and not second.done():
                second.cancel()  # a groupmate's parts waiting for our second all-reduce: there is none
            self._rejections.put((sorted(guard.rejected.items()), sorted(guard.left_out)))
            for reducer in dict.fromkeys(guard.bad_results):
                self._strikes[reducer] = self._strikes.get(reducer, 0) + (1 if reducer in guard.one_strike else 2)
                if self._strikes[reducer] >= 2 and reducer not in self._banned:
                    logger.warning("banning %s from our averaging groups: returned bad averages", reducer)
                    self._banned.add(reducer)
                    self._bans.put(reducer)

    def _uncheckable(self, gathered: list[dict], reducers: list[str]) -> str | None:
        """Why a cross-checking member must not apply this group's averages at all, or None."""
        if not all(data.get("cross_check") is True for data in gathered):
            # a group that a leader of another setting assembled: its averages would go unchecked
            return "not every member of the group cross-checks its averages"
        if len(reducers) < 2 and reducers != [self.peer_id.to_base58()]:
            # one reducer, not us (the others clients, demoted, or so marked by the leader): nothing to check it against
            return "one reducer in the group, so its averages cannot be cross-checked"
        return None

    async def _cross_check(self, tensors: Sequence[torch.Tensor], originals: list[torch.Tensor], group_info: Any,
                           peers: list[str], check_id: bytes, share_values: Sequence[int], guard: RoundGuard,
                           kwargs: dict) -> None:
        """The second all-reduce of a cross-checked round, over ``originals`` (our values before the first), each share
        reduced by the next reducer (``second_order``); if any share's two averages differ the round fails (the caller
        gives ``tensors`` their original values back), with a strike against the reducer(s) it shows to have lied.
        ``peers``: the group's peer ids in its order."""
        order = second_order(peers, kwargs["peer_fractions"])
        by_name = dict(zip(peers, group_info.peer_ids, strict=True))
        second_info = dataclasses.replace(group_info, peer_ids=tuple(by_name[name] for name in order))
        second = [tensor.clone() for tensor in originals]
        await super()._run_allreduce_inplace_(second, second_info, check_id, guard=guard, **kwargs)
        first_flat = torch.cat([tensor.detach().reshape(-1) for tensor in tensors])
        positions = disagreeing_shares(first_flat, torch.cat([t.reshape(-1) for t in second]), share_values,
                                       self.policy.cross_check_tolerance)
        if not positions:
            return
        for peer in sorted(suspects(positions, peers, order, self.peer_id.to_base58())):
            guard.reject(peer, "its average of a share differed from the other reducer's")
            guard.bad_results.append(peer)
            guard.one_strike.add(peer)  # one strike a round: two ban
        pairs = ", ".join(f"{peers[p]}/{order[p]}" for p in positions)
        raise PartialRoundError(f"partial all-reduce: the two reducers of {len(positions)} share(s) returned different averages ({pairs})")

    async def _set_round(self, group_bits: str, target: int | None, future: MPFuture) -> None:
        self._skip_banned_leaders()
        await super()._set_round(group_bits, target, future)

    def _skip_banned_leaders(self) -> None:
        """Never ask a banned peer to lead our group (hivemind's follower side; its redirects go through here too).
        Banned peers asking to join our group are refused in ``rpc_join_group``."""
        matchmaking = self._matchmaking
        if getattr(matchmaking, "_skips_banned", False):
            return
        request_join_group = matchmaking._request_join_group

        async def unless_banned(leader: PeerID) -> Any:
            excluded = leader.to_base58() in self._banned or leader.to_base58() in self._shunned
            return None if excluded else await request_join_group(leader)

        matchmaking._request_join_group = unless_banned
        matchmaking._skips_banned = True

    def _declared(self, data_for_gather: bytes | None) -> tuple[object, object, object]:
        """(outer step, base, cross-check) from a group request's data; None for each that is unreadable."""
        try:
            user = self.serializer.loads(self.serializer.loads(data_for_gather)[2])
        except Exception:
            return None, None, None
        return (user.get("outer_step"), user.get("base"), user.get("cross_check")) if isinstance(user, dict) else (None, None, None)

    def _same_outer_step(self, joiner_gather: bytes) -> bool:
        """Whether a joiner declares the outer step we are averaging and, if we declared one, the same base (the
        sha256 of the global params its outer gradient was measured from), and whether it cross-checks as we do (a
        group must run the same number of all-reduces). True while we average none: hivemind decides."""
        control = getattr(self._matchmaking, "step_control", None)
        step, base, cross = self._declared(control.data_for_gather) if control is not None else (None, None, None)
        if step is None:
            return True
        joiner_step, joiner_base, joiner_cross = self._declared(joiner_gather)
        return joiner_step == step and (base is None or joiner_base == base) and bool(joiner_cross) == bool(cross)

    async def _refused(self, peer: PeerID, what: str, banned_too: bool = True, shunned_too: bool = True) -> bool:
        if banned_too and peer.to_base58() in self._banned:
            return True
        if banned_too and shunned_too and peer.to_base58() in self._shunned:
            return True
        if self.membership is None:
            return False
        reason = await self.membership.refusal(peer, what)
        return reason is not None

    # hivemind builds its RPC table from these annotations
    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if await self._refused(context.remote_id, "join an averaging group"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        if not self._same_outer_step(request.gather):
            # the group key says which outer step a group averages, but a search cancelled late, or a hostile
            # peer, can come in under our key with another step: the whole group would then fail the round. A
            # peer at our step on other global params (a fork: another group averaged that step to other bytes)
            # would mix an outer gradient measured from other params into ours
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.BAD_GROUP_KEY)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        # a banned peer in our group (a groupmate that has not banned it let it in) still sends: its parts are
        # checked like anyone's, and refusing them would only make every reducer wait for it until its timeout
        if await self._refused(context.remote_id, "send parts", banned_too=False):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        # a peer most others banned still gets the state from us: if they were wrong, it can catch up and train on
        # the swarm's params with whoever groups with it (we never saw it misbehave)
        if await self._refused(context.remote_id, "download the state", shunned_too=False):
            return  # nothing: the asker moves on to the next donor
        async for message in super().rpc_download_state(request, context):
            yield message
