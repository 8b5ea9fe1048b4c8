"""What one DHT operation costs in CPU, on each side, for the breakdown in docs/benchmarks.md ("Where a peer's time
goes"): two hivemind DHTs on 127.0.0.1 (each a process with its ``p2pd``); A reads a key that B stored, N times
from its own storage and N times from B (a DHT find: A asks B, B answers), then sleeps as long to show what the
processes cost idle. Prints and writes ``dht_op_cost.json``: milliseconds of CPU per read of the caller (the
process that calls ``dht.get``), A's DHT process, A's ``p2pd``, B's DHT process and B's ``p2pd`` (Linux /proc).

    python scripts/dht_op_cost.py --out runs/dht-ops [--reads 300] [--as-hivemind]

The DHTs are started as a peer starts its own (``start_dht``): a future the caller sends goes without its pipe
(swarm/future_pipes.py) and each message to ``p2pd`` in one write (swarm/p2p_writes.py); ``--as-hivemind`` measures
hivemind's own calls and framing instead.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

_SIDES = ("caller", "A dht", "A p2pd", "B dht", "B p2pd")
_TIMEOUT_S = 30.0  # for a DHT to start, and for each store and read


def _cpu(dhts: list) -> list[float]:
    from p2p_diloco.swarm.processes import cpu_seconds

    figures = [time.process_time()]
    for dht in dhts:
        own = cpu_seconds([dht.pid], with_descendants=False) or 0.0
        family = cpu_seconds([dht.pid], with_descendants=True) or 0.0
        figures += [own, max(0.0, family - own)]  # the DHT's process; its p2pd (its only child)
    return figures


def _per_read(before: list[float], after: list[float], reads: int) -> dict[str, float]:
    return {side: round(1000 * (b - a) / reads, 3) for side, a, b in zip(_SIDES, before, after, strict=True)}


def _start(as_hivemind: bool, **kwargs):
    from hivemind import DHT

    from p2p_diloco.swarm import future_pipes, p2p_writes

    if not as_hivemind:
        p2p_writes.install()
        future_pipes.before_fork()
    dht = DHT(start=False, **kwargs)
    if not as_hivemind:
        future_pipes.to_child(dht._outer_pipe)
    dht.run_in_background(await_ready=True, timeout=_TIMEOUT_S)
    return dht


def measure(reads: int, as_hivemind: bool = False) -> dict:
    a, b = None, None
    try:
        a = _start(as_hivemind)
        b = _start(as_hivemind, initial_peers=[str(address) for address in a.get_visible_maddrs()])
        for dht, key in ((b, "key"), (a, "local")):
            dht.store(key, "value", expiration_time=time.time() + 600, return_future=True).result(timeout=_TIMEOUT_S)
        time.sleep(2.0)  # let both settle after bootstrap
        rows = {}
        for name, key, latest in (("local read", "local", False), ("remote read (a find to B)", "key", True)):
            before, started = _cpu([a, b]), time.monotonic()
            for _ in range(reads):
                if a.get(key, latest=latest, return_future=True).result(timeout=_TIMEOUT_S) is None:
                    raise RuntimeError(f"{name}: the key was not found")
            wall_s = time.monotonic() - started
            rows[name] = dict(**_per_read(before, _cpu([a, b]), reads), wall_ms=round(1000 * wall_s / reads, 3))
        before = _cpu([a, b])
        time.sleep(wall_s)
        rows["idle, the same wall time"] = _per_read(before, _cpu([a, b]), reads)
        return rows
    finally:
        for dht in (a, b):
            if dht is not None and dht.is_alive():
                dht.shutdown()


def main(argv: list[str] | None = None, prog: str = "dht_op_cost.py") -> int:
    from p2p_diloco.cli.flags import OneLineParser

    parser = OneLineParser(prog=prog, description="CPU per DHT read, on each side (docs/benchmarks.md).")
    parser.add_argument("--out", required=True, help="folder for dht_op_cost.json")
    parser.add_argument("--reads", type=int, default=300, help="reads of each kind (1 to 100000, default 300)")
    parser.add_argument("--as-hivemind", action="store_true",
                        help="hivemind's own calls and framing, not a peer's (swarm/future_pipes.py, swarm/p2p_writes.py)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not 1 <= args.reads <= 100_000:
        parser.error(f"--reads must be 1 to 100000, got {args.reads}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file, not a folder")
    if not Path("/proc/self/stat").exists():
        parser.error("needs Linux's /proc to read the processes' CPU time")
    out.mkdir(parents=True, exist_ok=True)
    rows = measure(args.reads, args.as_hivemind)
    print(f"CPU ms per read ({args.reads} reads of each kind, {'hivemind' if args.as_hivemind else 'as a peer'}'s calls):")
    for name, row in rows.items():
        print(f"  {name:<28} " + "  ".join(f"{side} {value:.2f}" for side, value in row.items()))
    (out / "dht_op_cost.json").write_text(json.dumps(dict(reads=args.reads, as_hivemind=args.as_hivemind, rows=rows), indent=1))
    return 0
