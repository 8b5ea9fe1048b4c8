"""What a learner records: one metrics record per outer step (and per catch-up, fork heal or failed round), the
held-out loss of the global params, and the largest send burst. Writes to the learner's sink (observe/metrics.py;
a null sink when none) and publishes a summary for the swarm's watchers (observe/watch.py)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from p2p_diloco.core.link import AveragingOutcome, Link
from p2p_diloco.observe.watch import pack_stats

if TYPE_CHECKING:
    from p2p_diloco.train.learner import Learner, PendingAveraging

PEAK_WINDOW_S = 1.0  # the window of the largest-burst figure (peak_send_bytes_per_s)


@dataclass
class Interval:
    """Work done between two metrics records."""

    inner_steps: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    compute_s: float = 0.0
    blocked_s: float = 0.0
    longest_block_s: float = 0.0  # the longest single wait of the training loop

    def add_step(self, tokens: int, loss: float, compute_s: float) -> None:
        self.inner_steps += 1
        self.tokens += tokens
        self.loss_sum += loss
        self.compute_s += compute_s

    @property
    def mean_loss(self) -> float | None:
        return self.loss_sum / self.inner_steps if self.inner_steps else None


class SendRate:
    """The largest send rate over a sliding window of just over a second, sampled at every inner step (the burst that
    streaming fragments cut)."""

    def __init__(self) -> None:
        self.peak = 0.0  # bytes/s since the last ``take``
        self._samples: deque[tuple[float, int]] = deque()  # (time, bytes sent), one per inner step

    def sample(self, sent: int, now: float) -> None:
        samples = self._samples
        samples.append((now, sent))
        while len(samples) > 2 and samples[1][0] <= now - PEAK_WINDOW_S:
            samples.popleft()  # keep exactly one sample at least a window old
        started, sent_before = samples[0]
        if now - started >= PEAK_WINDOW_S:
            self.peak = max(self.peak, (sent - sent_before) / (now - started))

    def take(self) -> float:
        peak, self.peak = self.peak, 0.0
        return peak


@torch.no_grad()
def evaluate(learner: Learner) -> float:
    """Held-out loss of the *global* params (the model the swarm shares), not of our local progress."""
    model, device = learner.eval_model, learner.eval_device
    names = [name for name, _ in model.named_parameters()]
    weights = dict(zip(names, (p.to(device) for p in learner.global_params)))
    model.eval()
    losses = [
        torch.func.functional_call(model, weights, (inputs.to(device), targets.to(device))).item()
        for inputs, targets in learner.eval_batches
    ]
    model.train()
    return sum(losses) / len(losses)


def write_record(
    learner,
    link: Link,
    outcome: AveragingOutcome,
    pending: PendingAveraging | None = None,
    traffic: list[int] | None = None,
) -> None:
    evaluate = outcome.status == "init" or (outcome.averaged is not None and learner.outer_step % learner.config.run.eval_every == 0)
    eval_started = time.monotonic()
    eval_loss = learner.evaluate() if evaluate else None
    learner.eval_s += time.monotonic() - eval_started
    elapsed = time.monotonic() - learner.started
    interval, learner.interval = learner.interval, Interval()
    weight = pending.weight if pending else 0.0
    sent_total, received_total = link.traffic()
    record = dict(
        peer_id=link.peer_id,
        outer_step=learner.outer_step,
        status=outcome.status,
        reason=outcome.reason,
        # groupmates whose part, weight or result this peer rejected or clamped, or donors it refused
        rejected_peers=[dict(peer=peer, reason=why) for peer, why in outcome.rejected],
        time_s=round(elapsed, 3),
        unix_time=round(time.time(), 3),  # wall clock: lines up the records of restarted peers
        tokens=learner.tokens_total,
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
        peak_send_bytes_per_s=round(learner.send_rate.take()),
        compute_s=round(learner.compute_s, 4),
        blocked_s=round(learner.blocked_s, 4),
        eval_s=round(learner.eval_s, 4),
        interval_compute_s=round(interval.compute_s, 4),
        interval_blocked_s=round(interval.blocked_s, 4),
        longest_block_s=round(interval.longest_block_s, 4),
        tokens_per_s=round(learner.tokens_total / elapsed, 1) if elapsed > 0 else 0.0,
        catch_ups=learner.catch_ups,
        forks_healed=learner.forks_healed,
        arithmetic_mismatches=len(learner.arithmetic_mismatches),  # steps of our own group we computed otherwise
        global_sha256=learner.global_sha256,
    )
    learner.metrics.write(record)
    link.publish(stats=pack_stats(record))  # what the swarm's watchers show of this peer (watch.py)
