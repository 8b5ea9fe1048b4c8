"""One learner island: the decoupled DiLoCo loop of DESIGN.md §2.

    loop (one inner step at a time):
      inner AdamW step on this peer's shard; round_tokens += tokens
      if the averaging started earlier has returned:
          ok     -> global_params <- NesterovSGD(global_params, average)
                    local_params  <- global_params + (local_params - snapshot)   # keep the work done meanwhile
          failed -> nothing to undo: the progress stays in local_params and flows into the next outer gradient
      if the swarm's round is over (its tokens reached the round's budget, or a deadline passed):
          (wait for the previous averaging if it is still in flight: the only time compute waits)
          catch up if the swarm moved on or holds other bytes for our outer step
          snapshot = local_params; outer_grad = global_params - snapshot; weight = tokens behind it
          start averaging outer_grad in the background, keep training

A failed or partial round is a value handled in ``_complete_averaging``, never an exception unwinding the
loop. The learner talks to the swarm only through ``Link``; it does not know hivemind exists.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from p2p_diloco import checkpoint
from p2p_diloco.config import PeerConfig
from p2p_diloco.data import Dataset
from p2p_diloco.link import AveragingOutcome, Link
from p2p_diloco.metrics import MetricsSink
from p2p_diloco.model import build_model
from p2p_diloco.outer import OuterOptimizer, params_sha256

logger = logging.getLogger(__name__)


def partition_fragments(params: list[torch.Tensor], count: int) -> list[list[int]]:
    """Split the params, in order, into ``count`` contiguous fragments of about equal size (whole tensors)."""
    if count > len(params):
        raise ValueError(f"cannot split {len(params)} parameter tensors into {count} fragments")
    total, fragments, current, filled = sum(p.numel() for p in params), [], [], 0
    for index, param in enumerate(params):
        current.append(index)
        filled += param.numel()
        remaining_params, remaining_fragments = len(params) - index - 1, count - len(fragments) - 1
        if remaining_fragments and (filled >= total * (len(fragments) + 1) / count or remaining_params == remaining_fragments):
            fragments.append(current)
            current = []
    fragments.append(current)
    return fragments


@dataclass
class PendingAveraging:
    """An averaging in flight: what was sent, and the local params it was computed from."""

    future: Future
    outer_step: int
    weight: float
    snapshot: list[torch.Tensor]  # local params of the fragment being averaged, as they were sent
    fragment: int = 0
    indices: list[int] = field(default_factory=list)  # positions of the fragment's params in model.parameters()
    started: float = field(default_factory=time.monotonic)
    traffic_before: tuple[int, int] = (0, 0)
    steps_during: int = 0  # inner steps this peer ran while the averaging was in flight


@dataclass
class Interval:
    """Work done between two metrics records."""

    inner_steps: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    compute_s: float = 0.0
    blocked_s: float = 0.0

    @property
    def mean_loss(self) -> float | None:
        return self.loss_sum / self.inner_steps if self.inner_steps else None


class Learner:
    def __init__(self, config: PeerConfig, dataset: Dataset, metrics: MetricsSink, stop: threading.Event | None = None):
        self.config = config
        self.dataset, self.metrics = dataset, metrics
        self.stop = stop or threading.Event()
        self.model = build_model(config.model, config.run.seed)  # same seed on every peer: same start bytes
        self.params = list(self.model.parameters())
        self.global_params = [p.detach().clone() for p in self.params]
        self.outer = OuterOptimizer(self.global_params, config.outer)
        self.inner = torch.optim.AdamW(self.params, lr=config.inner.lr, weight_decay=config.inner.weight_decay)
        self.outer_step = 0
        self.global_sha256 = params_sha256(self.global_params)
        self.tokens_total = 0
        # streaming fragments (DESIGN.md §1, Streaming DiLoCo): outer step r averages fragment r % P only
        self.fragments = partition_fragments(self.params, config.inner.fragments)
        self.unsynced_by_fragment = [0] * len(self.fragments)  # tokens of local progress not yet in each fragment
        self.peak_send_rate = 0.0  # bytes/s: the largest ~1 s burst of averaging traffic since the last record
        self._traffic_sample: tuple[float, int] | None = None
        self.round_tokens = 0  # tokens this peer processed in the swarm's current round
        self.round_started = time.monotonic()
        self.steps_into_round = 0
        self.compute_s = self.blocked_s = 0.0
        self.catch_ups = self.forks_healed = 0
        self.peer_id = "?"
        self.pending: PendingAveraging | None = None
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
        return [torch.zeros(max(sum(self.params[i].numel() for i in f) for f in self.fragments))]

    def _pack(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(self.fragments) == 1:
            return tensors
        (template,) = self.averaging_template()
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return [torch.cat([flat, template[flat.numel():]])]  # zero padding up to the largest fragment

    def _unpack(self, averaged: list[torch.Tensor], indices: list[int]) -> list[torch.Tensor]:
        if len(self.fragments) == 1:
            return averaged
        sizes = [self.params[i].numel() for i in indices]
        pieces = averaged[0][: sum(sizes)].split(sizes)
        return [piece.reshape(self.params[i].shape) for piece, i in zip(pieces, indices)]

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
            )
            tensors = [t.clone() for t in self.global_params] + [t.clone() for t in self.outer.state_tensors()]
        return metadata, tensors

    def run(self, link: Link) -> None:
        """Train until max_outer_steps, max_time_s or ``stop``; writes one metrics record per outer step."""
        self._started = time.monotonic()
        self.peer_id = link.peer_id
        self._write(link, AveragingOutcome(None, (), 0.0, "init"))
        self._publish_step(link)
        self._catch_up(link)
        self.round_started = time.monotonic()
        try:
            while not self._should_stop():
                self._inner_step(link)
                if self.pending is not None and self.pending.future.done():
                    self._complete_averaging(link)
                if not self._should_stop() and self._round_is_over(link):
                    self._end_round(link)
            self._settle_pending(link)
        finally:
            if self.config.run.checkpoint_dir:
                self.save_checkpoint()

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
        loss = self.model(inputs, targets)
        self.inner.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.inner.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.config.inner.grad_clip_norm)
        self.inner.step()
        if self.config.inner.throttle > 1:  # emulate older hardware: each step takes `throttle` times as long
            time.sleep((self.config.inner.throttle - 1) * (time.monotonic() - started))
        elapsed = time.monotonic() - started
        tokens = inputs.numel()
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
        link.publish(round=self.round_index, round_tokens=self.round_tokens, tokens=self.tokens_total)

    def _sample_traffic(self, link: Link) -> None:
        """Track the largest send rate over windows of about a second (the burst that streaming fragments cut)."""
        now, (sent, _) = time.monotonic(), link.traffic()
        if self._traffic_sample is None:
            self._traffic_sample = (now, sent)
        elif now - self._traffic_sample[0] >= 1.0:
            started, sent_before = self._traffic_sample
            self.peak_send_rate = max(self.peak_send_rate, (sent - sent_before) / (now - started))
            self._traffic_sample = (now, sent)

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
        if view.tokens_by_others + self.round_tokens >= self._round_budget_tokens(view.live_peers):
            return True
        deadline_s = self.config.inner.round_deadline_s
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
        indices = self.fragments[fragment]
        snapshot = [self.params[i].detach().clone() for i in indices]
        outer_grads = [self.global_params[i] - s for i, s in zip(indices, snapshot)]
        weight = float(self.tokens_unsynced)
        traffic_before = link.traffic()
        future = link.average_async(self._pack(outer_grads), weight=weight, outer_step=self.outer_step)
        self.pending = PendingAveraging(
            future, self.outer_step, weight, snapshot, fragment, indices, traffic_before=traffic_before
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
            indices = pending.indices
            with self._state_lock:
                self.outer.step(self._unpack(outcome.averaged, indices), indices)
                self.outer_step += 1
                self.global_sha256 = params_sha256(self.global_params)
            with torch.no_grad():  # local_params <- new_global + (local_params - snapshot): keep the work done since
                for index, snapshot in zip(indices, pending.snapshot):
                    param = self.params[index]
                    param.copy_(self.global_params[index] + (param - snapshot))  # exactly new_global if idle
            self.unsynced_by_fragment[pending.fragment] -= int(pending.weight)
            self._publish_step(link)
        else:
            logger.warning("outer step %d: averaging failed (%s: %s)", pending.outer_step, outcome.status, outcome.reason)
        traffic = [after - before for after, before in zip(link.traffic(), pending.traffic_before)]
        self._write(link, outcome, pending, traffic)
        if outcome.averaged is None:
            self._catch_up(link)  # if nobody advanced, our progress simply flows into the next outer gradient
        if self.config.run.checkpoint_dir and outcome.averaged is not None:
            if self.outer_step % self.config.run.checkpoint_every == 0:
                self.save_checkpoint()

    def _catch_up(self, link: Link) -> bool:
        """If the swarm is ahead, or holds other bytes for our outer step (a fork: two groups averaged the
        same step apart), download its verified state and rebase local progress onto it."""
        if self.pending is not None:
            return False  # never while our own averaging is in flight: its result is still to be applied
        behind = link.swarm_outer_step() > self.outer_step
        forked = not behind and link.canonical_sha(self.outer_step, self.global_sha256) != self.global_sha256
        if not (behind or forked):
            return False
        started = time.monotonic()
        state = link.download_state(len(self.params))
        self._add_blocked(time.monotonic() - started)
        newer = state is not None and (
            state.outer_step > self.outer_step
            or (forked and state.outer_step == self.outer_step and state.global_sha256 != self.global_sha256)
        )
        if not newer:
            what = "ahead of" if behind else "on other bytes at"
            logger.warning("swarm is %s outer step %d; no verified state could be downloaded", what, self.outer_step)
            return False
        with torch.no_grad(), self._state_lock:
            for param, old, new in zip(self.params, self.global_params, state.global_params):
                param.add_(new - old)  # local_params <- new_global + (local_params - old_global)
                old.copy_(new)
            self.outer.load_state(state.momentum, state.outer_steps_taken)
            self.outer_step, self.global_sha256 = state.outer_step, state.global_sha256
        self.catch_ups += 1
        self.forks_healed += int(forked)
        logger.info(
            "%s outer step %d in %.2f s",
            "healed a fork at" if forked else "caught up to",
            self.outer_step,
            time.monotonic() - started,
        )
        self._publish_step(link)
        status = "fork_healed" if forked else "caught_up"
        self._write(link, AveragingOutcome(None, (), 0.0, status, f"downloaded from {state.donor}"))
        return True

    def _add_blocked(self, seconds: float) -> None:
        self.blocked_s += seconds
        self.interval.blocked_s += seconds

    def _publish_step(self, link: Link) -> None:
        link.publish(outer_step=self.outer_step, global_sha256=self.global_sha256, round=self.round_index)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out loss of the *global* params (the model the swarm shares), not of our local progress."""
        names = [name for name, _ in self.model.named_parameters()]
        weights = dict(zip(names, self.global_params))
        self.model.eval()
        losses = [
            torch.func.functional_call(self.model, weights, (inputs, targets)).item()
            for inputs, targets in self._eval_batches
        ]
        self.model.train()
        return sum(losses) / len(losses)

    def _write(
        self,
        link: Link,
        outcome: AveragingOutcome,
        pending: PendingAveraging | None = None,
        traffic: list[int] | None = None,
    ) -> None:
        evaluate = outcome.status == "init" or (outcome.averaged is not None and self.outer_step % self.config.run.eval_every == 0)
        elapsed = time.monotonic() - self._started
        interval, self.interval = self.interval, Interval()
        weight = pending.weight if pending else 0.0
        self.metrics.write(
            dict(
                peer_id=link.peer_id,
                outer_step=self.outer_step,
                status=outcome.status,
                reason=outcome.reason,
                time_s=round(elapsed, 3),
                tokens=self.tokens_total,
                interval_tokens=interval.tokens,
                inner_steps=interval.inner_steps,
                loss=interval.mean_loss,
                eval_loss=self.evaluate() if evaluate else None,
                group_size=len(outcome.peers),
                peers=list(outcome.peers),
                weight=weight,  # tokens behind the outer gradient this peer sent
                weight_total=outcome.weight_total,
                weight_share=round(weight / outcome.weight_total, 4) if outcome.weight_total else None,
                bytes_sent=int(traffic[0]) if traffic else 0,
                bytes_received=int(traffic[1]) if traffic else 0,
                averaging_s=round(time.monotonic() - pending.started, 3) if pending else None,
                steps_during_averaging=pending.steps_during if pending else 0,
                fragment=pending.fragment if pending else None,
                peak_send_bytes_per_s=round(self._take_peak_rate()),
                compute_s=round(self.compute_s, 4),
                blocked_s=round(self.blocked_s, 4),
                interval_compute_s=round(interval.compute_s, 4),
                interval_blocked_s=round(interval.blocked_s, 4),
                tokens_per_s=round(self.tokens_total / elapsed, 1) if elapsed > 0 else 0.0,
                catch_ups=self.catch_ups,
                forks_healed=self.forks_healed,
                global_sha256=self.global_sha256,
            )
        )

    def _take_peak_rate(self) -> float:
        rate, self.peak_send_rate = self.peak_send_rate, 0.0
        return rate

    def save_checkpoint(self) -> None:
        with self._state_lock:
            state = dict(
                config=self.config.to_dict(),
                outer_step=self.outer_step,
                outer_steps_taken=self.outer.steps_taken,
                global_params=[t.clone() for t in self.global_params],
                momentum=[t.clone() for t in self.outer.state_tensors()],
                global_sha256=self.global_sha256,
                local_model=self.model.state_dict(),
                inner_optimizer=self.inner.state_dict(),
                data_position=self.dataset.train.position,
                tokens_total=self.tokens_total,
            )
        path = checkpoint.save_atomic(self.config.run.checkpoint_dir, self.outer_step, state)
        logger.info("checkpoint written: %s", path)
