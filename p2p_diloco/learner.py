"""One learner island: the DiLoCo loop of DESIGN.md §2 (averaging not yet overlapped with compute).

    loop:
      H inner AdamW steps on this peer's shard              (fewer right after catching up mid-round)
      outer_grad = global_params - local_params; weight = tokens behind it
      outcome = link.average(outer_grad, weight, outer_step)   (blocks; time counted as blocked_s)
      ok     -> global_params <- NesterovSGD(global_params, average); local_params <- global_params
      failed -> if the swarm is ahead: download its state and rebase local progress onto it;
                else keep local progress, which flows into the next round's outer gradient

A failed or partial round is a value handled in ``_finish_round``, never an exception unwinding the
loop. The learner talks to the swarm only through ``Link``; it does not know hivemind exists.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2p_diloco import checkpoint
from p2p_diloco.config import PeerConfig
from p2p_diloco.data import Dataset
from p2p_diloco.link import AveragingOutcome, Link
from p2p_diloco.metrics import MetricsSink
from p2p_diloco.model import build_model
from p2p_diloco.outer import OuterOptimizer, params_sha256

logger = logging.getLogger(__name__)


@dataclass
class RoundWork:
    """What one round of inner steps did."""

    inner_steps: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    compute_s: float = 0.0
    interrupted: bool = False

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
        self.tokens_since_sync = 0  # tokens behind the current outer gradient (its averaging weight)
        self.steps_into_round = 0
        self.round_budget = config.inner.inner_steps
        self.compute_s = self.blocked_s = 0.0
        self.catch_ups = 0
        self.forks_healed = 0
        self.peer_id = "?"
        self._state_lock = threading.Lock()  # guards global state against a concurrent state download
        self._eval_batches = dataset.eval_batches(config.run.eval_batches)
        self._started = time.monotonic()

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
        """Train until max_outer_steps, max_time_s or ``stop``; writes one metrics record per round."""
        self._started = time.monotonic()
        self.peer_id = link.peer_id
        self.metrics.write(self._record(link, AveragingOutcome(None, (), 0.0, "init"), RoundWork(), 0.0, (0, 0)))
        link.publish(outer_step=self.outer_step, global_sha256=self.global_sha256, tokens=0)
        self._catch_up(link)
        try:
            while not self._should_stop():
                work = self._train_round(link)
                if work.interrupted:
                    break
                # before averaging: if the swarm moved on, or another group averaged our last outer step to
                # other bytes (a fork), take the swarm's state now; our progress is rebased onto it
                self._catch_up(link)
                outer_grads = [g - p.detach() for g, p in zip(self.global_params, self.params)]
                traffic_before = link.traffic()
                started = time.monotonic()
                weight = float(self.tokens_since_sync)
                outcome = link.average(outer_grads, weight=weight, outer_step=self.outer_step)
                blocked_s = time.monotonic() - started
                self._finish_round(link, outcome)
                self.blocked_s += time.monotonic() - started
                traffic = tuple(after - before for after, before in zip(link.traffic(), traffic_before))
                self.metrics.write(self._record(link, outcome, work, blocked_s, traffic, weight))
                if self.config.run.checkpoint_dir and outcome.averaged is not None:
                    if self.outer_step % self.config.run.checkpoint_every == 0:
                        self.save_checkpoint()
        finally:
            if self.config.run.checkpoint_dir:
                self.save_checkpoint()

    def _should_stop(self) -> bool:
        run = self.config.run
        if run.max_outer_steps and self.outer_step >= run.max_outer_steps:
            return True
        if run.max_time_s and time.monotonic() - self._started >= run.max_time_s:
            return True
        return self.stop.is_set()

    def _train_round(self, link: Link) -> RoundWork:
        work = RoundWork()
        self.model.train()
        for _ in range(self.round_budget):
            if self._should_stop():
                work.interrupted = True
                break
            started = time.monotonic()
            inputs, targets = self.dataset.train.next_batch()
            loss = self.model(inputs, targets)
            self.inner.zero_grad(set_to_none=True)
            loss.backward()
            if self.config.inner.grad_clip_norm:
                torch.nn.utils.clip_grad_norm_(self.params, self.config.inner.grad_clip_norm)
            self.inner.step()
            work.compute_s += time.monotonic() - started
            work.inner_steps += 1
            work.tokens += inputs.numel()
            work.loss_sum += loss.item()
            self.steps_into_round += 1
            link.publish(steps_into_round=self.steps_into_round, tokens=self.tokens_total + work.tokens)
        self.compute_s += work.compute_s
        self.tokens_total += work.tokens
        self.tokens_since_sync += work.tokens
        return work

    def _finish_round(self, link: Link, outcome: AveragingOutcome) -> None:
        """The one place where a round's outcome, good or bad, is turned into state."""
        if outcome.averaged is None:
            logger.warning("outer step %d: round failed (%s: %s)", self.outer_step, outcome.status, outcome.reason)
            self._catch_up(link)  # if nobody advanced, local progress simply carries into the next round
            return
        self._apply_average(link, outcome.averaged)

    def _apply_average(self, link: Link, averaged: list[torch.Tensor]) -> None:
        with self._state_lock:
            self.outer.step(averaged)
            self.outer_step += 1
            self.global_sha256 = params_sha256(self.global_params)
            self.steps_into_round = 0
        with torch.no_grad():
            for param, global_param in zip(self.params, self.global_params):
                param.copy_(global_param)
        self.tokens_since_sync = 0
        self.round_budget = self.config.inner.inner_steps
        link.publish(outer_step=self.outer_step, global_sha256=self.global_sha256, steps_into_round=0)

    def _catch_up(self, link: Link) -> bool:
        """If the swarm is ahead, or holds other bytes for our outer step (a fork: two groups averaged the
        same step apart), download its verified state and rebase local progress onto it."""
        behind = link.swarm_outer_step() > self.outer_step
        forked = not behind and link.canonical_sha(self.outer_step, self.global_sha256) != self.global_sha256
        if not (behind or forked):
            return False
        started = time.monotonic()
        state = link.download_state(len(self.params))
        self.blocked_s += time.monotonic() - started
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
            self.steps_into_round = state.steps_into_round
        # finish the swarm's current round with it rather than starting a whole new one
        self.round_budget = max(1, self.config.inner.inner_steps - state.steps_into_round)
        self.catch_ups += 1
        self.forks_healed += int(forked)
        logger.info("%s outer step %d in %.2f s", "healed a fork at" if forked else "caught up to", self.outer_step,
                    time.monotonic() - started)
        link.publish(outer_step=self.outer_step, global_sha256=self.global_sha256)
        status = "fork_healed" if forked else "caught_up"
        reason = f"downloaded from {state.donor}"
        self.metrics.write(self._record(link, AveragingOutcome(None, (), 0.0, status, reason), RoundWork(), 0.0, (0, 0)))
        return True

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        losses = [self.model(inputs, targets).item() for inputs, targets in self._eval_batches]
        self.model.train()
        return sum(losses) / len(losses)

    def _record(
        self,
        link: Link,
        outcome: AveragingOutcome,
        work: RoundWork,
        blocked_s: float,
        traffic: Sequence[int],
        weight: float = 0.0,
    ) -> dict:
        evaluate = outcome.status == "init" or self.outer_step % self.config.run.eval_every == 0
        elapsed = time.monotonic() - self._started
        return dict(
            peer_id=link.peer_id,
            outer_step=self.outer_step,
            status=outcome.status,
            reason=outcome.reason,
            time_s=round(elapsed, 3),
            tokens=self.tokens_total,
            round_tokens=work.tokens,
            inner_steps=work.inner_steps,
            loss=work.mean_loss,
            eval_loss=self.evaluate() if evaluate else None,
            group_size=len(outcome.peers),
            peers=list(outcome.peers),
            weight=weight,  # tokens behind the outer gradient sent this round (this and any failed rounds)
            weight_total=outcome.weight_total,
            bytes_sent=int(traffic[0]),
            bytes_received=int(traffic[1]),
            compute_s=round(self.compute_s, 4),
            blocked_s=round(self.blocked_s, 4),
            round_compute_s=round(work.compute_s, 4),
            round_blocked_s=round(blocked_s, 4),
            tokens_per_s=round(self.tokens_total / elapsed, 1) if elapsed > 0 else 0.0,
            catch_ups=self.catch_ups,
            forks_healed=self.forks_healed,
            global_sha256=self.global_sha256,
        )

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
