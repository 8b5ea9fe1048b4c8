"""The swarm as one peer sees it: a thin façade over a hivemind DHT and averager, and pure policies.

``SwarmLink`` is what the learner talks to (core/link.py ``Link``). It owns the DHT, the averager and the progress
beacon (swarm/progress.py), and carries out what core/swarm_view.py decides from the others' records: whom to count,
when a round is over, how often to publish, which state to take and whom to ban. It averages outer gradients with
the peers at the same outer step (swarm/averaging.py, swarm/guarded.py) and downloads and verifies state (core/
verify.py). It does not train, and it holds no policy about what a failed round means: it reports what happened.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.core import history
from p2p_diloco.core.compression import make_codec
from p2p_diloco.core.config import SwarmConfig
from p2p_diloco.core.feedback import FEEDBACK_CODECS, ErrorFeedback, ReducerFeedback
from p2p_diloco.core.link import AveragingOutcome, RoundView, SwarmState, codec_round_trip
from p2p_diloco.core.robust import total_norm
from p2p_diloco.core.swarm_view import OuterNorms, ProgressPace, SwarmView, typical_tokens
from p2p_diloco.core.verify import verified_state
from p2p_diloco.swarm.guarded import GuardedAllReduceRunner, GuardedAverager
from p2p_diloco.swarm.hivemind_api import CALL_FAILED
from p2p_diloco.swarm.joining import SwarmStartError, first_line, join_swarm, peer_ids_in
from p2p_diloco.swarm.membership import RunMembership
from p2p_diloco.swarm.processes import (
    close_dht,
    cpu_seconds,
    descendants,
    kill_if_alive,
    lower_priority,
    lower_this_thread,
)
from p2p_diloco.swarm.progress import ProgressBeacon, ProgressReader
from p2p_diloco.swarm.round import run_averaging
from p2p_diloco.swarm.wire import WireCodec, part_norms_of, part_values_for

logger = logging.getLogger(__name__)
DONOR_DECLARE_S = 60.0  # how long a state donor's declaration lives; it is renewed as it expires


class SwarmLink:
    """The learner's connection to the swarm; see the module docstring."""

    runner_class: type[GuardedAllReduceRunner] = GuardedAllReduceRunner  # experiments/adversary.py swaps in its own
    declared_priority = 0.0  # a donor's word on how early to ask it, after what its records say it holds (adversaries')

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
        self._fragments = fragments
        self._norms = OuterNorms(fragments)  # our recent outer gradients' norms, and the swarm's reference (§7)
        self._template_shapes = [tuple(t.shape) for t in template]  # what one averaging carries (a served average too)
        logger.info(membership.describe())
        self.codec = make_codec(config.compression)
        # one residual per streaming fragment: outer step r carries fragment r % fragments
        self._error_feedback = [ErrorFeedback(self.codec) for _ in range(fragments)] if config.compression in FEEDBACK_CODECS else None
        self._averager: GuardedAverager | None = None
        # what we know of the others and decide from their records (pure: core/swarm_view.py); a fresh peer breaks
        # a tie by the word of the peers it was told to join through
        self.view = SwarmView(self.peer_id, peer_ids_in(config.initial_peers), config.progress_period_s, config.idle_period_s,
                              config.round_share_cap)
        self._pace = ProgressPace(config.progress_period_s, config.idle_period_s, config.progress_ttl_s)
        self._beacon: ProgressBeacon | None = None
        self._background_pids: list[int] | None = None  # the DHT's and averager's processes and theirs (background_cpu_s)
        self._averaging_in_flight = False
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
                cross_check=config.cross_check,
                reducer_feedback=ReducerFeedback(self.codec, fragments) if config.compression in FEEDBACK_CODECS
                and config.reducer_feedback and not config.cross_check else None,
                membership=membership.check(self.dht, self._progress_key),
                prefix=f"{config.run_id}_averaging",
                start=True,
                min_matchmaking_time=config.matchmaking_time_s,
                request_timeout=min(1.0, config.matchmaking_time_s / 2),
                next_chunk_timeout=config.chunk_timeout_s,
                allreduce_timeout=config.averaging_timeout_s,
                client_mode=client,  # reduces no part; hivemind leaves its share to the others
                allow_state_sharing=not client,
                # a donor's declaration only says it serves states; which state it holds, its progress records say
                # (download_state): declared once a minute, not at every outer step (docs/design.md §4, "Catch-up")
                declare_state_period=DONOR_DECLARE_S,
                shutdown_timeout=5,
            )
            self._beacon = ProgressBeacon(
                self.dht,
                self._progress_key,
                config.progress_period_s,
                config.progress_ttl_s,
                self._read_progress,
                bootstrap=config.initial_peers,
                pace=self._next_period,
                push=self._push,
                nice=config.background_nice,
            )
            lower_priority(config.background_nice, [p.pid for p in (self.dht, self._averager) if p.pid is not None])
            if self.declared_priority and not client:
                self._averager.state_sharing_priority = self.declared_priority
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
        """Set fields of this peer's progress record (ProgressBeacon.set); a new outer step goes out at once, and
        makes this peer a donor of that step."""
        assert self._beacon is not None
        self._beacon.set(**fields)
        if "outer_step" in fields:
            self._beacon.publish_now()

    def reported_sha256(self, outer_step: int) -> dict[str, str]:
        """The state sha256 each live peer reports for ``outer_step``, by peer id."""
        return history.reported_sha256(self.live_peers(), outer_step)

    def made_sha256(self, outer_step: int) -> dict[str, str]:
        """The state sha256 each live peer says it computed for ``outer_step`` in its group, by peer id."""
        return history.made_sha256(self.live_peers(), outer_step)

    def swarm_target(self, chain: Sequence[history.Node], fresh: bool) -> history.Target | None:
        """The state this peer should take, by what the live peers vouch for (SwarmView.target)."""
        banned = self.view.history_banned
        target = self.view.target(self._all_progress(), chain, fresh, silent_s=self._reader.silent_s,
                                  gone=self._reader.expired)
        if self.view.history_banned != banned:
            self._publish_bans()
        return target

    def refuse_donor(self, donor: str, reason: str) -> None:
        """A state the learner could not verify (SwarmView.refuse_donor)."""
        banned = self.view.history_banned
        self.view.refuse_donor(donor, reason)
        if self.view.history_banned != banned:
            self._publish_bans()

    def _publish_bans(self) -> None:
        if self._beacon is not None:  # the others take our word for it once most of them agree
            self._beacon.update(banned=self.view.bans())

    def live_peers(self) -> dict[str, dict]:
        """Progress records of the other peers whose record has not expired, who have not said they left and whom
        we count (SwarmView.live)."""
        return self.view.live(self._all_progress())

    def _all_progress(self) -> dict[str, dict]:
        """The other peers' unexpired progress records, banned peers' included; the beacon's last read if the DHT
        does not answer."""
        try:  # bounded: a DHT process that died (or a p2pd that did) must not hang the training loop
            return self._reader()
        except CALL_FAILED as e:
            logger.debug("reading progress records failed: %r", e)
            return dict(self._beacon.peers) if self._beacon is not None else {}

    def progress_records(self) -> dict[str, dict]:
        """This peer's progress record and the others' as of the beacon's last read (no DHT access: for watchers)."""
        beacon = self._beacon
        if beacon is None:
            return {}
        return {self.peer_id: beacon.own_record(), **beacon.peers}

    def peers_behind(self, outer_step: int) -> int:
        """Live peers we count whose last progress record is at an earlier outer step (as of the beacon's last read)."""
        beacon = self._beacon
        if beacon is None:
            return 0
        return self.view.behind(dict(beacon.peers), outer_step)

    # averaging ------------------------------------------------------------------------------------

    def average(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> AveragingOutcome:
        """Average with the live peers of this outer step; alone in the swarm, the group is just us.

        Peers that are alive but behind are waited for (they catch up by downloading state and join this
        outer step), so that a fast peer never runs off on its own while others are there.
        """
        self._averaging_in_flight = True  # progress records go fast meanwhile (ProgressPace)
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
        averager = self._averager  # close() may clear the attribute meanwhile (a SIGTERM while we average)
        assert averager is not None
        allowed = self.view.ledger.allowed(outer_step, rounds=2 * self._fragments)
        try:
            averager.take_rejections()  # left over from an abandoned attempt
            averager.set_allowed_weights(allowed, self.view.shunned | self.view.history_banned)
        except CALL_FAILED as e:  # the averager process is gone or stuck: run_averaging reports it
            logger.debug("could not pass the weight limits to the averager: %r", e)
        base = self._base()
        fragment, own_norm = outer_step % self._fragments, total_norm(tensors)
        self._norms.sent(fragment, own_norm)
        if self._beacon is not None:  # the others' reference for a group average
            self._beacon.update(outer_norms=self._norms.published())
        target, quiet = self.view.group_target(live, self._reader.silent_s)
        if quiet:
            logger.debug("not waiting for %s: no renewed progress record of late", ", ".join(quiet))
        outcome = run_averaging(
            averager, tensors, weight, outer_step, self.config.averaging_timeout_s, target,
            lambda: self._moved_past(outer_step), base=str(base) if base else None,
            part_norms=part_norms_of(tensors, averager.wire_codec.part_values),
        )
        rejected = tuple(averager.take_rejections())
        if outcome.averaged is not None:
            self.view.participants = self.view.participants | set(outcome.peers)
        banned = averager.banned_peers()
        if banned != self.view.banned:
            self.view.banned = banned
            self._publish_bans()
        self.view.left_out = averager.left_out_senders()
        if rejected:
            outcome = dataclasses.replace(outcome, rejected=rejected)
        if outcome.averaged is not None and len(outcome.peers) > 1:
            # the rounds our weight stands for (Rounds.weight), not the two that bound a declared weight
            round_tokens = self.view.ledger.allowed(outer_step, rounds=self._fragments)
            outcome = self._norms.checked(outcome, live, fragment, own_norm, averager.policy, weight, round_tokens,
                                          self._typical_tokens(len(live)))
        return outcome

    def norm_reference(self, outer_step: int, own_norm: float, own_tokens: float = 0.0) -> float | None:
        """The reference norm for ``outer_step``'s fragment, as of the beacon's last read, with ``own_norm`` ours from
        ``own_tokens`` (OuterNorms.reference): what a next step served to us is checked against (catch_up.py)."""
        beacon = self._beacon
        if beacon is None:
            return None
        live = self.view.live(dict(beacon.peers))
        return self._norms.reference(live, outer_step % self._fragments, own_norm, own_tokens,
                                     self.view.ledger.allowed(outer_step, rounds=self._fragments),
                                     typical_tokens=self._typical_tokens(len(live)))

    def _typical_tokens(self, others: int) -> float:
        return typical_tokens(self._beacon.own_record() if self._beacon is not None else {}, self._fragments, others)

    def _base(self) -> str | None:
        """The sha256 of the state our outer gradient was measured from: the one we last published."""
        beacon = self._beacon
        return beacon.own_record().get("global_sha256") if beacon is not None else None

    def _read_progress(self) -> dict[str, dict]:
        """The live peers' progress records, with the tokens each published noted (SwarmView.observe)."""
        return self.view.observe(self._all_progress(), get_dht_time())

    def _moved_past(self, outer_step: int) -> bool:
        """A group for ``outer_step`` will not form any more (SwarmView.moved_past); closing: abandon it."""
        beacon = self._beacon
        if beacon is None:
            return True
        return self.view.moved_past(dict(beacon.peers), beacon.own_record(), outer_step, self._reader.silent_s)

    def average_async(self, tensors: Sequence[torch.Tensor], weight: float, outer_step: int) -> Future:
        """Start averaging in a background thread and return at once; the future holds the outcome."""
        future: Future = Future()
        tensors = [t.detach().clone() for t in tensors]

        def work() -> None:
            lower_this_thread(self.config.background_nice)  # compression, hashing, copies: after the training
            try:
                future.set_result(self.average(tensors, weight, outer_step))
            except CALL_FAILED as e:  # a bug, not a network failure: a failed round, loudly
                logger.exception("averaging crashed")
                future.set_result(AveragingOutcome(None, (), 0.0, "error", f"{type(e).__name__}: {e}"))

        threading.Thread(target=work, name=f"averaging-{outer_step}", daemon=True).start()
        return future

    def refresh(self) -> None:
        """Read the others' progress records now (a local read: pushed records are already here)."""
        if self._beacon is not None:
            self._beacon.read_now()

    def round_view(self, round_index: int) -> RoundView:
        """The others' progress in ``round_index``, as of the beacon's last read (SwarmView.round_view)."""
        assert self._beacon is not None
        return self.view.round_view(dict(self._beacon.peers), round_index, get_dht_time(), self._beacon.own_record())

    def _next_period(self) -> float:
        """The beacon's next period (ProgressPace), which also bounds how far records are extrapolated."""
        beacon = self._beacon
        if beacon is None:
            return self.config.progress_period_s
        period = self._pace.next_period(beacon.own_record(), dict(beacon.peers), self._averaging_in_flight,
                                        time.monotonic(), get_dht_time())
        self.view.period_now_s = period
        return period

    def average_alone(self, tensors: Sequence[torch.Tensor], weight: float) -> AveragingOutcome:
        # a group of one still goes through the codec, exactly as its own reducer would encode the result
        return AveragingOutcome(codec_round_trip(self.codec, tensors), (self.peer_id,), weight, "ok")

    def traffic(self) -> tuple[int, int]:
        assert self._averager is not None
        return self._averager.traffic.totals()

    def states_served(self) -> tuple[int, int]:
        """States this peer's averager served to peers catching up, and their bytes (what its rounds do not count)."""
        return self._averager.traffic.served() if self._averager is not None else (0, 0)

    def background_cpu_s(self) -> float | None:
        """CPU seconds this peer's DHT and averager processes and theirs (``p2pd``) have used since they started:
        what the peer's background takes from a busy machine (docs/benchmarks.md, "Where a peer's time goes")."""
        if self._background_pids is None:  # the family once (p2pd starts with the DHT): /proc is read per record
            roots = [p.pid for p in (self.dht, self._averager) if p is not None and p.pid is not None]
            self._background_pids = [*roots, *(child for root in roots for child in descendants(root))]
        return cpu_seconds(self._background_pids, with_descendants=False) if self._background_pids else None

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
                # who holds the target first, as their records say; the records are anyone's word, the bytes
                # are checked below
                loaded = self._averager.load_state_excluding(timeout=remaining, exclude=sorted(refused),
                                                             prefer=history.donor_ranks(self.live_peers(), target))
            except CALL_FAILED as e:
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
            state = verified_state(metadata, tensors, shapes, self._template_shapes, donor, target)
            if isinstance(state, SwarmState):
                self.view.participants = self.view.participants.union(*state.round_history.values())
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

    def close(self) -> None:
        """Leave the swarm: say so in the progress record, stop publishing, shut the averager and the DHT (and
        its p2pd) down."""
        if self._beacon is not None:
            self._beacon.leave()
            self._beacon = None
        if self._averager is not None:
            if self._averager.is_alive():
                self._averager.shutdown()
            kill_if_alive(self._averager)
            self._averager = None
        if self.dht is not None:
            close_dht(self.dht)
            self.dht = None
