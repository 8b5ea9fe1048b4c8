"""Worker processes for the baselines that the benchmark runs side by side with p2p-diloco.

``python -m p2p_diloco.baselines --method {syncdp,hivemind-opt,bare} [flags] [peer flags]``

- ``bare``: the plain PyTorch loop (forward, backward, clip, AdamW step) in one process, no network: the
  compute limit. Per step it does exactly what ``Learner._inner_step`` computes, nothing more.
- ``syncdp``: synchronous data parallel over a hivemind swarm: every step the gradients are all-reduced
  (uncompressed fp32, token-weighted) with the other ``syncdp`` processes, then clipped and applied by AdamW.
  It uses our ``DilocoAverager``, whose results are bit-identical on every peer, so the params stay identical.
- ``hivemind-opt``: ``hivemind.Optimizer`` with local updates, as a hivemind user would set it up today
  (parameter averaging once the swarm has processed ``--target-batch-size`` samples, defaults otherwise).

Model, data, seeds and batch come from the same config and flags as a p2p-diloco peer. Each process writes
JSON-lines records (see ``Recorder``). This module does not compare methods or plot: the benchmark does.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from p2p_diloco.cli import (
    _configure_logging,
    _fail,
    _OneLineParser,
    add_peer_flags,
    open_process_inputs,
    resolve_config,
)
from p2p_diloco.config import PeerConfig, load_toml
from p2p_diloco.data import Dataset
from p2p_diloco.metrics import MetricsSink
from p2p_diloco.model import build_model, count_parameters
from p2p_diloco.outer import params_sha256

logger = logging.getLogger(__name__)

METHODS = ("syncdp", "hivemind-opt", "bare")
_DEFAULT_MATCHMAKING_TIME_S = 1.0  # syncdp averages every step: a peer's 5 s default would dominate


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
    """Forward, backward, clip, AdamW: ``Learner._inner_step`` without the swarm."""

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
        from p2p_diloco.averaging import DilocoAverager, WireCodec, part_values_for
        from p2p_diloco.compression import make_codec

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
        from p2p_diloco.averaging import run_averaging

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


class Recorder:
    """Cumulative counters of one process and the JSON-lines records made from them.

    Fields: method, time_s (since training began), unix_time, steps, tokens, compute_s, comm_s, eval_s
    (cumulative, seconds), loss (mean train loss since the previous record, null if no step), eval_loss
    (null unless this record follows an evaluation), group_size, failed_allreduces (syncdp), epoch
    (hivemind-opt), final; hivemind-opt adds opt_step_s, the final record of syncdp params_sha256.
    """

    def __init__(self, method: str, sink: MetricsSink, limits: Limits):
        self.method, self.sink, self.limits = method, sink, limits
        self.steps = self.tokens = 0
        self.compute_s = self.comm_s = self.eval_s = 0.0
        self._loss_sum, self._loss_steps = 0.0, 0

    def add_step(self, times: StepTimes, tokens: int) -> None:
        self.compute_s += times.compute_s
        self.comm_s += times.comm_s
        if times.applied:  # a dropped step cost time but trained on nothing
            self.steps += 1
            self.tokens += tokens
            self._loss_sum += times.loss
            self._loss_steps += 1

    def write(self, eval_loss: float | None, fields: dict[str, Any], final: bool = False) -> dict[str, Any]:
        record = dict(
            method=self.method,
            time_s=round(self.limits.elapsed_s(), 3),
            unix_time=round(time.time(), 3),
            steps=self.steps,
            tokens=self.tokens,
            compute_s=round(self.compute_s, 4),
            comm_s=round(self.comm_s, 4),
            eval_s=round(self.eval_s, 4),
            loss=self._loss_sum / self._loss_steps if self._loss_steps else None,
            eval_loss=eval_loss,
            final=final,
            **fields,
        )
        self._loss_sum, self._loss_steps = 0.0, 0
        self.sink.write(record)
        return record


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean held-out loss of the model's own params (as ``Learner.evaluate`` computes it)."""
    model.eval()
    losses = [model(inputs, targets).item() for inputs, targets in batches]
    model.train()
    return sum(losses) / len(losses)


def train(
    method: Method, config: PeerConfig, baseline: BaselineConfig, dataset: Dataset, recorder: Recorder,
    limits: Limits, evaluates: bool = True,
) -> dict[str, Any]:
    """The shared loop: step until a limit is reached; evaluate and record on wall-time schedules.

    Returns the final record. ``evaluates``: False on processes whose params another process evaluates.
    """
    eval_batches = dataset.eval_batches(config.run.eval_batches)

    def timed_eval() -> float | None:
        if not evaluates:
            return None
        started = time.monotonic()
        loss = evaluate(method.model, eval_batches)
        recorder.eval_s += time.monotonic() - started
        return loss

    wait_s = config.run.start_at_unix - time.time()
    if wait_s > 0:  # processes launched together (--start-at) begin together, whatever their startup took
        logger.info("waiting %.0f s for the agreed start time", wait_s)
        limits.stop.wait(wait_s)
    limits.begin()  # training begins: the clock of time_s and max_time_s
    recorder.write(timed_eval(), method.fields())
    next_record = limits.started + baseline.record_every_s
    next_eval = limits.started + baseline.eval_every_s if baseline.eval_every_s else float("inf")
    while not limits.reached(recorder.tokens):
        started = time.monotonic()
        inputs, targets = dataset.train.next_batch()
        loaded_s = time.monotonic() - started
        times = method.step(inputs, targets)
        times = times._replace(compute_s=times.compute_s + loaded_s)  # the learner counts loading as compute too
        if config.inner.throttle > 1:  # emulate older hardware, exactly as the learner does
            time.sleep((config.inner.throttle - 1) * times.compute_s)
            times = times._replace(compute_s=config.inner.throttle * times.compute_s)
        recorder.add_step(times, inputs.numel())
        now = time.monotonic()
        if now >= next_eval:
            recorder.write(timed_eval(), method.fields())
            next_eval = time.monotonic() + baseline.eval_every_s
            next_record = time.monotonic() + baseline.record_every_s
        elif now >= next_record:
            recorder.write(None, method.fields())
            next_record = now + baseline.record_every_s
    eval_loss = timed_eval()
    return recorder.write(eval_loss, {**method.fields(), **method.final_fields()}, final=True)


# command line ---------------------------------------------------------------------------------------------


def _parse(argv: list[str] | None, prog: str) -> tuple[argparse.Namespace, PeerConfig, BaselineConfig]:
    """Parse and validate; raises ValueError with a one-line reason (argparse errors exit 2 by themselves)."""
    parser = _OneLineParser(
        prog=prog,
        description="Run one baseline worker (syncdp, hivemind-opt or bare) for the benchmark. Takes every flag of a "
        "p2p-diloco peer; those of DiLoCo alone (outer optimizer, fragments, compression, checkpoints, --eval-every, "
        "--max-outer-steps) are accepted and ignored. --matchmaking-time-s defaults to 1 s here.",
    )
    parser.add_argument("--method", required=True, choices=METHODS, help="which baseline this process runs")
    parser.add_argument("--expected-peers", type=int, default=4, help="processes of this method in the run (default 4)")
    parser.add_argument("--target-batch-size", type=int, default=0, help="hivemind-opt: samples the swarm processes per epoch (default: expected peers x inner steps x batch size)")
    parser.add_argument("--max-tokens", type=int, default=0, help="stop after this process trained on this many tokens (default 0: no limit)")
    parser.add_argument("--record-every-s", type=float, default=5.0, help="seconds between metrics records (default 5)")
    parser.add_argument("--eval-every-s", type=float, default=30.0, help="seconds between held-out evaluations; 0 = at start and end only (default 30)")
    parser.add_argument("--config", metavar="FILE", help="TOML file with the peer's config sections; flags override it")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log verbosity on stderr (default INFO)")
    add_peer_flags(parser)
    args = parser.parse_args(argv)
    configured = load_toml(args.config).get("swarm", {}) if args.config else {}
    if "matchmaking_time_s" not in vars(args) and "matchmaking_time_s" not in configured:
        args.matchmaking_time_s = _DEFAULT_MATCHMAKING_TIME_S  # precedence kept: flag > file > this default
    config = resolve_config(args)
    baseline = BaselineConfig(
        method=args.method,
        expected_peers=args.expected_peers,
        target_batch_size=args.target_batch_size,
        max_tokens=args.max_tokens,
        record_every_s=args.record_every_s,
        eval_every_s=args.eval_every_s,
    )
    return args, config, baseline


def _start_method(config: PeerConfig, baseline: BaselineConfig, limits: Limits) -> tuple[Method, Any]:
    """Build the method (and the DHT it needs); print the address others join with, as a peer does."""
    if baseline.method == "bare":
        return Bare(config), None
    from p2p_diloco.swarm import start_dht

    if mp.get_start_method(allow_none=True) != "fork":  # hivemind's averagers are mp.Process (DESIGN.md §6)
        mp.set_start_method("fork", force=True)
    dht = start_dht(config.swarm)
    try:
        previous_sigint = signal.getsignal(signal.SIGINT)
        try:
            method_class = SyncDataParallel if baseline.method == "syncdp" else HivemindOptimizer
            method: Method = method_class(config, baseline, dht, limits)
        finally:
            signal.signal(signal.SIGINT, previous_sigint)  # hivemind ignores SIGINT in the caller (DESIGN.md §6)
    except BaseException:
        dht.shutdown()
        raise
    visible = [str(a) for a in dht.get_visible_maddrs()]
    addresses = [a for a in visible if "/127." not in a] or visible
    print(f"others can join with: --initial-peers {addresses[0] if addresses else '?'}", flush=True)
    print(f"all addresses: {' '.join(visible)}", flush=True)
    return method, dht


def _stop_dht(dht: Any) -> None:
    if dht is None:
        return
    if dht.is_alive():
        dht.shutdown()
    dht.join(timeout=5)
    if dht.is_alive():  # our DHT ignores SIGTERM, which hivemind's shutdown falls back to
        dht.kill()
        dht.join(timeout=5)


def main(argv: list[str] | None = None, prog: str = "python -m p2p_diloco.baselines") -> int:
    try:
        args, config, baseline = _parse(argv, prog)
    except ValueError as e:
        return _fail(prog, str(e))
    _configure_logging(args.log_level)
    try:
        dataset, sink = open_process_inputs(config)
    except (ValueError, OSError) as e:
        return _fail(prog, str(e))
    from p2p_diloco.swarm import SwarmStartError, reap_descendants

    stop = threading.Event()
    # installed before hivemind forks its averagers, so that a SIGTERM sent to the whole process group does
    # not kill them under us (a forked child inherits the handler; it just sets the child's own copy of stop)
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    limits = Limits(config.run.max_time_s, baseline.max_tokens, stop)
    method: Method | None = None
    dht = None
    try:
        method, dht = _start_method(config, baseline, limits)
        logger.info("%s: %s parameters, batch %d x %d tokens", baseline.method, f"{count_parameters(method.model):,}",
                    config.inner.batch_size, config.model.seq_len)
        evaluates = baseline.method != "syncdp" or config.data.shard_index == 0  # syncdp params are identical
        final = train(method, config, baseline, dataset, Recorder(baseline.method, sink, limits), limits, evaluates)
        rate = final["tokens"] / max(final["time_s"], 1e-9)
        print(f"{baseline.method} stopped after {final['steps']} steps, {final['tokens']:,} tokens in {final['time_s']:.1f} s "
              f"({rate:,.0f} tokens/s; compute {final['compute_s']:.1f} s, comm {final['comm_s']:.1f} s)", flush=True)
        code = 0
    except SwarmStartError as e:
        code = _fail(prog, f"could not join the swarm: {e}", code=1)
    finally:
        if method is not None:
            method.close()
        _stop_dht(dht)
        sink.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if baseline.method != "bare":
            reap_descendants()  # p2pd and anything a killed child orphaned go with this process
    if baseline.method == "bare":
        return code
    # hivemind shares tensors through torch's shm manager (its "file_system" strategy), a child that was just
    # reaped: freeing a shared tensor now aborts the process ("terminate called ... Broken pipe", exit 134).
    # Everything is recorded and closed, so leave before anything is freed; this also keeps a hivemind thread
    # stuck in a network wait from holding the process at interpreter exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
