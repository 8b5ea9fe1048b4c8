"""Worker processes for the baselines that the benchmark runs side by side with p2p-diloco.

``python -m experiments.baselines --method {syncdp,hivemind-opt,bare} [flags] [peer flags]``

- ``bare``: the plain PyTorch loop (forward, backward, clip, AdamW step) in one process, no network: the
  compute limit. Per step it does exactly what ``Learner.inner_step`` computes, nothing more.
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
from typing import Any

import torch

from experiments.baseline_methods import (
    DEFAULT_MATCHMAKING_TIME_S,
    METHODS,
    Bare,
    BaselineConfig,
    HivemindOptimizer,
    Limits,
    Method,
    StepTimes,
    SyncDataParallel,
)
from p2p_diloco.cli.flags import OneLineParser, add_peer_flags, resolve_config
from p2p_diloco.cli.peer import configure_logging, fail, open_process_inputs
from p2p_diloco.core.config import PeerConfig
from p2p_diloco.core.config_load import load_toml
from p2p_diloco.observe.metrics import MetricsSink
from p2p_diloco.train.data import Dataset
from p2p_diloco.train.model import count_parameters

logger = logging.getLogger(__name__)


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
    parser = OneLineParser(
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
        args.matchmaking_time_s = DEFAULT_MATCHMAKING_TIME_S  # precedence kept: flag > file > this default
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
    from p2p_diloco.swarm.joining import start_dht

    if mp.get_start_method(allow_none=True) != "fork":  # hivemind's averagers are mp.Process (docs/design.md §6)
        mp.set_start_method("fork", force=True)
    dht = start_dht(config.swarm)
    try:
        previous_sigint = signal.getsignal(signal.SIGINT)
        try:
            method_class = SyncDataParallel if baseline.method == "syncdp" else HivemindOptimizer
            method: Method = method_class(config, baseline, dht, limits)
        finally:
            signal.signal(signal.SIGINT, previous_sigint)  # hivemind ignores SIGINT in the caller (docs/design.md §6)
    except BaseException:
        dht.shutdown()
        raise
    visible = [str(a) for a in dht.get_visible_maddrs()]
    addresses = [a for a in visible if "/127." not in a] or visible
    print(f"others can join with: --initial-peers {addresses[0] if addresses else '?'}", flush=True)
    print(f"all addresses: {' '.join(visible)}", flush=True)
    if config.run.ready_file:
        from p2p_diloco.cli.ready import write_ready_file

        write_ready_file(config.run.ready_file, dht.peer_id.to_base58(), addresses[0] if addresses else None, visible)
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


def main(argv: list[str] | None = None, prog: str = "python -m experiments.baselines") -> int:
    try:
        args, config, baseline = _parse(argv, prog)
    except ValueError as e:
        return fail(prog, str(e))
    configure_logging(args.log_level)
    try:
        dataset, sink = open_process_inputs(config)
    except (ValueError, OSError) as e:
        return fail(prog, str(e))
    from p2p_diloco.swarm.joining import SwarmStartError
    from p2p_diloco.swarm.processes import reap_descendants

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
        code = fail(prog, f"could not join the swarm: {e}", code=1)
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
