"""What the DHT's parts of a peer's upkeep cost on the wire, each alone (root: one network namespace per member).

Idle members (no training, no averaging) run one case at a time and the kernel counts the bytes each sends:

- ``dht``: our DHT and its ``p2pd``, started as a peer starts them, nothing else;
- ``store``: plus one store of a progress record (a training peer's shape) every period;
- ``read``: plus one read of all records every period, as the beacon reads them (``latest=True``);
- ``read-local``: the same read with ``latest=False`` (a node that holds a replica answers from its own storage);
- ``beacon``: plus the progress beacon itself (read, then publish) at that period, with ``--progress-transport dht``;
- ``push``: plus one push of a progress record to every member this one knows, every period (no search, no read);
- ``beacon-push``: the beacon as a peer runs it with ``--progress-transport push``: records pushed, read
  locally, a DHT store and a DHT read every 10th period.

    sudo .venv/bin/python scripts/dht_traffic.py --out runs/dht-traffic [--members 4] [--period-s 1 5]

Writes dht_traffic.json and dht_traffic.md. The counted window starts only once every member is up, and a member
that is not alive at its end fails the case. Each member also stops by itself after a bounded lifetime; members are
stopped by process group, and the namespaces go at the end, on a failure, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

CASES = ("dht", "store", "read", "read-local", "beacon", "push", "beacon-push")
_KEY = "traffic_progress"
_READY_TIMEOUT_S = 90.0  # a member's DHT start-up, bootstrap retries included


def member(host: str, case: str, period_s: float, lifetime_s: float, address_file: str) -> int:
    """One member, inside its namespace, for at most ``lifetime_s`` (the parent stops it sooner): the first one
    writes its address for the others to join through. Returns the exit code."""
    from hivemind.utils import get_dht_time

    from p2p_diloco.core.config import SwarmConfig
    from p2p_diloco.swarm.joining import start_dht
    from p2p_diloco.swarm.progress import ProgressBeacon, ProgressReader, push_record

    end = time.monotonic() + lifetime_s
    dht = beacon = None
    try:
        path = Path(address_file)
        initial = (path.read_text().strip(),) if path.exists() else ()
        dht = start_dht(SwarmConfig(host_maddrs=(f"/ip4/{host}/tcp/0",), initial_peers=initial, run_id="traffic"))
        if not initial:
            address = next(str(a) for a in dht.get_visible_maddrs() if host in str(a))
            Path(f"{address_file}.tmp").write_text(address)
            os.replace(f"{address_file}.tmp", address_file)
        record = dict(round=3, round_tokens=123456, tokens=9876543, rate=1900.5, time=get_dht_time(), period=period_s,
                      outer_step=3, global_sha256="ab" * 32, round_budget=400000, banned=[])
        subkey = dht.peer_id.to_base58()

        def store() -> None:
            dht.store(_KEY, subkey=subkey, value=record, expiration_time=get_dht_time() + 600, return_future=True).result(10)

        def push() -> None:
            dht.run_coroutine(partial(push_record, key=_KEY, subkey=subkey, value=record,
                                      expiration_time=get_dht_time() + 600))

        if case in ("beacon", "beacon-push"):
            pushing = case == "beacon-push"
            beacon = ProgressBeacon(dht, _KEY, period_s, 3 * period_s + 5, ProgressReader(dht, _KEY, pushing), push=pushing)
            beacon.update(**record)
        elif case != "dht":
            store()
        print("ready", flush=True)
        while time.monotonic() < end:
            time.sleep(min(period_s if case != "dht" else 1.0, max(0.0, end - time.monotonic())))
            try:
                if case == "store":
                    store()
                elif case == "push":
                    push()
                elif case in ("read", "read-local"):
                    dht.get(_KEY, latest=case == "read", return_future=True).result(10)
            except Exception as e:  # a slow answer is part of what is measured, not a reason to stop
                print(f"{case}: {type(e).__name__}", file=sys.stderr, flush=True)
        return 0
    except Exception as e:
        print(f"member failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if beacon is not None:
            beacon.close()
        if dht is not None:
            dht.shutdown()


def measure(members: int, bandwidth_mbit: float, case: str, period_s: float, settle_s: float, measure_s: float,
            out: Path) -> list[float]:
    """Bytes per second each member sent during ``measure_s``, counted from ``settle_s`` after the last member
    was up; raises RuntimeError if a member did not come up or was not alive at the window's end."""
    from experiments.wan import Wan

    lifetime_s = members * _READY_TIMEOUT_S + settle_s + measure_s + 30  # only if the parent never stops it
    processes: list[subprocess.Popen] = []
    code_path = str(Path(__file__).resolve().parent.parent)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [code_path, os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as scratch, Wan(members, bandwidth_mbit, prefix="dhtt", subnet=79) as wan:
        address_file = str(Path(scratch) / "address")
        try:
            for index in range(members):
                log_path = out / f"{case}-{period_s:g}-member{index}.log"
                command = [*wan.command_prefix(index), sys.executable, "-m", "experiments.dht_traffic", "--member",
                           wan.host(index), case, str(period_s), str(lifetime_s), address_file]
                with open(log_path, "w") as log:  # the child has its own copy of the descriptor
                    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True,
                                               start_new_session=True, env=environment)
                processes.append(process)
                readable, _, _ = select.select([process.stdout], [], [], _READY_TIMEOUT_S)
                if not readable or process.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"member {index} did not come up within {_READY_TIMEOUT_S:.0f} s (see {log_path})")
            time.sleep(settle_s)
            started, before = time.monotonic(), [wan.wire_bytes(i)[0] for i in range(members)]
            time.sleep(measure_s)
            elapsed, after = time.monotonic() - started, [wan.wire_bytes(i)[0] for i in range(members)]
            gone = [i for i, process in enumerate(processes) if process.poll() is not None]
            if gone:
                raise RuntimeError(f"members {gone} were not alive at the end of the window (see their logs in {out})")
        finally:
            for process in processes:
                _stop(process)
    return [(a - b) / elapsed for a, b in zip(after, before)]


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM the member, give it a few seconds to leave, then SIGKILL its whole group (its DHT process too)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(10.0)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    if process.stdout is not None:
        process.stdout.close()


def main(argv: list[str] | None = None, prog: str = "dht_traffic.py") -> int:
    from p2p_diloco.cli.flags import OneLineParser

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--member"]:
        host, case, period_s, lifetime_s, address_file = argv[1:6]
        code = member(host, case, float(period_s), float(lifetime_s), address_file)
        sys.stdout.flush()
        os._exit(code)  # not sys.exit: multiprocessing's exit hook would wait forever on the DHT process (SIGTERM ignored)
    parser = OneLineParser(prog=prog, description="Bytes on the wire of the DHT's parts of a peer's upkeep (root).")
    parser.add_argument("--out", required=True, help="folder for dht_traffic.json, dht_traffic.md and the members' logs")
    parser.add_argument("--members", type=int, default=4, help="idle swarm members, one namespace each (default 4)")
    parser.add_argument("--bandwidth-mbit", type=float, default=20.0, help="each member's cap (default 20)")
    parser.add_argument("--period-s", type=float, nargs="+", default=[1.0, 5.0], help="periods to try (default 1 5)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="cases to run (default all)")
    parser.add_argument("--settle-s", type=float, default=20.0, help="time after start-up left out (default 20)")
    parser.add_argument("--measure-s", type=float, default=40.0, help="time counted per case (default 40)")
    args = parser.parse_args(argv)
    if not 2 <= args.members <= 16:
        parser.error(f"--members must be 2 to 16, got {args.members}")
    if not all(math.isfinite(v) and 0 < v <= 3600 for v in [*args.period_s, args.measure_s, args.bandwidth_mbit]):
        parser.error("--period-s, --measure-s and --bandwidth-mbit must be > 0 and at most 3600")
    if not (math.isfinite(args.settle_s) and 0 <= args.settle_s <= 3600):
        parser.error(f"--settle-s must be 0 to 3600, got {args.settle_s}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file, not a folder")
    from experiments.wan import WanError, unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"{prog}: error: {reason}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    code = 0
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM too stops the members and removes the namespaces
    try:
        for case in args.cases:
            for period_s in args.period_s if case != "dht" else [0.0]:
                rates = measure(args.members, args.bandwidth_mbit, case, period_s, args.settle_s, args.measure_s, out)
                row = dict(case=case, period_s=period_s, bytes_per_s=[round(r) for r in rates],
                           mean_bytes_per_s=round(statistics.fmean(rates)))
                rows.append(row)
                print(f"{case:<10} period {period_s:g} s: {row['mean_bytes_per_s']:,} B/s sent per member "
                      f"{row['bytes_per_s']}", flush=True)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; the cases measured so far are written", file=sys.stderr, flush=True)
        code = 130
    except (RuntimeError, OSError, WanError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    settings = dict(members=args.members, bandwidth_mbit=args.bandwidth_mbit, settle_s=args.settle_s, measure_s=args.measure_s)
    (out / "dht_traffic.json").write_text(json.dumps(dict(settings=settings, rows=rows), indent=1))
    lines = ["| case | period (s) | sent per member (B/s, mean) | per member |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['period_s']:g} | {r['mean_bytes_per_s']:,} | {r['bytes_per_s']} |" for r in rows]
    (out / "dht_traffic.md").write_text("\n".join(lines) + "\n")
    return code


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
