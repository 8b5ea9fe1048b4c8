"""The read-only monitor (``scripts/monitor.py``): it joins a run's DHT as a client node (it stores nothing, holds
nobody's records, publishes no progress record, so it is never counted as a peer or asked to average), reads the
progress records every second, and serves the monitor page (observe/monitor.py) until Ctrl-C or SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from p2p_diloco.cli.peer import OneLineParser, configure_logging, fail
from p2p_diloco.core.config import SwarmConfig
from p2p_diloco.observe.monitor import MonitorServer
from p2p_diloco.observe.watch import SwarmWatch

logger = logging.getLogger(__name__)
_QUIET_WARNING_S = 15.0  # a read-only monitor that has found no peer after this long says what may be wrong


def monitor_main(argv: list[str] | None = None, prog: str = "monitor.py") -> int:
    """The read-only monitor: join a run's DHT without training and serve its monitor page."""

    parser = OneLineParser(prog=prog, description="Watch a p2p-diloco run in a web browser, without training: joins "
                            "the run's DHT as a client, reads the peers' progress records, serves a live page.")
    parser.add_argument("--run-id", required=True, help="the run to watch")
    parser.add_argument("--initial-peers", nargs="+", required=True, metavar="MULTIADDR", help="any peers of the run")
    parser.add_argument("--port", type=int, default=8470, help="TCP port of the page (default 8470; 0: any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="address the page listens on (default 127.0.0.1: this machine only)")
    parser.add_argument("--swarm-key-file", metavar="PATH", help="the run's swarm key, if it is a closed run (records are checked with it)")
    parser.add_argument("--allow-list", metavar="PATH", help="the run's allow-list, if it is closed by one (records are checked against it)")
    parser.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"], metavar="MULTIADDR", help="where the DHT client listens")
    parser.add_argument("--period-s", type=float, default=1.0, help="seconds between reads of the progress records (default 1)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    args = parser.parse_args(argv)
    try:
        config = SwarmConfig(run_id=args.run_id, initial_peers=tuple(args.initial_peers), host_maddrs=tuple(args.host_maddrs),
                             swarm_key_file=args.swarm_key_file, allow_list_file=args.allow_list)
        _check_monitor_args(config, args.port, args.period_s)
    except ValueError as e:
        return fail(prog, str(e))
    configure_logging(args.log_level)
    return _watch_run(config, args.host, args.port, args.period_s, prog)


def _check_monitor_args(config: SwarmConfig, port: int, period_s: float) -> None:
    from p2p_diloco.swarm.addresses import check_multiaddr
    from p2p_diloco.swarm.membership import RunMembership

    for address in config.initial_peers:
        check_multiaddr(address, need_peer_id=True)
    for address in config.host_maddrs:
        check_multiaddr(address, need_peer_id=False)
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be a TCP port in [0, 65535], got {port}")
    if not 0.1 <= period_s <= 3600:
        raise ValueError(f"--period-s must be in [0.1, 3600] seconds, got {period_s}")
    RunMembership.from_files(config.swarm_key_file, config.allow_list_file, None)  # the files can be read


def _watch_run(config: SwarmConfig, host: str, port: int, period_s: float, prog: str) -> int:
    from p2p_diloco.swarm.joining import SwarmStartError, start_dht
    from p2p_diloco.swarm.membership import RunMembership
    from p2p_diloco.swarm.processes import close_dht, reap_descendants
    from p2p_diloco.swarm.progress import read_progress

    watch = SwarmWatch(config.run_id, period_s=period_s)
    try:
        server = MonitorServer(watch, host, port)
    except OSError as e:
        return fail(prog, f"cannot serve the monitor on {host}:{port}: {e.strerror or e}")
    stop = threading.Event()
    dht = None
    try:
        membership = RunMembership.from_files(config.swarm_key_file, config.allow_list_file, None)
        dht = start_dht(config, membership.validators, mode="client")
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        progress_key = f"{config.run_id}.progress"
        watch.start(lambda: read_progress(dht, progress_key))
        print(f"watching run '{config.run_id}': open {server.url}", flush=True)
        if not stop.wait(_QUIET_WARNING_S) and not watch.snapshot()["peers"]:
            logger.warning("no progress records of run '%s' after %.0f s: is the run id right? A closed run needs "
                           "its --swarm-key-file or --allow-list", config.run_id, _QUIET_WARNING_S)
        stop.wait()
    except SwarmStartError as e:
        return fail(prog, f"could not join the swarm: {e}", code=1)
    finally:
        watch.close()
        server.close()
        if dht is not None:
            close_dht(dht)
        reap_descendants()  # the DHT process and its p2pd
    print("monitor stopped", flush=True)
    sys.stderr.flush()
    # as a peer does: everything is closed, and the interpreter's teardown is where this process died of SIGABRT
    # after "monitor stopped" in two full test runs ("terminate called after throwing an instance of
    # 'std::system_error' what(): Broken pipe"; which C++ object threw is not known)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(monitor_main())
