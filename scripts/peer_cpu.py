"""Where a running peer's CPU time goes, per process and per thread, over a window (Linux /proc).

    python scripts/peer_cpu.py PID [--window-s 60] [--out FILE.json]

PID is a peer's trainer process (``p2p-diloco peer``). Reads the CPU time (user + system) of that process's threads
and of every process descended from it (the DHT's, its ``p2pd``, the averager's) at the start and the end of the
window, and prints CPU seconds per minute of each. Thread names come from ``py-spy dump`` when py-spy is installed
(``pip install py-spy``; one snapshot, no sampling), otherwise threads are listed by id. Reading /proc costs
nothing measurable; the figures go in docs/benchmarks.md ("Where a peer's time goes").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_s(stat_path: str) -> float | None:
    """User + system CPU seconds from a /proc stat file, or None if it is gone."""
    try:
        fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15 of stat)


def children_of(pid: int) -> list[int]:
    found, stack = [], [pid]
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    while stack:
        for child in parents.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def describe(pid: int) -> str:
    """What a child process of the peer is: ``p2pd``, or the command line of a Python child (DHT, averager)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    if "p2pd" in command:
        return "p2pd"
    comm = Path(f"/proc/{pid}/comm").read_text().strip() if Path(f"/proc/{pid}/comm").exists() else "?"
    return f"child ({comm}): {command[:60]}"


def thread_names(pid: int) -> dict[int, str]:
    """Python thread names by native thread id, from one ``py-spy dump`` (empty without py-spy)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return {}
    try:
        dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names = {}
    for match in re.finditer(r'Thread (0x[0-9A-Fa-f]+|\d+) \(([^)]*)\): "([^"]*)"', dump):
        ident = match.group(1)
        names[int(ident, 16) if ident.startswith("0x") else int(ident)] = match.group(3)
    return names


def snapshot(pid: int) -> dict[str, float]:
    figures = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        value = cpu_s(f"/proc/{pid}/task/{tid}/stat")
        if value is not None:
            figures[f"thread {tid}"] = value
    for child in children_of(pid):
        value = cpu_s(f"/proc/{child}/stat")
        if value is not None:
            figures[f"process {child}"] = value
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not Path(f"/proc/{args.pid}").exists():
        print(f"peer_cpu.py: no process {args.pid}", file=sys.stderr)
        return 2
    names = thread_names(args.pid)
    labels = {f"process {child}": describe(child) for child in children_of(args.pid)}
    before, started = snapshot(args.pid), time.monotonic()
    time.sleep(args.window_s)
    after, window = snapshot(args.pid), time.monotonic() - started
    rows = []
    for key, end in after.items():
        if key not in before:
            continue
        kind, ident = key.split()
        label = labels.get(key, "?") if kind == "process" else names.get(int(ident), f"thread {ident}")
        rows.append(dict(what=f"{kind} {ident}", label=label, cpu_s_per_min=round((end - before[key]) * 60 / window, 2)))
    rows.sort(key=lambda row: -row["cpu_s_per_min"])
    total = sum(row["cpu_s_per_min"] for row in rows)
    print(f"CPU seconds per minute of peer {args.pid} over {window:.0f} s (total {total:.1f}):")
    for row in rows:
        if row["cpu_s_per_min"] > 0:
            print(f"  {row['cpu_s_per_min']:7.2f}  {row['what']:<16} {row['label']}")
    if args.out:
        args.out.write_text(json.dumps(dict(pid=args.pid, window_s=round(window, 1), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
