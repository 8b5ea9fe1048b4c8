"""The baselines that the benchmark runs beside p2p-diloco, as training methods with one interface (``Method``):
``Bare`` (the plain PyTorch loop), ``SyncDataParallel`` (gradients all-reduced every step) and
``HivemindOptimizer`` (``hivemind.Optimizer`` with local updates). See ``experiments.baselines`` for the
worker process that runs one of them, records its progress and stops it; this module does not record or
plot anything.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from p2p_diloco.core.config import PeerConfig
from p2p_diloco.core.outer import params_sha256
from p2p_diloco.train.model import build_model

logger = logging.getLogger(__name__)

METHODS = ("syncdp", "hivemind-opt", "bare")
DEFAULT_MATCHMAKING_TIME_S = 1.0  # syncdp averages every step: a peer's 5 s default would dominate


@dataclass(frozen=True)
class BaselineConfig:
    """What a baseline worker needs beyond a peer's config."""

    method: str  # one of METHODS
    expected_peers: int = 4  # processes of this method in the run; syncdp's all-reduce starts once all joined
    target_batch_size: int = 0  # hivemind-opt: samples (sequences) the swarm processes per epoch; 0 = derived
    max_tokens: int = 0  # stop after this process trained on this many tokens; 0 = no limit
    record_every_s: float = 5.0  # seconds of wall time between metrics records
    eval_every_s: float = 30.0  # seconds of wall time between held-out evaluations; 0 = only at start and end

    def __post_init__(self) -> None:
        checks = [
            (self.method in METHODS, f"--method must be one of {', '.join(METHODS)}, got {self.method!r}"),
            (self.expected_peers >= 1, f"--expected-peers must be >= 1, got {self.expected_peers}"),
            (self.target_batch_size >= 0, f"--target-batch-size must be >= 0 samples, got {self.target_batch_size}"),
            (self.max_tokens >= 0, f"--max-tokens must be >= 0, got {self.max_tokens}"),
            (self.record_every_s > 0, f"--record-every-s must be > 0 seconds, got {self.record_every_s}"),
            (self.eval_every_s >= 0, f"--eval-every-s must be >= 0 seconds, got {self.eval_every_s}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


class Limits:
    """When this process stops: ``max_time_s`` of wall time since training began, ``max_tokens``, or ``stop``
    (set by SIGINT/SIGTERM). 0 means no limit."""

    def __init__(self, max_time_s: float, max_tokens: int, stop: threading.Event):
        self.max_time_s, self.max_tokens, self.stop = max_time_s, max_tokens, stop
        self.started = time.monotonic()

    def begin(self) -> None:
        self.started = time.monotonic()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def out_of_time(self) -> bool:
        """Time is up or a stop was asked for: also polled while waiting for a group, to give up the wait."""
        return self.stop.is_set() or bool(self.max_time_s and self.elapsed_s() >= self.max_time_s)

    def reached(self, tokens: int) -> bool:
        return self.out_of_time() or bool(self.max_tokens and tokens >= self.max_tokens)


class StepTimes(NamedTuple):
    """One training step: its train loss and where its wall time went (seconds)."""

    loss: float
    compute_s: float  # forward, backward, clipping, optimizer (and data loading)
    comm_s: float  # waiting for the all-reduce / averaging
    applied: bool = True  # False: the run ended while syncdp waited for its group, and the step was dropped


class Method(Protocol):
    """One baseline's training step; the loop around it (stopping, eval, records) is shared."""

    model: torch.nn.Module

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepTimes: ...

    def fields(self) -> dict[str, Any]: ...  # method-specific fields of every record

    def final_fields(self) -> dict[str, Any]: ...  # and of the final record

    def close(self) -> None: ...


def _forward_backward(model: torch.nn.Module, optimizer: Any, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    model.train()
    loss = model(inputs, targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    return loss


def _clip(params: list[torch.Tensor], grad_clip_norm: float) -> None:
    if grad_clip_norm:
        torch.nn.utils.clip_grad_norm_(params, grad_clip_norm)


def _adamw(config: PeerConfig) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda params: torch.optim.AdamW(params, lr=config.inner.lr, weight_decay=config.inner.weight_decay)


class Bare:
    """Forward, backward, clip, AdamW: ``Learner.inner_step`` without the swarm."""

    def __init__(self, config: PeerConfig):
        self.model = build_model(config.model, config.run.seed)
        self.params = list(self.model.parameters())
        self.optimizer = _adamw(config)(self.params)
        self.grad_clip_norm = config.inner.grad_clip_norm

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepTimes:
        started = time.monotonic()
        loss = _forward_backward(self.model, self.optimizer, inputs, targets)
        _clip(self.params, self.grad_clip_norm)
        self.optimizer.step()
        loss_value = loss.item()
        return StepTimes(loss_value, time.monotonic() - started, 0.0)

    def fields(self) -> dict[str, Any]:
        return dict(group_size=1, failed_allreduces=None, epoch=None)

    def final_fields(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class SyncDataParallel:
    """Every step: all-reduce the gradients (token-weighted mean, fp32), then clip and step AdamW.

    The group forms as soon as ``expected_peers`` joined, else after the matchmaking time with whoever came;
    alone, a peer keeps looking until the averaging timeout. So without ``--start-at`` the first step also
    waits for the others to start (counted as comm). The group key is the same at every step: a peer that fell behind joins the
    others' next all-reduce instead of waiting alone for a step they have left. A failed all-reduce applies
    the local gradients (and the params of the group's peers may differ from then on).
    """

    _GROUP_KEY = 0  # run_averaging's "outer step": one constant key for the whole run (see the class doc)

    def __init__(self, config: PeerConfig, baseline: BaselineConfig, dht: Any, limits: Limits):
        from p2p_diloco.core.compression import make_codec
        from p2p_diloco.swarm.averaging import DilocoAverager
        from p2p_diloco.swarm.wire import WireCodec, part_values_for

        self.model = build_model(config.model, config.run.seed)  # same seed everywhere: identical start bytes
        self.params = list(self.model.parameters())
        self.optimizer = _adamw(config)(self.params)
        self.grad_clip_norm = config.inner.grad_clip_norm
        self.expected_peers = baseline.expected_peers
        self.timeout_s = config.swarm.averaging_timeout_s
        self.give_up = limits.out_of_time  # a peer whose groupmates left must not wait past its own end
        self.group_size, self.failed_allreduces = 1, 0
        codec = make_codec("none")  # uncompressed fp32 on the wire
        self.averager = DilocoAverager(
            [torch.zeros_like(p) for p in self.params],
            dht,
            wire_codec=WireCodec(codec, part_values_for(codec, sum(p.numel() for p in self.params))),
            state_provider=lambda: ({}, []),
            prefix=f"{config.swarm.run_id}_syncdp",
            start=True,
            target_group_size=baseline.expected_peers,
            min_matchmaking_time=config.swarm.matchmaking_time_s,
            # as SwarmLink. A follower whose join request times out after its leader accepted it (a full group
            # starts at once) leaves the leader a partial round: under heavy CPU load, about 1 step in 300 at 0.5 s
            request_timeout=min(1.0, config.swarm.matchmaking_time_s / 2),
            next_chunk_timeout=config.swarm.chunk_timeout_s,
            allreduce_timeout=config.swarm.averaging_timeout_s,
            allow_state_sharing=False,
            shutdown_timeout=5,
        )

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepTimes:
        from p2p_diloco.swarm.round import run_averaging

        started = time.monotonic()
        loss = _forward_backward(self.model, self.optimizer, inputs, targets)
        grads = [p.grad for p in self.params]
        computed = time.monotonic()
        if self.expected_peers > 1:
            outcome = run_averaging(
                self.averager, grads, float(inputs.numel()), self._GROUP_KEY, self.timeout_s, self.expected_peers,
                should_abort=self.give_up,
            )
            if outcome.status == "stale":
                # the run ended while we waited for a group (our groupmates have stopped): drop this step, as a
                # synchronous trainer would, so that the params stay the ones every peer holds
                return StepTimes(loss.item(), computed - started, time.monotonic() - computed, applied=False)
            if outcome.averaged is None:
                self.failed_allreduces += 1
                self.group_size = 1
                logger.warning("all-reduce failed (%s: %s): applying the local gradients", outcome.status, outcome.reason)
            else:
                for grad, averaged in zip(grads, outcome.averaged, strict=True):
                    grad.copy_(averaged)
                self.group_size = len(outcome.peers)
        averaged_at = time.monotonic()
        _clip(self.params, self.grad_clip_norm)
        self.optimizer.step()
        loss_value = loss.item()
        finished = time.monotonic()
        return StepTimes(loss_value, (computed - started) + (finished - averaged_at), averaged_at - computed)

    def fields(self) -> dict[str, Any]:
        return dict(group_size=self.group_size, failed_allreduces=self.failed_allreduces, epoch=None)

    def final_fields(self) -> dict[str, Any]:
        return dict(params_sha256=params_sha256(self.params))

    def close(self) -> None:
        # DilocoAverager ignores SIGTERM (it belongs to its peer): shutdown(), then SIGKILL what is left
        if self.averager.is_alive():
            self.averager.shutdown()
        self.averager.join(timeout=5)
        if self.averager.is_alive():
            self.averager.kill()
            self.averager.join(timeout=5)


class HivemindOptimizer:
    """``hivemind.Optimizer`` with local updates: AdamW every step, parameter averaging once per epoch.

    An ``opt.step()`` counts as communication when the local epoch advanced during it (averaging, or a state
    download) or when it began while hivemind's background averaging was still running: by default
    (``delay_state_averaging``) the epoch's averaging runs in the background, but the next ``opt.step()``
    waits for it, matchmaking included (seen here: ~matchmaking_time per epoch). Any other is compute.
    Records also carry ``opt_step_s``: all the time spent inside ``opt.step()``, local AdamW included.
    """

    def __init__(self, config: PeerConfig, baseline: BaselineConfig, dht: Any, limits: Limits):
        import hivemind

        self.model = build_model(config.model, config.run.seed)
        self.params = list(self.model.parameters())
        self.grad_clip_norm = config.inner.grad_clip_norm
        target = baseline.target_batch_size or baseline.expected_peers * config.inner.inner_steps * config.inner.batch_size
        self.optimizer = hivemind.Optimizer(
            dht=dht,
            run_id=f"{config.swarm.run_id}_hvopt",
            params=self.params,
            optimizer=_adamw(config),
            target_batch_size=target,
            batch_size_per_step=config.inner.batch_size,
            use_local_updates=True,
            matchmaking_time=config.swarm.matchmaking_time_s,
            averaging_timeout=config.swarm.averaging_timeout_s,
            # hivemind's defaults otherwise, as a user would have them: its join requests time out after 3 s (it
            # warns when that is not below matchmaking_time) and a state download after 600 s
            verbose=False,
        )
        self.shutdown_wait_s = config.run.shutdown_wait_s
        self.opt_step_s = 0.0  # cumulative seconds inside opt.step(), whichever way they were counted

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepTimes:
        started = time.monotonic()
        loss = _forward_backward(self.model, self.optimizer, inputs, targets)
        _clip(self.params, self.grad_clip_norm)
        epoch = self.optimizer.local_epoch
        averaging = any(not update.done() for update in self.optimizer.state_averager.pending_updates)
        stepping = time.monotonic()
        self.optimizer.step()
        stepped = time.monotonic()
        self.opt_step_s += stepped - stepping
        loss_value = loss.item()
        finished = time.monotonic()
        if averaging or self.optimizer.local_epoch != epoch:
            return StepTimes(loss_value, (stepping - started) + (finished - stepped), stepped - stepping)
        return StepTimes(loss_value, finished - started, 0.0)

    def fields(self) -> dict[str, Any]:
        # hivemind does not expose the group of its background averaging: the peers its tracker sees instead
        peers = max(1, self.optimizer.tracker.global_progress.num_peers)  # 0 until the tracker saw us
        return dict(group_size=peers, failed_allreduces=None, epoch=self.optimizer.local_epoch,
                    opt_step_s=round(self.opt_step_s, 4))

    def final_fields(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        # hivemind's shutdown first waits for a background averaging to land, up to its all-reduce timeout (60 s),
        # which can outlast a launcher's grace period: bounded here by shutdown_wait_s, then the averager is shut
        # down under it (the stuck thread is a daemon and goes with the process)
        closer = threading.Thread(target=self.optimizer.shutdown, name="hivemind-shutdown", daemon=True)
        closer.start()
        closer.join(timeout=self.shutdown_wait_s)
        if closer.is_alive():
            logger.warning("hivemind.Optimizer did not shut down within %.0f s: stopping its averager", self.shutdown_wait_s)
        averager = self.optimizer.state_averager
        if averager.is_alive():
            averager.shutdown()
        averager.join(timeout=5)
        if averager.is_alive():
            averager.kill()
            averager.join(timeout=5)
