"""One learner island: the decoupled DiLoCo loop of docs/design.md §2, as ``Learner.run`` reads.

    loop (one inner step at a time):                                         (DiLoCo, Algorithm 1)
      inner_step: AdamW or Muon on this peer's shard; round_tokens += tokens  the inner steps
      if the averaging started earlier has returned: complete_averaging
          ok     -> global_params <- NesterovSGD(global_params, average)      the outer step
                    local_params  <- global_params + (local_params - snapshot)   # keep the work done meanwhile
          failed -> nothing to undo: the progress stays in local_params and flows into the next outer gradient
      if round_is_over (the swarm's tokens reached the round's budget, or a deadline passed): end_round
          (wait for the previous averaging if it is still in flight: the only time compute waits)
          catch_up if the swarm holds another state (train/catch_up.py)
          snapshot = local_params; outer_grad = global_params - snapshot      the outer gradient
          weight = tokens of our round(s) at the outer steps it stands for
          start averaging outer_grad in the background, keep training         the average

A failed or partial round is a value handled in ``complete_averaging``, never an exception unwinding the loop. What
is not the algorithm lives beside it, chosen when the learner is built: the metrics (train/recorder.py), checkpoints
(train/checkpoints.py: a null object without a folder), catching up (train/catch_up.py), streaming fragments
(train/fragments.py), the edges of a run (train/run_edges.py). The learner talks to the swarm only through
``Link`` (core/link.py); it does not know hivemind exists.

A multi-rank island (island.py) runs this loop on rank 0 and ``follow`` on the other ranks: the same inner steps,
with rank 0's decisions and state broadcast at every inner step boundary (``sync_island``). The outer machinery reads
and writes the local params through ``island.local_params()``: the model's own params, or with FSDP rank 0's full
copy of them, gathered from the ranks' shards on demand.
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

from p2p_diloco.core.config import PeerConfig
from p2p_diloco.core.history import CHAIN, MADE, Node
from p2p_diloco.core.link import AveragingOutcome, Link, LocalLink
from p2p_diloco.core.outer import OuterOptimizer, Segment, state_sha256
from p2p_diloco.core.schedule import lr_factor
from p2p_diloco.observe.metrics import MetricsSink
from p2p_diloco.train import checkpoints, recorder, run_edges
from p2p_diloco.train.catch_up import catch_up
from p2p_diloco.train.checkpoints import checkpoints_for
from p2p_diloco.train.data import DataSource
from p2p_diloco.train.fragments import Fragments
from p2p_diloco.train.inner_optimizer import build_inner_optimizer
from p2p_diloco.train.island import Control, Island
from p2p_diloco.train.model import build_model
from p2p_diloco.train.recorder import Interval, SendRate
from p2p_diloco.train.rounds import Rounds

logger = logging.getLogger(__name__)
ROUND_HISTORY = 32  # outer steps whose group members a peer remembers and serves with its state


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


class Learner:
    """One learner island; see the module docstring. Its public methods are the steps of the loop."""

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
        self.inner = build_inner_optimizer(config.inner.optimizer, self.model, config.inner.lr, config.inner.weight_decay)
        self.island.attach(self.model, self.inner, self.global_params)
        self.outer = OuterOptimizer(self.global_params, config.outer)
        self.outer_step = 0
        self.global_sha256 = state_sha256(self.global_params, self.outer.momentum_buffers)  # published: invariant 1
        self.tokens_total = 0
        # streaming fragments (docs/design.md §1, Streaming DiLoCo): outer step r averages fragment r % P only
        self.fragments = Fragments(self.global_params, config.inner.fragments)
        # when a round ends and what an outer gradient weighs (train/rounds.py)
        self.rounds = Rounds(config.inner, dataset.train.tokens_per_batch, len(self.fragments))
        self.send_rate = SendRate()  # the largest ~1 s burst of averaging traffic since the last record
        self.compute_s = self.blocked_s = 0.0
        # this process's CPU seconds during inner steps (all its threads): over compute_s, the share of a core its
        # steps got; tokens over it, what a token costs in CPU (scripts/bench_overhead.py splits its loss by these)
        self.compute_cpu_s = 0.0
        self.eval_s = 0.0  # time spent evaluating: measurement, neither training nor waiting
        self.last_eval_s = 0.0  # how long the last evaluation took (the next one's expected cost)
        self.last_record_s = 0.0  # seconds since start at the last metrics record
        self.catch_ups = self.forks_healed = 0
        # outer steps this peer's own group made whose bytes came out other here than on its groupmates: the same
        # averaged bytes applied to the same state, so this machine's arithmetic differs (docs/design.md §5)
        self.arithmetic_mismatches: list[int] = []
        self.refused_ties: set[str] = set()  # same-step forks won on a tie that lay too far from us (catch_up.py)
        self.fork_waited = -1  # the outer step at which a fork waited for our groupmates' reports (catch_up.py)
        self.resumed_from: str | None = None
        self.peer_id = "?"
        self.pending: PendingAveraging | None = None
        # an averaging that failed here may still have been applied by the others (a partial all-reduce is
        # partial only for some of the group): it waits here until a downloaded round history says which
        self.unconfirmed: PendingAveraging | None = None
        self.round_history: dict[int, tuple[str, ...]] = {}  # outer step r -> peers whose gradients made r -> r+1
        # our last heads (outer step, state sha256), published for the others to vouch by (history.py)
        self.chain: deque[Node] = deque([(0, self.global_sha256)], maxlen=CHAIN)
        # the steps we computed ourselves, averaging, and the bytes they came out as: a download replaces the chain,
        # not these, so that groupmates can tell whose arithmetic differs at a fork (catch_up.py, history.made_sha256)
        self.made: deque[Node] = deque(maxlen=MADE)
        self.fresh = True  # no averaging in a group since we started: our history is our own word only
        # the average that made our current state from the one before (its sha256), served with our state: a peer
        # one step behind recomputes that step from it instead of taking our word (history.py, "next")
        self.parent_sha256: str | None = None
        self.last_average: list[torch.Tensor] | None = None
        self.interval = Interval()
        self.checkpoints = checkpoints_for(config.run)  # chosen once: the loop has no branch for them
        self.state_lock = threading.Lock()  # guards global state against a concurrent state download
        self.eval_batches = dataset.eval_batches(config.run.eval_batches)
        self.started = time.monotonic()

    @property
    def tokens_unsynced(self) -> int:
        """Tokens behind the next outer gradient: local progress not yet merged into the next fragment to sync."""
        return self.fragments.unsynced[self.fragments.at(self.outer_step)[0]]

    def averaging_template(self) -> list[torch.Tensor]:
        """The tensors one averaging carries (train/fragments.py)."""
        return self.fragments.template()

    @property
    def round_index(self) -> int:
        """The round our current tokens count towards: the next outer step, plus one while averaging."""
        return self.outer_step + (1 if self.pending is not None else 0)

    # served to peers that download our state (called from a background thread)

    def state_for_peers(self) -> tuple[dict, list[torch.Tensor]]:
        with self.state_lock:
            metadata = dict(
                outer_step=self.outer_step,
                global_sha256=self.global_sha256,
                outer_steps_taken=self.outer.steps_taken,
                steps_into_round=self.rounds.steps,
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
        run_edges.wait_for_start(self)
        self.started = time.monotonic()
        self.peer_id = link.peer_id
        resumed = f"resumed from {self.resumed_from}" if self.resumed_from else ""
        self.write(link, AveragingOutcome(None, (), 0.0, "init", resumed))
        self.publish_step(link)
        run_edges.wait_for_peers(self, link)
        settled = False
        try:
            # first, so that the other ranks wait at the first boundary while rank 0 catches up (FSDP: to serve it)
            self.share_start()
            catch_up(self, link)
            self.rounds.started = time.monotonic()
            stop = self.sync_island(self.should_stop()).stop
            while not stop:
                self.inner_step(link)
                if self.pending is not None and self.pending.future.done():
                    self.complete_averaging(link)
                if not self.should_stop() and self.round_is_over(link):
                    self.end_round(link)
                stop = self.sync_island(self.should_stop()).stop  # the other ranks of the island do as rank 0 says
            run_edges.settle_pending(self, link)
            run_edges.confirm_last_step(self, link)
            settled = True
        finally:
            # an FSDP island's checkpoint gathers from the other ranks: only while they wait at a boundary
            if settled or not self.island.sharded:
                self.checkpoints.save(self)
            else:
                logger.warning("no checkpoint at the end: the FSDP island stopped on an error (the last one stays)")
        self.sync_island(True)  # an averaging that landed while settling reaches the other ranks too
        run_edges.serve_stragglers(self, link)

    def follow(self) -> None:
        """A rank other than 0 of a multi-rank island: the same inner steps as rank 0 (DDP keeps them
        identical) until rank 0 says stop; rank 0's global state replaces ours whenever it changes."""
        run_edges.wait_for_start(self)
        self.share_start()
        link = LocalLink()  # never used for averaging: only rank 0 talks to the swarm
        control = self.sync_island(False)
        while not control.stop:
            self.inner_step(link)
            control = self.sync_island(False)
            self.outer_step = control.outer_step
        self.sync_island(True)

    def share_start(self) -> None:
        """Rank 0's inner optimizer state and data position to the island's other ranks (a resume, say)."""
        self.dataset.train.position = self.island.share_start(self.dataset.train.position)

    def sync_island(self, stop: bool) -> Control:
        # the followers of a DDP island receive the momentum too: their copy of the shared state hashes like ours
        return self.island.sync(stop, self.outer_step, self.global_sha256, [*self.global_params, *self.outer.momentum_buffers])

    def should_stop(self) -> bool:
        run = self.config.run
        if run.max_outer_steps and self.outer_step >= run.max_outer_steps:
            return True
        if run.max_time_s and time.monotonic() - self.started >= run.max_time_s:
            return True
        return self.stop.is_set()

    def inner_step(self, link: Link) -> None:
        started, cpu_started = time.monotonic(), time.process_time()
        self.model.train()
        inputs, targets = self.dataset.train.next_batch()
        with self.island.autocast():
            loss = self.train_model(inputs.to(self.island.device), targets.to(self.island.device))
        self.inner.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.inner.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.inner.grad_clip_norm)
        lr = self.inner_lr()
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        self.island.trained()
        if self.config.inner.throttle > 1:  # emulate older hardware: each step takes `throttle` times as long
            time.sleep((self.config.inner.throttle - 1) * (time.monotonic() - started))
        elapsed = time.monotonic() - started
        tokens = inputs.numel() * self.island.size  # the island's tokens: every rank read a batch of its own sub-shard
        self.compute_s += elapsed
        self.compute_cpu_s += time.process_time() - cpu_started
        self.tokens_total += tokens
        self.fragments.trained(tokens)
        self.rounds.trained(tokens)
        self.interval.add_step(tokens, loss.item(), elapsed)
        if self.pending is not None:
            self.pending.steps_during += 1
        self.send_rate.sample(link.traffic()[0], time.monotonic())
        link.publish(round=self.round_index, round_tokens=self.rounds.tokens, tokens=self.tokens_total,
                     rate=round(self.rounds.rate, 1))

    def inner_lr(self) -> float:
        """The lr of the next inner step: the configured one, through the schedule (core/schedule.py) at the swarm's
        nominal inner step (H per round the swarm made, a fragment's share of it per outer step, plus ours since)."""
        inner = self.config.inner
        if not (inner.warmup_steps or inner.lr_decay_steps):
            return inner.lr
        step = self.round_index * inner.inner_steps // len(self.fragments) + self.rounds.steps
        return inner.lr * lr_factor(step, inner.warmup_steps, inner.lr_decay_steps, inner.lr_floor)

    def round_is_over(self, link: Link) -> bool:
        """The swarm's round is over (train/rounds.py: its tokens reached the budget, a peer moved on, a deadline)."""
        return self.rounds.is_over(link, self.round_index)

    def end_round(self, link: Link) -> None:
        if self.pending is not None:  # the previous averaging is still in flight: the only wait in the loop
            started = time.monotonic()
            while not self.pending.future.done() and not self.stop.is_set():
                wait([self.pending.future], timeout=0.5)  # a stop request (SIGTERM) is honoured within 0.5 s
            self.add_blocked(time.monotonic() - started)
            if not self.pending.future.done():
                return  # stopping: run() gives the averaging a last bounded chance in _settle_pending
            self.complete_averaging(link)
            if self.should_stop():
                return
        # if the swarm moved on, or another group averaged our last outer step to other bytes (a fork),
        # take the swarm's state now; our progress is rebased onto it
        catch_up(self, link)
        fragment, segments = self.fragments.at(self.outer_step)
        local = self.island.local_params()
        snapshot = [s.of(local).detach().clone() for s in segments]
        outer_grads = [s.of(self.global_params) - local.cpu() for s, local in zip(segments, snapshot)]
        tokens = self.tokens_unsynced
        weight = self.rounds.weight(self.outer_step, tokens)  # the tokens of the rounds it stands for
        what = f"fragment {fragment + 1}/{len(self.fragments)}" if len(self.fragments) > 1 else "outer gradient"
        carried = f", {tokens - int(weight)} more carried" if tokens > weight else ""
        logger.info("outer step %d: averaging started (%s, weight %d tokens%s)", self.outer_step, what, weight, carried)
        traffic_before = link.traffic()
        future = link.average_async(self.fragments.pack(outer_grads), weight=weight, outer_step=self.outer_step)
        self.pending = PendingAveraging(
            future, self.outer_step, weight, snapshot, fragment, segments, traffic_before=traffic_before, tokens=tokens
        )
        self.rounds.restart()
        if future.done():  # a swarm of one answers at once
            self.complete_averaging(link)

    def complete_averaging(self, link: Link) -> None:
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
            with self.state_lock:
                self.parent_sha256, self.last_average = self.global_sha256, [t.clone() for t in outcome.averaged]
                self.outer.step(self.fragments.unpack(outcome.averaged, segments), segments)
                self.outer_step += 1
                self.global_sha256 = state_sha256(self.global_params, self.outer.momentum_buffers)
                self.chain.append((self.outer_step, self.global_sha256))
                self.made.append((self.outer_step, self.global_sha256))
            self.fresh = self.fresh and len(outcome.peers) < 2
            with torch.no_grad():  # local_params <- new_global + (local_params - snapshot): keep the work done since
                for segment, snapshot in zip(segments, pending.snapshot):
                    param = segment.of(local)
                    param.copy_(segment.of(self.global_params).to(param.device) + (param - snapshot))  # new_global if idle
            self.fragments.synced(pending.fragment, pending.tokens_behind)
            self.remember_round(pending.outer_step, outcome.peers)
            self.unconfirmed = None
            self.publish_step(link)
        else:
            logger.warning("outer step %d: averaging failed (%s: %s)", pending.outer_step, outcome.status, outcome.reason)
            # a second failed attempt at the same step replaces the first: if the swarm applied one of them, the
            # later snapshot errs towards dropping a little progress rather than counting some twice
            self.unconfirmed = pending
        traffic = [after - before for after, before in zip(link.traffic(), pending.traffic_before)]
        self.write(link, outcome, pending, traffic)
        if outcome.averaged is None:
            catch_up(self, link)  # if nobody advanced, our progress simply flows into the next outer gradient
        if outcome.averaged is not None:
            self.checkpoints.after_outer_step(self)

    def remember_round(self, outer_step: int, peers: tuple[str, ...]) -> None:
        self.round_history[outer_step] = tuple(peers)
        self.trim_history()

    def trim_history(self) -> None:
        for step in sorted(self.round_history)[:-ROUND_HISTORY]:
            del self.round_history[step]

    def add_blocked(self, seconds: float) -> None:
        self.blocked_s += seconds
        self.interval.blocked_s += seconds
        self.interval.longest_block_s = max(self.interval.longest_block_s, seconds)

    def publish_step(self, link: Link) -> None:
        recent = [list(node) for node in list(self.chain)[:-1]]  # our earlier heads: the others vouch by chains
        link.publish(outer_step=self.outer_step, global_sha256=self.global_sha256, round=self.round_index, recent=recent,
                     made=[list(node) for node in self.made])

    # the parts of the learner kept in modules of their own (their docstrings say what and why)

    def catch_up(self, link: Link) -> bool:
        """Take the state the swarm vouches for, if it is not ours (train/catch_up.py)."""
        return catch_up(self, link)

    def write(self, link: Link, outcome: AveragingOutcome, pending: PendingAveraging | None = None,
              traffic: list[int] | None = None) -> None:
        """One metrics record (train/recorder.py)."""
        recorder.write_record(self, link, outcome, pending, traffic)

    def evaluate(self) -> float:
        """Held-out loss of the global params (train/recorder.py)."""
        return recorder.evaluate(self)

    def save_checkpoint(self) -> None:
        """Write a checkpoint now (train/checkpoints.py); the run needs a checkpoint folder."""
        checkpoints.save(self)

    def resume(self) -> Path | None:
        """Restore the newest readable checkpoint (train/checkpoints.py)."""
        return checkpoints.resume(self)
