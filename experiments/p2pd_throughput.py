"""How fast one stream between two ``p2pd`` daemons on 127.0.0.1 carries data, for each ``--p2pd-threads`` value.

    python scripts/p2pd_throughput.py [--threads 1 0] [--messages 300] [--message-mib 1] [--out FILE.json]

For each value of ``--threads`` (``GOMAXPROCS`` of both daemons; 0: Go's default, one per core), starts two hivemind
``P2P`` daemons, sends ``--messages`` messages of ``--message-mib`` MiB through one stream of a protobuf handler (as
an all-reduce part or a state download travels), and prints MiB/s and the CPU both daemons spent. The figures are
quoted in docs/benchmarks.md ("Where a peer's time goes") and docs/networking.md (``--p2pd-threads``); run it with
``scripts/p2pd_throughput.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2, runtime_pb2

from p2p_diloco.swarm.processes import cpu_seconds

_TIMEOUT_S = 300.0  # for one transfer: 300 MiB take ~1 s on one core


async def measure(threads: int, messages: int, message_bytes: int) -> dict:
    """One stream of ``messages`` messages of ``message_bytes`` between two daemons on ``threads`` Go threads each."""
    saved = os.environ.get("GOMAXPROCS")
    if threads > 0:
        os.environ["GOMAXPROCS"] = str(threads)  # each daemon is a child of this process: it inherits it
    else:
        os.environ.pop("GOMAXPROCS", None)
    daemons: list[P2P] = []
    try:
        daemons.append(await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
        receiver = daemons[0]
        daemons.append(await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                        initial_peers=await receiver.get_visible_maddrs()))
        sender = daemons[1]

        async def sink(requests, _context):
            received = 0
            async for request in requests:
                received += len(request.tensor_part.buffer)
            yield averaging_pb2.AveragingData(weight=received)

        await receiver.add_protobuf_handler("sink", sink, averaging_pb2.AveragingData, stream_input=True,
                                            stream_output=True)
        payload = os.urandom(message_bytes)

        async def send():
            for _ in range(messages):
                yield averaging_pb2.AveragingData(tensor_part=runtime_pb2.Tensor(buffer=payload))

        pids = [[daemon._child.pid] for daemon in (sender, receiver)]
        cpu_before = [cpu_seconds(family, with_descendants=False) or 0.0 for family in pids]
        started = time.perf_counter()
        answers: list[float] = []

        async def transfer() -> None:
            stream = await sender.iterate_protobuf_handler(receiver.peer_id, "sink", send(), averaging_pb2.AveragingData)
            async for answer in stream:
                answers.append(answer.weight)

        # a stream that stalls ends the measurement with an error instead of a hang
        await asyncio.wait_for(transfer(), timeout=_TIMEOUT_S)
        received = answers[-1] if answers else 0.0
        seconds = time.perf_counter() - started
        cpu = [(cpu_seconds(family, with_descendants=False) or 0.0) - before for family, before in zip(pids, cpu_before)]
    finally:
        os.environ.pop("GOMAXPROCS", None)
        if saved is not None:
            os.environ["GOMAXPROCS"] = saved
        for daemon in daemons:  # stops its p2pd
            await daemon.shutdown()
    if received != messages * message_bytes:
        raise RuntimeError(f"the receiver counted {received:.0f} bytes of {messages * message_bytes}")
    mib = received / 2**20
    return dict(threads=threads, mib=mib, seconds=seconds, mib_per_s=mib / seconds,
                sender_p2pd_cpu_s=cpu[0], receiver_p2pd_cpu_s=cpu[1])


def main(argv: list[str] | None = None, prog: str = "p2pd_throughput.py") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 0],
                        help="GOMAXPROCS values to measure, one after the other (0: Go's default)")
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--message-mib", type=float, default=1.0)
    parser.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    if min(args.threads) < 0 or args.messages < 1 or args.message_mib <= 0:
        parser.error("--threads must be >= 0, --messages >= 1 and --message-mib > 0")
    results = []
    for threads in args.threads:
        try:
            result = asyncio.run(measure(threads, args.messages, int(args.message_mib * 2**20)))
        except Exception as e:
            print(f"{prog}: {threads} thread(s): {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        results.append(result)
        label = f"GOMAXPROCS={threads}" if threads else "Go's default"
        print(f"{label}: {result['mib']:.0f} MiB in {result['seconds']:.2f} s = {result['mib_per_s']:.0f} MiB/s; "
              f"p2pd CPU s: sender {result['sender_p2pd_cpu_s']:.2f}, receiver {result['receiver_p2pd_cpu_s']:.2f}",
              flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 0
