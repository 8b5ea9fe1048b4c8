"""One learner island: the decoupled DiLoCo loop of docs/design.md §2.

    loop (one inner step at a time):
      inner AdamW step on this peer's shard; round_tokens += tokens
      if the averaging started earlier has returned:
          ok     -> global_params <- NesterovSGD(global_params, average)
                    local_params  <- global_params + (local_params - snapshot)   # keep the work done meanwhile
          failed -> nothing to undo: the progress stays in local_params and flows into the next outer gradient
      if the swarm's round is over (its tokens reached the round's budget, or a deadline passed):
          (wait for the previous averaging if it is still in flight: the only time compute waits)
          catch up if the swarm moved on or holds other bytes for our outer step
          snapshot = local_params; outer_grad = global_params - snapshot
          weight = tokens of our round(s) at the outer steps it stands for (1 step; P with P streaming fragments)
          start averaging outer_grad in the background, keep training

A failed or partial round is a value handled in ``_complete_averaging``, never an exception unwinding the
loop. The learner talks to the swarm only through ``Link``; it does not know hivemind exists.

A multi-rank island (island.py) runs this loop on rank 0 and ``follow`` on the other ranks: the same inner
steps, with rank 0's decisions and state broadcast at every inner step boundary (``_sync_island``). The outer
machinery reads and writes the local params through ``island.local_params()``: the model's own params, or with
FSDP rank 0's full copy of them, gathered from the ranks' shards on demand.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from p2p_diloco import checkpoint
from p2p_diloco.config import PeerConfig
from p2p_diloco.data import DataSource
from p2p_diloco.history import CHAIN, Node
from p2p_diloco.island import Control, Island
from p2p_diloco.link import AveragingOutcome, Link, LocalLink, SwarmState
from p2p_diloco.metrics import MetricsSink
from p2p_diloco.model import build_model
from p2p_diloco.outer import OuterOptimizer, Segment, state_sha256
from p2p_diloco.verify import next_step_problem
from p2p_diloco.watch import pack_stats

logger = logging.getLogger(__name__)
ROUND_HISTORY = 32  # outer steps whose group members a peer remembers and serves with its state
PEAK_WINDOW_S = 1.0  # the window of the largest-burst figure (peak_send_bytes_per_s)


def partition_fragments(params: list[torch.Tensor], count: int) -> list[list[Segment]]:
    """Split the params into ``count`` fragments of whole tensors, balanced by size (largest first into the
    least-filled fragment; ties by position, so every peer computes the same split).

    Whole tensors, because a fragment's outer step moves its tensors at once while the others wait: rows of
    one matrix synced at different times (the tied embedding/output matrix above all, whose rows are the
    logits of different tokens) made the global params inconsistent, and the swarm learned measurably slower
    at equal tokens than with one fragment. Only a tensor larger than one fragment's share (total / count) is
    cut, into contiguous flat slices of at most that share."""
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    if not 1 <= count <= total:
        raise ValueError(f"cannot split params of {total} values into {count} fragments")
    share = total // count  # pieces no larger than this are at least `count` many, so no fragment is empty
    pieces = []
    for index, size in enumerate(sizes):
        cuts = -(-size // share)
        pieces += [Segment(index, size * j // cuts, size * (j + 1) // cuts) for j in range(cuts)]
    loads, fragments = [0] * count, [[] for _ in range(count)]
    for piece in sorted(pieces, key=lambda s: (s.start - s.stop, s.index, s.start)):
        k = min(range(count), key=lambda k: (loads[k], k))
        fragments[k].append(piece)
        loads[k] += piece.stop - piece.start
    return [sorted(fragment) for fragment in fragments]


@dataclass
class PendingAveraging:
    """An averaging in flight: what was sent, and the local params it was computed from."""

    future: Future
    outer_step: int
    weight: float  # the weight declared with the outer gradient
    snapshot: list[torch.Tensor]  # local params of the fragment being averaged, as they were sent (1-D per segment)
    fragment: int = 0
    segments: list[Segment] = field(default_factory=list)  # where the fragment's values lie in model.parameters()
    started: float = field(default_factory=time.monotonic)
    traffic_before: tuple[int, int] = (0, 0)
    steps_during: int = 0  # inner steps this peer ran while the averaging was in flight
    tokens: int | None = None  # tokens of local progress behind the snapshot, which a success syncs (None: the weight)

    @property
    def tokens_behind(self) -> int:
        return int(self.weight) if self.tokens is None else self.tokens


@dataclass
class Interval:
    """Work done between two metrics records."""

    inner_steps: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    compute_s: float = 0.0
    blocked_s: float = 0.0
    longest_block_s: float = 0.0  # the longest single wait of the training loop

    @property
    def mean_loss(self) -> float | None:
        return self.loss_sum / self.inner_steps if self.inner_steps else None


class Learner:
    def __init__(
        self,
        config: PeerConfig,
        dataset: DataSource,
        metrics: MetricsSink,
        stop: threading.Event | None = None,
        island: Island | None = None,
    ):
        self.config = config
        self.dataset, self.metrics = dataset, metrics
        self.stop = stop or threading.Event()
        self.island = island or Island()  # one rank of one by default
        # same seed on every peer: same start bytes
        self.model = build_model(config.model, config.run.seed)
        # global params and the outer step stay fp32 on the CPU everywhere, so that a GPU island and a CPU peer
        # compute the same bytes (outer.py); values cross between the two devices at the outer step only
        self.global_params = [p.detach().cpu().clone() for p in self.model.parameters()]
        self.eval_model, self.eval_device = self.island.evaluation_model(self.model)
        # local params live on the island's device (a GPU, or the CPU); the inner steps call DDP across the
        # island's ranks, or the model itself (FSDP shards it in place: self.params are then this rank's shards)
        self.train_model = self.island.wrap(self.model)
        self.params = list(self.model.parameters())
        self.inner = torch.optim.AdamW(self.params, lr=config.inner.lr, weight_decay=config.inner.weight_decay)
        self.island.attach(self.model, self.inner, self.global_params)
        self.outer = OuterOptimizer(self.global_params, config.outer)
        self.outer_step = 0
        self.global_sha256 = state_sha256(self.global_params, self.outer.momentum_buffers)  # published: invariant 1
        self.tokens_total = 0
        # streaming fragments (docs/design.md §1, Streaming DiLoCo): outer step r averages fragment r % P only
        self.fragments = partition_fragments(self.global_params, config.inner.fragments)
        self.unsynced_by_fragment = [0] * len(self.fragments)  # tokens of local progress not yet in each fragment
        self.peak_send_rate = 0.0  # bytes/s: the largest ~1 s burst of averaging traffic since the last record
        self._traffic_samples: deque[tuple[float, int]] = deque()  # (time, bytes sent), one per inner step
        self.round_tokens = 0  # tokens this peer processed in the swarm's current round
        self._published_plan: tuple = ()  # (round, budget, its start) last published: what ends this peer's round
        # [outer step, tokens this peer trained in its rounds at that step] for its last outer steps, as many as there
        # are fragments: a fragment's outer gradient stands for that many rounds, and its weight is their tokens
        self.recent_round_tokens: deque[list[int]] = deque(maxlen=len(self.fragments))
        self.round_started = time.monotonic()
        self.steps_into_round = 0
        self.compute_s = self.blocked_s = 0.0
        self.eval_s = 0.0  # time spent evaluating: measurement, neither training nor waiting
        self.catch_ups = self.forks_healed = 0
        # outer steps this peer's own group made whose bytes came out other here than on its groupmates: the same
        # averaged bytes applied to the same state, so this machine's arithmetic differs (docs/design.md §5)
        self.arithmetic_mismatches: list[int] = []
        self.resumed_from: str | None = None
        self.peer_id = "?"
        self.pending: PendingAveraging | None = None
        # an averaging that failed here may still have been applied by the others (a partial all-reduce is
        # partial only for some of the group): it waits here until a downloaded round history says which
        self.unconfirmed: PendingAveraging | None = None
        self.round_history: dict[int, tuple[str, ...]] = {}  # outer step r -> peers whose gradients made r -> r+1
        # our last heads (outer step, state sha256), published for the others to vouch by (history.py)
        self.chain: deque[Node] = deque([(0, self.global_sha256)], maxlen=CHAIN)
        self.fresh = True  # no averaging in a group since we started: our history is our own word only
        # the average that made our current state from the one before (its sha256), served with our state: a peer
        # one step behind recomputes that step from it instead of taking our word (history.py, "next")
        self.parent_sha256: str | None = None
        self.last_average: list[torch.Tensor] | None = None
        self.interval = Interval()
        self._state_lock = threading.Lock()  # guards global state against a concurrent state download
        self._eval_batches = dataset.eval_batches(config.run.eval_batches)
        self._started = time.monotonic()

    @property
    def tokens_unsynced(self) -> int:
        """Tokens behind the next outer gradient: local progress not yet merged into the next fragment to sync."""
        return self.unsynced_by_fragment[self.outer_step % len(self.fragments)]

    def averaging_template(self) -> list[torch.Tensor]:
        """The tensors one averaging carries: the params themselves, or one flat buffer that fits any fragment."""
        if len(self.fragments) == 1:
            return [torch.zeros_like(p) for p in self.global_params]
        return [torch.zeros(max(sum(s.stop - s.start for s in f) for f in self.fragments))]

    def _pack(self, pieces: list[torch.Tensor]) -> list[torch.Tensor]:
        """1-D pieces of one fragment -> the averaging template's tensors."""
        if len(self.fragments) == 1:  # whole tensors: keep their shapes
            return [piece.view(param.shape) for piece, param in zip(pieces, self.global_params)]
        (template,) = self.averaging_template()
        flat = torch.cat(pieces)
        return [torch.cat([flat, template[flat.numel() :]])]  # zero padding: fragments differ by a few values at most

    def _unpack(self, averaged: list[torch.Tensor], segments: list[Segment]) -> list[torch.Tensor]:
        """The averaging template's tensors -> 1-D pieces, one per segment of the fragment."""
        if len(self.fragments) == 1:
            return [tensor.reshape(-1) for tensor in averaged]
        sizes = [s.stop - s.start for s in segments]
        return list(averaged[0][: sum(sizes)].split(sizes))

    @property
    def round_index(self) -> int:
        """The round our current tokens count towards: the next outer step, plus one while averaging."""
        return self.outer_step + (1 if self.pending is not None else 0)

    # served to peers that download our state (called from a background thread)
    def state_for_peers(self) -> tuple[dict, list[torch.Tensor]]:
        with self._state_lock:
            metadata = dict(
                outer_step=self.outer_step,
                global_sha256=self.global_sha256,
                outer_steps_taken=self.outer.steps_taken,
                steps_into_round=self.steps_into_round,
                peer_id=self.peer_id,
                round_history={str(step): list(peers) for step, peers in self.round_history.items()},
                recent=[list(node) for node in self.chain],
                parent_sha256=self.parent_sha256 if self.last_average is not None else None,
            )
            tensors = [t.clone() for t in self.global_params] + [t.clone() for t in self.outer.state_tensors()]
            tensors += [t.clone() for t in self.last_average or []]
        return metadata, tensors

    def run(self, link: Link) -> None:
        """Train until max_outer_steps, max_time_s or ``stop``; writes one metrics record per outer step."""
        self._wait_for_start()
        self._started = time.monotonic()
        self.peer_id = link.peer_id
        resumed = f"resumed from {self.resumed_from}" if self.resumed_from else ""
        self._write(link, AveragingOutcome(None, (), 0.0, "init", resumed))
        self._publish_step(link)
        self._wait_for_peers(link)
        settled = False
        try:
            # first, so that the other ranks wait at the first boundary while rank 0 catches up (FSDP: to serve it)
            self._share_start()
            self._catch_up(link)
            self.round_started = time.monotonic()
            stop = self._sync_island(self._should_stop()).stop
            while not stop:
                self._inner_step(link)
                if self.pending is not None and self.pending.future.done():
                    self._complete_averaging(link)
                if not self._should_stop() and self._round_is_over(link):
                    self._end_round(link)
                stop = self._sync_island(self._should_stop()).stop  # the other ranks of the island do as rank 0 says
            self._settle_pending(link)
            self._confirm_last_step(link)
            settled = True
        finally:
            # an FSDP island's checkpoint gathers from the other ranks: only while they wait at a boundary
            if self.config.run.checkpoint_dir and (settled or not self.island.sharded):
                self.save_checkpoint()
            elif self.config.run.checkpoint_dir:
                logger.warning("no checkpoint at the end: the FSDP island stopped on an error (the last one stays)")
        self._sync_island(True)  # an averaging that landed while settling reaches the other ranks too
        self._serve_stragglers(link)

    def follow(self) -> None:
        """A rank other than 0 of a multi-rank island: the same inner steps as rank 0 (DDP keeps them
        identical) until rank 0 says stop; rank 0's global state replaces ours whenever it changes."""
        self._wait_for_start()
        self._share_start()
        link = LocalLink()  # never used for averaging: only rank 0 talks to the swarm
        control = self._sync_island(False)
        while not control.stop:
            self._inner_step(link)
            control = self._sync_island(False)
            self.outer_step = control.outer_step
        self._sync_island(True)

    def _wait_for_start(self) -> None:
        wait_s = self.config.run.start_at_unix - time.time()
        if wait_s > 0:  # peers launched together begin together (a benchmark's swarms, a planned start)
            logger.info("waiting %.0f s for the agreed start time", wait_s)
            self.stop.wait(wait_s)

    def _wait_for_peers(self, link: Link) -> None:
        """Before the first inner step, wait (bounded by ``wait_for_peers_s``) until ``wait_for_peers`` peers, this
        one included, are in the swarm: peers launched together then train together from the first round, instead
        of the first one up averaging alone (and perhaps finishing) before the others have imported torch. The
        clocks of ``max_time_s`` and tokens/s start after the wait."""
        wanted, run = self.config.run.wait_for_peers, self.config.run
        deadline = time.monotonic() + run.wait_for_peers_s
        present = 1
        while wanted > 1 and not self.stop.is_set():
            present = 1 + link.round_view(self.round_index).live_peers
            if present >= wanted:
                logger.info("%d peers in the swarm: starting", present)
                break
            if time.monotonic() >= deadline:
                logger.warning("%d of the %d peers awaited are in the swarm after %.0f s: starting with them", present,
                               wanted, run.wait_for_peers_s)
                break
            self.stop.wait(0.2)
        self._started = time.monotonic()

    def _share_start(self) -> None:
        """Rank 0's inner optimizer state and data position to the island's other ranks (a resume, say)."""
        self.dataset.train.position = self.island.share_start(self.dataset.train.position)

    def _sync_island(self, stop: bool) -> Control:
        # the followers of a DDP island receive the momentum too: their copy of the shared state hashes like ours
        return self.island.sync(stop, self.outer_step, self.global_sha256, [*self.global_params, *self.outer.momentum_buffers])

    def _settle_pending(self, link: Link) -> None:
        """At the end of a run, give an averaging still in flight a bounded time to land, so that its result
        is applied and recorded (and checkpointed) rather than lost; past that, it is abandoned."""
        if self.pending is None:
            return
        started = time.monotonic()
        wait_s = self.config.run.shutdown_wait_s
        try:
            self.pending.future.result(timeout=wait_s)
        except TimeoutError:
            logger.warning("abandoning the averaging of outer step %d after %.0f s", self.pending.outer_step, wait_s)
            self.pending = None
            return
        finally:
            self._add_blocked(time.monotonic() - started)
        self._complete_averaging(link)

    def _confirm_last_step(self, link: Link) -> None:
        """At the planned end, wait a moment (a few progress periods at most) for the groupmates of our last round to
        report the step it made, and heal a fork there as at any round's end: the last step is checked like the
        others, so that no peer leaves with other bytes than its group's (and none goes unsaid)."""
        run = self.config.run
        groupmates = set(self.round_history.get(self.outer_step - 1, ())) - {link.peer_id}
        if not (run.max_outer_steps and self.outer_step >= run.max_outer_steps and groupmates) or self.stop.is_set():
            return
        deadline = time.monotonic() + max(3.0, 3 * self.config.swarm.progress_period_s)
        while groupmates - set(link.reported_sha256(self.outer_step)) and time.monotonic() < deadline:
            if self.stop.wait(0.2):
                return
        self._catch_up(link)

    def _serve_stragglers(self, link: Link) -> None:
        """At the planned end (max_outer_steps reached, no stop request), stay a bounded while as a state donor
        for live peers still behind: one whose last round failed where the others' succeeded can then catch up
        to the final state, instead of finding no donor and stepping alone onto other bytes (a fork at the
        last step). The other ranks of an island have already left; the averager serves state by itself."""
        run = self.config.run
        planned_end = bool(run.max_outer_steps) and self.outer_step >= run.max_outer_steps
        if not run.straggler_wait_s or not planned_end or self.stop.is_set():
            return
        started = time.monotonic()
        said = False  # peers finishing the same step show as behind until their next record: said only if it lasts
        behind = link.peers_behind(self.outer_step)
        while behind and time.monotonic() - started < run.straggler_wait_s and not self.stop.wait(0.5):
            behind = link.peers_behind(self.outer_step)  # SIGTERM (self.stop) ends the wait at once
            if behind and not said and time.monotonic() - started >= 3.0:
                logger.info("serving state up to %.0f s to %d peers behind outer step %d", run.straggler_wait_s, behind, self.outer_step)
                said = True
        if behind:
            logger.info("leaving with %d peers still behind outer step %d", behind, self.outer_step)
        elif said:
            logger.info("the peers behind reached outer step %d after %.1f s", self.outer_step, time.monotonic() - started)

    def _should_stop(self) -> bool:
        run = self.config.run
        if run.max_outer_steps and self.outer_step >= run.max_outer_steps:
            return True
        if run.max_time_s and time.monotonic() - self._started >= run.max_time_s:
            return True
        return self.stop.is_set()

    def _inner_step(self, link: Link) -> None:
        started = time.monotonic()
        self.model.train()
        inputs, targets = self.dataset.train.next_batch()
        with self.island.autocast():
            loss = self.train_model(inputs.to(self.island.device), targets.to(self.island.device))
        self.inner.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.inner.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.inner.grad_clip_norm)
        self.inner.step()
        self.island.trained()
        if self.config.inner.throttle > 1:  # emulate older hardware: each step takes `throttle` times as long
            time.sleep((self.config.inner.throttle - 1) * (time.monotonic() - started))
        elapsed = time.monotonic() - started
        tokens = inputs.numel() * self.island.size  # the island's tokens: every rank read a batch of its own sub-shard
        self.compute_s += elapsed
        self.tokens_total += tokens
        self.unsynced_by_fragment = [count + tokens for count in self.unsynced_by_fragment]
        self.round_tokens += tokens
        self.steps_into_round += 1
        self.interval.inner_steps += 1
        self.interval.tokens += tokens
        self.interval.loss_sum += loss.item()
        self.interval.compute_s += elapsed
        if self.pending is not None:
            self.pending.steps_during += 1
        self._sample_traffic(link)
        rate = self.round_tokens / max(1e-3, time.monotonic() - self.round_started)
        link.publish(round=self.round_index, round_tokens=self.round_tokens, tokens=self.tokens_total, rate=round(rate, 1))

    def _sample_traffic(self, link: Link) -> None:
        """Track the largest send rate over a sliding window of just over a second, sampled at every inner
        step (the burst that streaming fragments cut)."""
        now, (sent, _) = time.monotonic(), link.traffic()
        samples = self._traffic_samples
        samples.append((now, sent))
        while len(samples) > 2 and samples[1][0] <= now - PEAK_WINDOW_S:
            samples.popleft()  # keep exactly one sample at least a window old
        started, sent_before = samples[0]
        if now - started >= PEAK_WINDOW_S:
            self.peak_send_rate = max(self.peak_send_rate, (sent - sent_before) / (now - started))

    def _round_budget_tokens(self, live_peers: int) -> int:
        """The swarm-wide tokens of one outer step: the round's budget (configured, or H steps of this peer's
        batch per live peer) divided among the fragments, which are averaged one after the other."""
        configured = self.config.inner.tokens_per_round
        per_peer = self.config.inner.inner_steps * self.dataset.train.tokens_per_batch
        return (configured or per_peer * (1 + live_peers)) // len(self.fragments)

    def _round_is_over(self, link: Link) -> bool:
        """The swarm's round ends when its tokens reach the budget, someone already moved on, or at the deadline."""
        view = link.round_view(self.round_index)
        if view.peers_ahead:
            return True
        budget = self._round_budget_tokens(view.live_peers)
        deadline_s = self.config.inner.round_deadline_s
        plan = (self.round_index, budget, self.round_started)
        if plan != self._published_plan:  # the beacons pace their records by how near the round's end is
            self._published_plan = plan
            ends = dict(round_deadline=round(time.time() + deadline_s - (time.monotonic() - self.round_started), 3))
            link.publish(round_budget=budget, **(ends if deadline_s else {}))
        if view.tokens_by_others + self.round_tokens >= budget:
            return True
        return bool(deadline_s) and time.monotonic() - self.round_started >= deadline_s

    def _end_round(self, link: Link) -> None:
        if self.pending is not None:  # the previous averaging is still in flight: the only wait in the loop
            started = time.monotonic()
            while not self.pending.future.done() and not self.stop.is_set():
                wait([self.pending.future], timeout=0.5)  # a stop request (SIGTERM) is honoured within 0.5 s
            self._add_blocked(time.monotonic() - started)
            if not self.pending.future.done():
                return  # stopping: run() gives the averaging a last bounded chance in _settle_pending
            self._complete_averaging(link)
            if self._should_stop():
                return
        # if the swarm moved on, or another group averaged our last outer step to other bytes (a fork),
        # take the swarm's state now; our progress is rebased onto it
        self._catch_up(link)
        fragment = self.outer_step % len(self.fragments)
        segments = self.fragments[fragment]
        local = self.island.local_params()
        snapshot = [s.of(local).detach().clone() for s in segments]
        outer_grads = [s.of(self.global_params) - local.cpu() for s, local in zip(segments, snapshot)]
        # The weight is the tokens of the rounds this outer gradient stands for (docs/design.md §2: w_i = tokens this
        # round), not all the progress it carries. After failed rounds the carried progress is k rounds' worth;
        # weighted by all of it, a mean of deltas counts it k times over: a peer that had chased the swarm for 6
        # rounds declared 296k tokens against the others' 36k and 45k, weighed 66-78% in that outer step even
        # after clamping, and the held-out loss rose 2.219 -> 2.283. Weighted by its round, its carried
        # progress adds what it would have added in each of those rounds.
        # A retry of the same outer step (our last averaging failed and nobody moved on) is the same round: a retry
        # that peers still averaging that step end at once would otherwise weigh a full round by a few steps
        recent = self.recent_round_tokens
        if recent and recent[-1][0] == self.outer_step:
            recent[-1][1] += self.round_tokens
        else:
            recent.append([self.outer_step, self.round_tokens])
        tokens = self.tokens_unsynced
        weight = float(min(tokens, sum(count for _, count in recent)))
        what = f"fragment {fragment + 1}/{len(self.fragments)}" if len(self.fragments) > 1 else "outer gradient"
        carried = f", {tokens - int(weight)} more carried" if tokens > weight else ""
        logger.info("outer step %d: averaging started (%s, weight %d tokens%s)", self.outer_step, what, weight, carried)
        traffic_before = link.traffic()
        future = link.average_async(self._pack(outer_grads), weight=weight, outer_step=self.outer_step)
        self.pending = PendingAveraging(
            future, self.outer_step, weight, snapshot, fragment, segments, traffic_before=traffic_before, tokens=tokens
        )
        self.round_tokens, self.steps_into_round = 0, 0
        self.round_started = time.monotonic()
        if future.done():  # a swarm of one answers at once
            self._complete_averaging(link)

    def _complete_averaging(self, link: Link) -> None:
        """The one place where an averaging's outcome, good or bad, is turned into state."""
        pending, self.pending = self.pending, None
        assert pending is not None
        try:
            outcome: AveragingOutcome = pending.future.result()
        except Exception as e:  # a broken link is a failed round here, not an exception unwinding the loop
            outcome = AveragingOutcome(None, (), 0.0, "error", f"{type(e).__name__}: {e}")
        if outcome.averaged is not None and pending.outer_step != self.outer_step:
            outcome = AveragingOutcome(None, outcome.peers, outcome.weight_total, "stale", "global params moved on")
        if outcome.averaged is not None:
            segments = pending.segments
            local = self.island.local_params()
            with self._state_lock:
                self.parent_sha256, self.last_average = self.global_sha256, [t.clone() for t in outcome.averaged]
                self.outer.step(self._unpack(outcome.averaged, segments), segments)
                self.outer_step += 1
                self.global_sha256 = state_sha256(self.global_params, self.outer.momentum_buffers)
                self.chain.append((self.outer_step, self.global_sha256))
            self.fresh = self.fresh and len(outcome.peers) < 2
            with torch.no_grad():  # local_params <- new_global + (local_params - snapshot): keep the work done since
                for segment, snapshot in zip(segments, pending.snapshot):
                    param = segment.of(local)
                    param.copy_(segment.of(self.global_params).to(param.device) + (param - snapshot))  # new_global if idle
            self.unsynced_by_fragment[pending.fragment] -= pending.tokens_behind
            self._remember_round(pending.outer_step, outcome.peers)
            self.unconfirmed = None
            self._publish_step(link)
        else:
            logger.warning("outer step %d: averaging failed (%s: %s)", pending.outer_step, outcome.status, outcome.reason)
            # a second failed attempt at the same step replaces the first: if the swarm applied one of them, the
            # later snapshot errs towards dropping a little progress rather than counting some twice
            self.unconfirmed = pending
        traffic = [after - before for after, before in zip(link.traffic(), pending.traffic_before)]
        self._write(link, outcome, pending, traffic)
        if outcome.averaged is None:
            self._catch_up(link)  # if nobody advanced, our progress simply flows into the next outer gradient
        if self.config.run.checkpoint_dir and outcome.averaged is not None:
            if self.outer_step % self.config.run.checkpoint_every == 0:
                self.save_checkpoint()

    def _catch_up(self, link: Link) -> bool:
        """Take the state the swarm vouches for (history.py), if it is not ours: ahead of us, other bytes at our step
        (a fork), or, for a partition's smaller side, another history; download it verified, and rebase our local
        progress onto it. A next step that no majority backs is taken only if we recompute it ourselves."""
        if self.pending is not None:
            return False  # never while our own averaging is in flight: its result is still to be applied
        target = link.swarm_target(list(self.chain), self.fresh)
        if target is None:
            return False
        if target.how == "next" and (self.unconfirmed is None or self.unconfirmed.outer_step != self.outer_step):
            return False  # nothing of ours to check the donor's average against: wait for a majority
        if target.step == self.outer_step:
            self._note_arithmetic_mismatch(link)
        started = time.monotonic()
        state = link.download_state([tuple(p.shape) for p in self.global_params], target)
        self._add_blocked(time.monotonic() - started)
        if state is None or (state.outer_step, state.global_sha256) == self.chain[-1]:
            logger.warning("the swarm holds outer step %d (%s); no verified state could be downloaded", target.step, target.how)
            return False
        if state.how == "next":  # the target may have changed while downloading: check what was downloaded
            problem = self._next_step_problem(state) if self.unconfirmed is not None else "nothing of ours to check it by"
            if problem is not None:
                logger.warning("refused the next step served by %s: %s", state.donor, problem)
                link.refuse_donor(state.donor, problem)
                return False
        before = self.outer_step
        forked = state.outer_step <= before  # other bytes at our step, or a history most of the swarm holds
        self._take_state(state, link.peer_id)
        self.catch_ups += 1
        self.forks_healed += int(forked)
        what = ("took the history most of the swarm holds, back at" if state.outer_step < before else
                "healed a fork at" if forked else "caught up to")
        logger.info("%s outer step %d in %.2f s (%s)", what, self.outer_step, time.monotonic() - started, target.how)
        self._publish_step(link)
        status = "fork_healed" if forked else "caught_up"
        self._write(link, AveragingOutcome(None, (), 0.0, status, f"downloaded from {state.donor} ({target.how})",
                                           state.refused_donors))
        if self.config.run.checkpoint_dir:  # a restart after this resumes here, not from before the download
            self.save_checkpoint()
        return True

    def _next_step_problem(self, state: SwarmState) -> str | None:
        """Why we cannot take ``state`` as the step after ours: recomputed from our own state and the average its donor
        serves, it must give its bytes, and that average must pass a reducer result's checks against the outer
        gradient we sent for that step (verify.py)."""
        pending = self.unconfirmed
        assert pending is not None
        sent = [segment.of(self.global_params) - snapshot.cpu() for segment, snapshot in zip(pending.segments, pending.snapshot)]
        averaged = self._unpack(state.last_average, pending.segments) if state.last_average is not None else None
        return next_step_problem(state, self.outer_step, self.global_params, self.outer.momentum_buffers,
                                 self.outer.steps_taken, self.global_sha256, self.config.outer, pending.segments,
                                 averaged, sent)

    def _take_state(self, state: SwarmState, peer_id: str) -> None:
        """Replace our global state by a verified ``state`` and rebase our local progress onto it."""
        applied = self._unconfirmed_was_applied(state, peer_id)
        local = self.island.local_params()
        with torch.no_grad(), self._state_lock:
            if applied is not None:  # that fragment's progress up to the snapshot is in the new global already
                for segment, snapshot in zip(applied.segments, applied.snapshot):
                    piece = segment.of(local)
                    piece.add_((segment.of(self.global_params) - snapshot.cpu()).to(piece.device))
                self.unsynced_by_fragment[applied.fragment] -= applied.tokens_behind
            for param, old, new in zip(local, self.global_params, state.global_params):
                param.add_((new - old).to(param.device))  # local_params <- new_global + (local_params - old_global)
                old.copy_(new)
            self.outer.load_state(state.momentum, state.outer_steps_taken)
            self.outer_step, self.global_sha256 = state.outer_step, state.global_sha256
            self.chain = deque(state.chain or [(state.outer_step, state.global_sha256)], maxlen=CHAIN)
            self.parent_sha256, self.last_average = state.parent_sha256, state.last_average
            for step, peers in state.round_history.items():
                self.round_history.setdefault(step, peers)
            self._trim_history()
        self.unconfirmed = None

    def _note_arithmetic_mismatch(self, link: Link) -> None:
        """Say so, once per outer step, when the swarm holds other bytes for a step that this peer's own group made.

        Every member of a group declared the same state before the step (the base of its group request) and got
        the same averaged bytes back (averaging.py), so a member whose state after it differs from its groupmates'
        computed the step differently: a kernel that breaks the portable arithmetic (docs/design.md §5), or a
        machine that miscomputes. The fork heals by download all the same; this says why it happened."""
        step = self.outer_step
        groupmates = set(self.round_history.get(step - 1, ())) - {link.peer_id}
        if not groupmates or step in self.arithmetic_mismatches:
            return
        reported = {peer: sha for peer, sha in link.reported_sha256(step).items() if peer in groupmates}
        others = sorted({sha for sha in reported.values() if sha != self.global_sha256})
        if not others:
            return
        self.arithmetic_mismatches.append(step)
        differ = sum(sha != self.global_sha256 for sha in reported.values())
        logger.warning(
            "this peer's hardware computed outer step %d differently from %d of %d groupmates (ours %s, theirs %s): "
            "same inputs, other bytes; taking the swarm's state", step, differ, len(reported), self.global_sha256[:12],
            ", ".join(sha[:12] for sha in others),
        )

    def _unconfirmed_was_applied(self, state: SwarmState, peer_id: str) -> PendingAveraging | None:
        """The failed averaging whose outer gradient the swarm applied after all, per the donor's history.

        Without this, a peer whose all-reduce was partial on its side only would carry its progress into the
        next round and have it counted twice. With no history for that step, the progress is carried (the
        round most likely failed for everyone).
        """
        pending = self.unconfirmed
        if pending is None or state.outer_step <= pending.outer_step:
            return None
        if peer_id in state.round_history.get(pending.outer_step, ()):
            logger.info("outer step %d: the swarm applied our outer gradient although our side failed", pending.outer_step)
            return pending
        return None

    def _remember_round(self, outer_step: int, peers: tuple[str, ...]) -> None:
        self.round_history[outer_step] = tuple(peers)
        self._trim_history()

    def _trim_history(self) -> None:
        for step in sorted(self.round_history)[:-ROUND_HISTORY]:
            del self.round_history[step]

    def _add_blocked(self, seconds: float) -> None:
        self.blocked_s += seconds
        self.interval.blocked_s += seconds
        self.interval.longest_block_s = max(self.interval.longest_block_s, seconds)

    def _publish_step(self, link: Link) -> None:
        recent = [list(node) for node in list(self.chain)[:-1]]  # our earlier heads: the others vouch by chains
        link.publish(outer_step=self.outer_step, global_sha256=self.global_sha256, round=self.round_index, recent=recent)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out loss of the *global* params (the model the swarm shares), not of our local progress."""
        model, device = self.eval_model, self.eval_device
        names = [name for name, _ in model.named_parameters()]
        weights = dict(zip(names, (p.to(device) for p in self.global_params)))
        model.eval()
        losses = [
            torch.func.functional_call(model, weights, (inputs.to(device), targets.to(device))).item()
            for inputs, targets in self._eval_batches
        ]
        model.train()
        return sum(losses) / len(losses)

    def _write(
        self,
        link: Link,
        outcome: AveragingOutcome,
        pending: PendingAveraging | None = None,
        traffic: list[int] | None = None,
    ) -> None:
        evaluate = outcome.status == "init" or (outcome.averaged is not None and self.outer_step % self.config.run.eval_every == 0)
        eval_started = time.monotonic()
        eval_loss = self.evaluate() if evaluate else None
        self.eval_s += time.monotonic() - eval_started
        elapsed = time.monotonic() - self._started
        interval, self.interval = self.interval, Interval()
        weight = pending.weight if pending else 0.0
        sent_total, received_total = link.traffic()
        record = dict(
            peer_id=link.peer_id,
            outer_step=self.outer_step,
            status=outcome.status,
            reason=outcome.reason,
            # groupmates whose part, weight or result this peer rejected or clamped, or donors it refused
            rejected_peers=[dict(peer=peer, reason=why) for peer, why in outcome.rejected],
            time_s=round(elapsed, 3),
            unix_time=round(time.time(), 3),  # wall clock: lines up the records of restarted peers
            tokens=self.tokens_total,
            interval_tokens=interval.tokens,
            inner_steps=interval.inner_steps,
            loss=interval.mean_loss,
            eval_loss=eval_loss,
            group_size=len(outcome.peers),
            peers=list(outcome.peers),
            weight=weight,  # the weight this peer declared: the tokens of the rounds its outer gradient stands for
            progress_tokens=pending.tokens_behind if pending else 0,  # the tokens of progress it holds (more after failed rounds)
            weight_total=outcome.weight_total,
            weight_share=round(weight / outcome.weight_total, 4) if outcome.weight_total else None,
            bytes_sent=int(traffic[0]) if traffic else 0,
            bytes_received=int(traffic[1]) if traffic else 0,
            bytes_sent_total=int(sent_total),  # averaging messages since the process started
            bytes_received_total=int(received_total),
            averaging_s=round(time.monotonic() - pending.started, 3) if pending else None,
            steps_during_averaging=pending.steps_during if pending else 0,
            fragment=pending.fragment if pending else None,
            peak_send_bytes_per_s=round(self._take_peak_rate()),
            compute_s=round(self.compute_s, 4),
            blocked_s=round(self.blocked_s, 4),
            eval_s=round(self.eval_s, 4),
            interval_compute_s=round(interval.compute_s, 4),
            interval_blocked_s=round(interval.blocked_s, 4),
            longest_block_s=round(interval.longest_block_s, 4),
            tokens_per_s=round(self.tokens_total / elapsed, 1) if elapsed > 0 else 0.0,
            catch_ups=self.catch_ups,
            forks_healed=self.forks_healed,
            arithmetic_mismatches=len(self.arithmetic_mismatches),  # steps of our own group we computed otherwise
            global_sha256=self.global_sha256,
        )
        self.metrics.write(record)
        link.publish(stats=pack_stats(record))  # what the swarm's watchers show of this peer (watch.py)

    def _take_peak_rate(self) -> float:
        rate, self.peak_send_rate = self.peak_send_rate, 0.0
        return rate

    def save_checkpoint(self) -> None:
        # unsharded: gathered from the other ranks of an FSDP island, which wait at a boundary meanwhile
        local_model, inner_optimizer = self.island.local_model_state(), self.island.inner_state()
        with self._state_lock:
            state = dict(
                config=self.config.to_dict(),
                outer_step=self.outer_step,
                outer_steps_taken=self.outer.steps_taken,
                global_params=[t.clone() for t in self.global_params],
                momentum=[t.clone() for t in self.outer.state_tensors()],
                global_sha256=self.global_sha256,
                local_model=local_model,
                inner_optimizer=inner_optimizer,
                data_position=self.dataset.train.position,
                tokens_total=self.tokens_total,
                unsynced_by_fragment=list(self.unsynced_by_fragment),
                recent_round_tokens=[list(entry) for entry in self.recent_round_tokens],
            )
        path = checkpoint.save_atomic(self.config.run.checkpoint_dir, self.outer_step, state)
        logger.info("checkpoint written: %s", path)

    def resume(self) -> Path | None:
        """Restore the newest readable checkpoint of ``run.checkpoint_dir``; None if there is none yet.

        A corrupt, truncated or foreign file is reported (its name and why) and the one before it is tried;
        nothing is deleted or rewritten. If files exist but none can be used, raise ValueError.
        """
        directory = self.config.run.checkpoint_dir
        assert directory, "resume needs a checkpoint folder"
        problems = []
        for path in checkpoint.candidates(directory):
            try:
                self._restore(checkpoint.load(path), path)
            except ValueError as e:
                logger.error("%s; trying the checkpoint before it", e)
                problems.append(str(e))
                continue
            logger.info("resumed from %s at outer step %d (%d tokens so far)", path, self.outer_step, self.tokens_total)
            return path
        if problems:
            raise ValueError(f"no usable checkpoint in {directory}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        return None

    def _restore(self, state: dict, path: Path) -> None:
        """Check everything first, then change state: a checkpoint that fails a check leaves the learner as it was."""
        try:
            global_params, momentum = list(state["global_params"]), list(state["momentum"])
            local_model, inner_state = state["local_model"], state["inner_optimizer"]
            outer_step, steps_taken = int(state["outer_step"]), int(state["outer_steps_taken"])
            position, tokens_total = int(state["data_position"]), int(state["tokens_total"])
            saved_sha = str(state["global_sha256"])
            unsynced = [int(t) for t in state.get("unsynced_by_fragment", [0] * len(self.fragments))]
            recent = [[int(step), int(count)] for step, count in state.get("recent_round_tokens", [])]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"checkpoint {path} lacks a field or has a bad one ({type(e).__name__}: {e})") from None
        shapes = [tuple(p.shape) for p in self.global_params]
        for name, tensors in (("global params", global_params), ("outer momentum", momentum)):
            if [tuple(t.shape) for t in tensors] != shapes or any(t.dtype != torch.float32 for t in tensors):
                raise ValueError(f"checkpoint {path} holds {name} of another model than this config builds")
        if state_sha256(global_params, momentum) != saved_sha:
            raise ValueError(f"checkpoint {path} is damaged: its global params and momentum do not match their sha256")
        if any(not torch.isfinite(t).all() for t in global_params + momentum):
            raise ValueError(f"checkpoint {path} holds non-finite global params or momentum")
        if len(unsynced) != len(self.fragments):
            raise ValueError(f"checkpoint {path} was written with {len(unsynced)} fragments, this run uses {len(self.fragments)}")
        try:
            self.island.load_local(local_model, inner_state)
        except ValueError as e:
            raise ValueError(f"checkpoint {path} holds a local model or optimizer that does not fit ({e})") from None
        with torch.no_grad(), self._state_lock:
            for target, value in zip(self.global_params, global_params):
                target.copy_(value)
            self.outer.load_state(momentum, steps_taken)
            self.outer_step, self.global_sha256 = outer_step, saved_sha
            self.chain = deque([(outer_step, saved_sha)], maxlen=CHAIN)  # fresh: the swarm's vouched state wins
        self.dataset.train.position = position
        self.tokens_total = tokens_total
        self.unsynced_by_fragment = unsynced
        self.recent_round_tokens = deque(recent, maxlen=len(self.fragments))
        self.resumed_from = str(path)
