"""What the DHT's parts of a peer's upkeep cost on the wire, each alone (root: one network namespace per member).

Idle members (no training, no averaging) run one case at a time and the kernel counts the bytes each sends:

- ``dht``: our DHT and its ``p2pd``, started as a peer starts them, nothing else;
- ``store``: plus one store of a progress record (a training peer's shape) every period;
- ``read``: plus one read of all records every period, as the beacon reads them (``latest=True``);
- ``read-local``: the same read with ``latest=False`` (a node that holds a replica answers from its own storage);
- ``beacon``: plus the progress beacon itself (read, then publish) at that period.

    sudo .venv/bin/python scripts/dht_traffic.py --out runs/dht-traffic [--members 4] [--period-s 1 5]

Writes dht_traffic.json and dht_traffic.md. Every member stops by itself after its case's time; the namespaces go
at the end, on a failure and on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = ("dht", "store", "read", "read-local", "beacon")
_KEY = "traffic_progress"


def member(host: str, case: str, period_s: float, run_s: float, address_file: str) -> None:
    """One member, inside its namespace: the first one writes its address for the others to join through."""
    from hivemind.utils import get_dht_time

    from p2p_diloco.config import SwarmConfig
    from p2p_diloco.joining import start_dht
    from p2p_diloco.swarm import ProgressBeacon, read_progress

    path = Path(address_file)
    initial = (path.read_text().strip(),) if path.exists() else ()
    dht = start_dht(SwarmConfig(host_maddrs=(f"/ip4/{host}/tcp/0",), initial_peers=initial, run_id="traffic"))
    if not initial:
        address = next(str(a) for a in dht.get_visible_maddrs() if host in str(a))
        Path(f"{address_file}.tmp").write_text(address)
        os.replace(f"{address_file}.tmp", address_file)
    print("ready", flush=True)
    record = dict(round=3, round_tokens=123456, tokens=9876543, rate=1900.5, time=get_dht_time(), period=period_s,
                  outer_step=3, global_sha256="ab" * 32, round_budget=400000, banned=[])
    subkey = dht.peer_id.to_base58()

    def store() -> None:
        dht.store(_KEY, subkey=subkey, value=record, expiration_time=get_dht_time() + 600, return_future=True).result(10)

    beacon = None
    if case == "beacon":
        beacon = ProgressBeacon(dht, _KEY, period_s, 3 * period_s + 5, lambda: read_progress(dht, _KEY))
        beacon.update(**record)
    elif case != "dht":
        store()
    end = time.monotonic() + run_s
    while time.monotonic() < end:
        time.sleep(min(period_s, max(0.0, end - time.monotonic())))
        try:
            if case == "store":
                store()
            elif case in ("read", "read-local"):
                dht.get(_KEY, latest=case == "read", return_future=True).result(10)
        except Exception as e:  # a slow answer is part of what is measured, not a reason to stop
            print(f"{case}: {type(e).__name__}", file=sys.stderr, flush=True)
    if beacon is not None:
        beacon.close()
    dht.shutdown()


def measure(members: int, bandwidth_mbit: float, case: str, period_s: float, settle_s: float, measure_s: float,
            out: Path) -> list[float]:
    """Bytes per second each member sent during ``measure_s``, after ``settle_s`` of start-up."""
    from p2p_diloco.wan import Wan, clean

    clean("dhtt")  # what a crashed run of this script left
    address_file = out / f"address-{case}-{period_s:g}"
    address_file.unlink(missing_ok=True)
    run_s = settle_s + measure_s + 10
    processes: list[subprocess.Popen] = []
    with Wan(members, bandwidth_mbit, prefix="dhtt", subnet=79) as wan:
        try:
            for index in range(members):
                log = open(out / f"{case}-{period_s:g}-member{index}.log", "w")  # noqa: SIM115 -- kept by the child
                command = [*wan.command_prefix(index), sys.executable, "-m", "p2p_diloco.dht_traffic", "--member",
                           wan.host(index), case, str(period_s), str(run_s), str(address_file)]
                process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
                processes.append(process)
                if process.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"member {index} did not start (see {log.name})")
            time.sleep(settle_s)
            before = [wan.wire_bytes(i)[0] for i in range(members)]
            time.sleep(measure_s)
            after = [wan.wire_bytes(i)[0] for i in range(members)]
        finally:
            for process in processes:
                _stop(process)
    return [(a - b) / measure_s for a, b in zip(after, before)]


def _stop(process: subprocess.Popen) -> None:
    for signum, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        try:
            process.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None, prog: str = "dht_traffic.py") -> int:
    from p2p_diloco.cli import _OneLineParser

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--member"]:
        host, case, period_s, run_s, address_file = argv[1:6]
        member(host, case, float(period_s), float(run_s), address_file)
        return 0
    parser = _OneLineParser(prog=prog, description="Bytes on the wire of the DHT's parts of a peer's upkeep (root).")
    parser.add_argument("--out", required=True, help="folder for dht_traffic.json, dht_traffic.md and the members' logs")
    parser.add_argument("--members", type=int, default=4, help="idle swarm members, one namespace each (default 4)")
    parser.add_argument("--bandwidth-mbit", type=float, default=20.0, help="each member's cap (default 20)")
    parser.add_argument("--period-s", type=float, nargs="+", default=[1.0, 5.0], help="periods to try (default 1 5)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="cases to run (default all)")
    parser.add_argument("--settle-s", type=float, default=20.0, help="start-up time left out of the count (default 20)")
    parser.add_argument("--measure-s", type=float, default=40.0, help="time counted per case (default 40)")
    args = parser.parse_args(argv)
    if not 2 <= args.members <= 16:
        parser.error(f"--members must be 2 to 16, got {args.members}")
    if min(args.period_s) <= 0 or args.settle_s < 0 or args.measure_s <= 0:
        parser.error("--period-s and --measure-s must be > 0, --settle-s >= 0")
    from p2p_diloco.wan import unavailable_reason

    reason = unavailable_reason()
    if reason:
        print(f"{prog}: error: {reason}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in args.cases:
        for period_s in args.period_s if case != "dht" else [0.0]:
            try:
                rates = measure(args.members, args.bandwidth_mbit, case, period_s, args.settle_s, args.measure_s, out)
            except (RuntimeError, OSError) as e:
                print(f"{prog}: error: {case} at {period_s:g} s: {e}", file=sys.stderr)
                return 1
            row = dict(case=case, period_s=period_s, bytes_per_s=[round(r) for r in rates],
                       mean_bytes_per_s=round(statistics.fmean(rates)))
            rows.append(row)
            print(f"{case:<10} period {period_s:g} s: {row['mean_bytes_per_s']:,} B/s sent per member {row['bytes_per_s']}",
                  flush=True)
    settings = dict(members=args.members, bandwidth_mbit=args.bandwidth_mbit, settle_s=args.settle_s, measure_s=args.measure_s)
    (out / "dht_traffic.json").write_text(json.dumps(dict(settings=settings, rows=rows), indent=1))
    lines = ["| case | period (s) | sent per member (B/s, mean) | per member |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['period_s']:g} | {r['mean_bytes_per_s']:,} | {r['bytes_per_s']} |" for r in rows]
    (out / "dht_traffic.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
