"""What a learner records: one metrics record per outer step (and per catch-up, fork heal or failed round), the
held-out loss of the global params, and the largest send burst. Writes to the learner's sink (observe/metrics.py;
a null sink when none) and publishes a summary for the swarm's watchers (observe/watch.py)."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from p2p_diloco.core.link import AveragingOutcome, Link
from p2p_diloco.observe.watch import pack_stats

if TYPE_CHECKING:
    from p2p_diloco.train.learner import Learner, PendingAveraging

PEAK_WINDOW_S = 1.0  # the window of the largest-burst figure (peak_send_bytes_per_s)
EVAL_BUDGET = 0.01  # with --eval-every 0: held-out evaluations take at most this share of the training compute


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


def eval_due(outer_step: int, every: int, eval_s: float, last_eval_s: float, compute_s: float, final: bool) -> bool:
    """Whether to evaluate the held-out loss after ``outer_step``: every ``every`` outer steps; with ``every`` 0,
    whenever one more evaluation (as long as the last one took) keeps all of them within ``EVAL_BUDGET`` of the
    training compute so far (the evaluation takes from the training on a busy machine: docs/benchmarks.md,
    "Where a peer's time goes"); and always at the last outer step of a run with a step limit."""
    if final:
        return True
    if every > 0:
        return outer_step % every == 0
    return eval_s + last_eval_s <= EVAL_BUDGET * compute_s


def eval_turn(outer_step: int, peer_id: str, group: Sequence[str], last_eval_s: float, round_compute_s: float,
              final: bool) -> bool:
    """With ``--eval-shared`` and ``--eval-every 0``, after a round averaged in a group of two or more: whether it is
    this peer's turn to evaluate the held-out loss for the group. Every member of the group holds the same global
    params (invariant 1) and the same held-out batches, so one evaluation serves them all (docs/design.md §2,
    "Held-out evaluation"). The group evaluates every E outer steps, E the fewest that keep one evaluation (as long
    as the last one took) per E rounds within ``EVAL_BUDGET`` of a round's compute: as often as one peer alone would
    (``eval_due``). Member (outer_step // E) mod k of the group, sorted by id, takes it; so each of the k pays a k-th
    of what it did alone. At the last outer step of a run with a step limit, member outer_step mod k."""
    members = sorted(group)
    if peer_id not in members:
        return False
    if final:
        return members[outer_step % len(members)] == peer_id
    every = max(1, math.ceil(last_eval_s / (EVAL_BUDGET * round_compute_s))) if round_compute_s > 0 else 1
    return outer_step % every == 0 and members[(outer_step // every) % len(members)] == peer_id


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
    run = learner.config.run
    now = time.monotonic()
    # the last outer step: of a step limit, or of a time limit that another round as long as this one would pass
    step_final = 0 < run.max_outer_steps <= learner.outer_step
    final = step_final or (run.max_time_s > 0 and 2 * (now - learner.started) - learner.last_record_s >= run.max_time_s)
    if outcome.averaged is not None and run.eval_shared and run.eval_every == 0 and len(outcome.peers) >= 2 and (
            step_final or not final):  # a time limit ends each peer at its own step: each evaluates its last
        evaluate = eval_turn(learner.outer_step, link.peer_id, outcome.peers, learner.last_eval_s,
                             learner.interval.compute_s, step_final)
    else:
        evaluate = outcome.status == "init" or (outcome.averaged is not None and eval_due(
            learner.outer_step, run.eval_every, learner.eval_s, learner.last_eval_s, learner.compute_s, final))
    eval_started = time.monotonic()
    eval_loss = learner.evaluate() if evaluate else None
    if evaluate:
        learner.last_eval_s = time.monotonic() - eval_started
        learner.eval_s += learner.last_eval_s
    elapsed = time.monotonic() - learner.started
    learner.last_record_s = elapsed
    interval, learner.interval = learner.interval, Interval()
    weight = pending.weight if pending else 0.0
    sent_total, received_total = link.traffic()
    states_served, state_bytes_served = link.states_served()
    background_cpu_s = link.background_cpu_s()
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
        norm_ratio=outcome.norm_ratio,  # the group's average over the reference norm (docs/design.md §7)
        bytes_sent=int(traffic[0]) if traffic else 0,
        bytes_received=int(traffic[1]) if traffic else 0,
        bytes_sent_total=int(sent_total),  # averaging messages since the process started
        bytes_received_total=int(received_total),
        states_served_total=states_served,  # states served to peers catching up since the process started
        state_bytes_served_total=state_bytes_served,
        averaging_s=round(time.monotonic() - pending.started, 3) if pending else None,
        steps_during_averaging=pending.steps_during if pending else 0,
        fragment=pending.fragment if pending else None,
        peak_send_bytes_per_s=round(learner.send_rate.take()),
        compute_s=round(learner.compute_s, 4),
        compute_cpu_s=round(learner.compute_cpu_s, 4),
        # CPU seconds of this peer's DHT, averager and p2pd processes since they started (None: none, or not Linux)
        background_cpu_s=None if background_cpu_s is None else round(background_cpu_s, 2),
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
