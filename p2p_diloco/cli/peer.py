"""Command line: ``p2p-diloco peer``, one learner island (its flags: cli/flags.py).

Precedence: defaults -> ``--config`` TOML file -> flags. Bad input ends with one line on stderr and a
non-zero exit, never a traceback. Everything the peer prints a person reads is printed here.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from p2p_diloco.cli import stacks
from p2p_diloco.cli.flags import OneLineParser, add_peer_flags, resolve_config
from p2p_diloco.core.config import PeerConfig

if TYPE_CHECKING:  # torch-heavy modules load only when a process starts training, not for --help
    from p2p_diloco.observe.metrics import MetricsSink
    from p2p_diloco.train.data import DataSource
    from p2p_diloco.train.island import Island

def configure_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if level != "DEBUG":
        for handler in logging.getLogger().handlers:
            handler.addFilter(_drop_hivemind_tracebacks)
    from p2p_diloco.swarm.hivemind_api import route_logs

    route_logs(debug=level == "DEBUG")  # hivemind's records through the root handler above


def _drop_hivemind_tracebacks(record: logging.LogRecord) -> bool:
    """hivemind logs a full traceback for every failed round; one line is enough outside DEBUG."""
    if record.name.startswith("hivemind"):
        record.exc_info, record.exc_text = None, None
    return True


def peer_main(argv: list[str] | None = None, prog: str = "p2p-diloco peer", link_class: type | None = None) -> int:
    """One learner island; ``link_class`` replaces the swarm link (a test's misbehaving peer: experiments/)."""
    parser = OneLineParser(prog=prog, description="Run one p2p-diloco learner island.")
    parser.add_argument("--config", metavar="FILE", help="TOML file with [model] [data] [inner] [outer] [swarm] [run] sections; flags override it")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log verbosity on stderr (default INFO)")
    parser.add_argument("--show-identity", action="store_true", help="print the public key and peer id of --identity PATH (made first if missing), the line to put on a closed run's --allow-list, and exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as a TOML file (every field, with its help) and exit")
    add_peer_flags(parser)
    args = parser.parse_args(argv)
    if args.show_identity:
        return _show_identity(getattr(args, "identity", None), prog)
    try:
        config = resolve_config(args)
    except ValueError as e:
        return fail(prog, str(e))
    if args.print_config:
        from p2p_diloco.core.config_load import dump_toml

        print(dump_toml(config), end="", flush=True)
        return 0
    for signum in (signal.SIGINT, signal.SIGTERM):  # until the peer is up; then its own handlers stop it cleanly
        signal.signal(signum, _interrupt_start)
    try:
        return _start_and_run_peer(args.log_level, config, prog, link_class)
    except _StoppedWhileStarting as e:
        return _stopped_while_starting(prog, e.signum)


def _start_and_run_peer(log_level: str, config: PeerConfig, prog: str, link_class: type | None) -> int:
    from p2p_diloco.swarm.hivemind_api import UNUSED_IMPORTS, load_on_first_use

    for name in UNUSED_IMPORTS:  # before hivemind is imported (configure_logging imports it)
        load_on_first_use(name)
    configure_logging(log_level)
    # a native crash (torch, gloo, bitsandbytes) prints every thread's Python stack before the process dies:
    # the one clue a volunteer's log or a CI run keeps of where it happened
    try:
        faulthandler.enable(file=sys.__stderr__)
    except (AttributeError, OSError, ValueError):  # no stderr with a file descriptor (a test capturing it)
        pass
    stacks.enable()  # SIGUSR1: every thread's stack into the log (the launcher asks a peer it is about to kill)
    return _run_peer(config, prog, link_class)


class _ReentrantEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition(threading.RLock())  # threading.Event's own lock, made re-entrant


def stop_event() -> threading.Event:
    """The peer's stop request, set by its SIGINT and SIGTERM handlers. A handler runs in the main thread between
    two of its bytecodes, also while that thread holds the event's lock (inside ``set()``, or inside ``wait()``
    before it sleeps): with ``threading.Event``'s plain lock it waited for itself forever. Seen in a CI run's chaos
    test: the launcher's SIGTERM, then its stop's second SIGTERM arriving inside the first handler's ``set()``; the
    peer hung until SIGKILLed. Its lock is re-entrant here, so a handler's ``set()`` always returns."""
    return _ReentrantEvent()


class _StoppedWhileStarting(BaseException):  # not an Exception: no ``except Exception`` on the way keeps it
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt_start(signum: int, _frame: object) -> None:
    raise _StoppedWhileStarting(signum)


def _stopped_while_starting(prog: str, signum: int) -> int:
    """Ctrl-C or SIGTERM before the peer was up (importing, loading, waiting for ``--join-ready-file``, starting
    its DHT): one line, whatever of the swarm's processes had started gone, and 128 + the signal's number."""
    for ignored in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not interrupt the cleaning up
        signal.signal(ignored, signal.SIG_IGN)
    if "p2p_diloco.swarm.processes" in sys.modules:  # the DHT, averager and p2pd may be running
        sys.modules["p2p_diloco.swarm.processes"].reap_descendants()
    print(f"{prog}: stopped by {signal.Signals(signum).name} while starting, before it was in the swarm", file=sys.stderr, flush=True)
    return 128 + signum


def _show_identity(path: str | None, prog: str) -> int:
    """Prints ``<public key>  # peer <peer id>``: one line of an allow-list."""
    if not path:
        return fail(prog, "--show-identity needs --identity PATH (the key file to show, made if missing)")
    from p2p_diloco.cli.preflight import check_identity_file
    from p2p_diloco.swarm.membership import load_identity

    try:
        check_identity_file(Path(path))
        identity = load_identity(path)
    except ValueError as e:
        return fail(prog, str(e))
    print(f"{identity.public_key}  # peer {identity.peer_id}", flush=True)
    return 0


def fail(prog: str, message: str, code: int = 2) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return code


def open_process_inputs(config: PeerConfig, island: Island | None = None) -> tuple[DataSource, MetricsSink]:
    """What every training process of a run opens first, the same way (a peer, and the benchmark's baselines,
    which must read the same shard as a peer would): torch's thread count, the data shard (this rank's part of
    it in a multi-rank island) and the metrics sink (none but on rank 0). Raises ValueError or OSError with a
    one-line reason."""
    import torch

    from p2p_diloco.observe.metrics import NullSink, open_sink
    from p2p_diloco.train.data import open_dataset

    torch.set_num_threads(config.run.threads)
    data = island.shard(config.data) if island else config.data
    dataset = open_dataset(data, config.model.seq_len, config.inner.batch_size, config.run.seed)
    if island and not island.is_leader:
        return dataset, NullSink()
    return dataset, open_sink(config.run.metrics_file, config.run.tensorboard_dir)


def _start_island(config: PeerConfig) -> Island:
    """This process's island: the torchrun ranks of the environment (RANK, WORLD_SIZE), or a single process."""
    from p2p_diloco.train import island

    return island.Island.from_environment(os.environ, island.collective_timeout_s(config), config.run.island_sharding,
                                          device=config.run.device, precision=config.inner.precision)


def _join_through_ready_file(config: PeerConfig) -> PeerConfig:
    """``config`` with the address in ``--join-ready-file`` among its initial peers, once that peer wrote it."""
    if not config.swarm.join_ready_file:
        return config
    from dataclasses import replace

    from p2p_diloco.cli.ready import wait_for_join_address
    from p2p_diloco.swarm.addresses import check_multiaddr

    address = wait_for_join_address(config.swarm.join_ready_file, config.swarm.startup_timeout_s)
    check_multiaddr(address, need_peer_id=True)
    return replace(config, swarm=replace(config.swarm, initial_peers=(*config.swarm.initial_peers, address)))


STUCK_AFTER_STOP_S = 30.0  # beyond shutdown_wait_s: a stop request not done by then prints every thread's stack
_FOLLOWER_GRACE_S = 10.0  # beyond rank 0's own shutdown wait; under torchrun's 30 s before it SIGKILLs


def _leave_unless_stopped(rank: int, deadline_s: float) -> None:
    """On SIGTERM or SIGINT a follower waits for rank 0's stop (it comes within one inner step and rank 0's
    settling); past ``deadline_s`` rank 0 is taken for gone and the process leaves. torchrun signals the other
    ranks when rank 0 dies, but rank 0's forked swarm processes keep its sockets open, so a collective would
    otherwise wait for its full timeout."""
    logging.getLogger("p2p_diloco.peer").info("rank %d stops when rank 0 does (at most %.0f s from now)", rank, deadline_s)

    def leave() -> None:
        print(f"island rank {rank}: rank 0 did not stop the island within {deadline_s:.0f} s; leaving", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(deadline_s, leave)
    timer.daemon = True
    timer.start()


def _follow(config: PeerConfig, island: Island, prog: str) -> int:
    """A rank other than 0 of a torchrun island: train in step with rank 0 until it stops; no swarm, no files."""
    from p2p_diloco.train.learner import Learner

    stop = stop_event()  # ends a wait for the agreed start time; the training stops when rank 0 says so

    def request_stop(*_: object) -> None:
        if stop.is_set():  # a second signal: the first one's stop is under way
            return
        stop.set()
        _leave_unless_stopped(island.rank, config.run.shutdown_wait_s + _FOLLOWER_GRACE_S)

    for signum in (signal.SIGINT, signal.SIGTERM):  # torchrun and Ctrl-C signal every rank
        signal.signal(signum, request_stop)
    try:
        dataset, metrics = open_process_inputs(config, island)
        Learner(config, dataset, metrics, stop, island).follow()
        code = 0
    except (ValueError, OSError) as e:
        code = fail(prog, f"island rank {island.rank}: {e}")
    except Exception as e:  # rank 0 went away (its socket closed) or a collective timed out: the island is over
        code = fail(prog, f"island rank {island.rank} stopped: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}", code=1)
    finally:
        island.close()
    if code == 0:
        print(f"island rank {island.rank} stopped", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # as rank 0 does: nothing is left to save, and the interpreter's teardown would run torch's C++ destructors
    # (the DDP reducer, the process group's threads) for nothing. Once in CI a rank died of SIGABRT as the island
    # ended, where exactly is not known (the log kept no stack: faulthandler now prints one); this removes the
    # teardown from the places it could have been
    os._exit(code)


def _run_peer(config: PeerConfig, prog: str, link_class: type | None = None) -> int:
    from p2p_diloco.cli.ready import write_ready_file
    from p2p_diloco.observe.display import TerminalProgress
    from p2p_diloco.observe.metrics import FanOutSink
    from p2p_diloco.observe.monitor import MonitorServer
    from p2p_diloco.observe.watch import SwarmWatch
    from p2p_diloco.swarm.joining import SwarmStartError
    from p2p_diloco.swarm.processes import reap_descendants
    from p2p_diloco.swarm.swarm_link import SwarmLink
    from p2p_diloco.train.learner import Learner
    from p2p_diloco.train.model import count_parameters

    log = logging.getLogger("p2p_diloco.peer")
    if config.swarm.compression == "topk" and config.outer.momentum > 0:
        log.warning("--compression topk with outer momentum %g: measured far worse than with plain averaging "
                    "(--outer-lr 1 --outer-momentum 0), whose error feedback stands in for the momentum (docs/learning.md)",
                    config.outer.momentum)
    try:
        island = _start_island(config)
    except ValueError as e:  # --island-sharding fsdp without torchrun, say
        return fail(prog, str(e))
    if not island.is_leader:
        return _follow(config, island, prog)
    try:
        dataset, metrics = open_process_inputs(config, island)
    except (ValueError, OSError) as e:
        return fail(prog, str(e))
    # what people watching see: the swarm as this peer knows it, in the terminal and (optionally) a web page
    watch = SwarmWatch(config.swarm.run_id)
    progress = TerminalProgress(watch)
    metrics = FanOutSink([metrics, watch, progress])
    stop = stop_event()
    try:
        learner = Learner(config, dataset, metrics, stop, island)
        resumed = learner.resume() if config.run.resume else None
    except ValueError as e:
        metrics.close()
        return fail(prog, str(e))
    if config.run.resume:
        print(f"resumed from {resumed} at outer step {learner.outer_step}" if resumed
              else f"no checkpoint in {config.run.checkpoint_dir} yet: starting fresh", flush=True)
    log.info("resolved config: %s", json.dumps(config.to_dict(), sort_keys=True))
    import torch

    log.info("torch %s on %s, inner steps in %s: CPU kernels %s, %d threads", torch.__version__, island.device,
             island.inner_precision, torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())
    try:  # model and data are loaded: join a peer started with us as soon as it is in the swarm
        config = _join_through_ready_file(config)
    except ValueError as e:
        metrics.close()
        return fail(prog, str(e), code=1)
    try:
        link = (link_class or SwarmLink)(config.swarm, learner.averaging_template(), learner.state_for_peers,
                                         config.inner.fragments)
    except SwarmStartError as e:
        metrics.close()
        return fail(prog, f"could not join the swarm: {e}", code=1)

    def request_stop(*_: object) -> None:
        if stop.is_set():  # a second signal (the launcher's SIGTERM, then its stop's): the first one's is under way
            return
        stop.set()
        # a peer still running well past its shutdown wait is stuck somewhere: its stacks say where (cli/stacks.py)
        stacks.arm(config.run.shutdown_wait_s + STUCK_AFTER_STOP_S)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)
    monitor = None
    try:
        if config.run.monitor_port:  # after the link: the forked DHT and averager processes must not inherit the socket
            try:
                monitor = MonitorServer(watch, config.run.monitor_host, config.run.monitor_port)
            except OSError as e:
                host, port = config.run.monitor_host, config.run.monitor_port
                return fail(prog, f"cannot serve the monitor on {host}:{port}: {e.strerror or e}")
        addresses = " ".join(a for a in link.visible_maddrs() if "/127." not in a) or " ".join(link.visible_maddrs())
        print(f"peer {link.peer_id} in run '{config.swarm.run_id}': {count_parameters(learner.model):,} parameters, "
              f"{dataset.total_bytes / 1e6:.1f} MB of data", flush=True)
        print(link.reachability.line, flush=True)
        if link.reachability.mode == "relay":  # dialled through its relay
            addresses = " ".join(a for a in link.visible_maddrs() if "/p2p-circuit" in a) or addresses
        join_address = addresses.split()[0] if addresses and link.reachability.mode != "client" else None
        if join_address is not None:
            print(f"others can join with: --initial-peers {join_address}", flush=True)
        print(f"all addresses: {' '.join(link.visible_maddrs())}", flush=True)
        if config.run.ready_file:
            write_ready_file(config.run.ready_file, link.peer_id, join_address, link.visible_maddrs())
        watch.start(link.progress_records, self_id=link.peer_id)
        if monitor is not None:
            print(f"swarm monitor: {monitor.url}", flush=True)
        progress.start()
        learner.run(link)
    finally:
        metrics.close()  # the watch and the live display too: what follows prints below the table
        if monitor is not None:
            monitor.close()
        served = link.states_served()  # before close: the averager that counts them goes with it
        link.close()
        island.close()
        # this program owns its children: p2pd and anything else a killed child orphaned go with it
        reap_descendants()
    print(f"peer {link.peer_id} stopped at outer step {learner.outer_step}, "
          f"having served {served[0]} states ({served[1]:,} B) to peers catching up", flush=True)
    sys.stderr.flush()
    # everything is saved and closed; an abandoned averaging thread stuck in hivemind must not keep the
    # process alive at interpreter exit (it would outlive the launcher's grace period and be SIGKILLed)
    os._exit(0)
