"""How long a peer takes to start, and where its start-up CPU goes:
``python scripts/bench_startup.py --out runs/startup [--runs 3] [-- extra peer flags]``.

1. The imports a peer makes, each timed in CPU seconds in one fresh interpreter, in the order a peer makes them:
   torch; the first ``torch.optim`` optimizer (it loads ``torch._dynamo``); the int8 codec (``make_codec``, which
   imports bitsandbytes); hivemind (what a peer leaves unloaded until used, ``hivemind_api.UNUSED_IMPORTS``, too).
2. One peer alone (``LocalSwarm``: the default model unless the extra flags say otherwise, ``--max-outer-steps 1``,
   ``--inner-steps 20``), ``--runs`` times one after the other: the seconds from its launch to its first metrics
   record (the init record: imports, model, data, DHT, ``p2pd`` and the reachability probe done) and to its exit.

Prints both and writes ``startup.json`` under ``--out``. docs/benchmarks.md, "Start-up"."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from p2p_diloco.cli.peer_processes import LocalSwarm  # noqa: E402

IMPORTS = """
import json, time
from p2p_diloco.swarm.hivemind_api import UNUSED_IMPORTS, load_on_first_use
for name in UNUSED_IMPORTS:  # as a peer does before it imports hivemind
    load_on_first_use(name)
cpu = {}
start = time.process_time()
import torch
cpu["torch"] = time.process_time() - start; start = time.process_time()
torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
cpu["first optimizer (torch._dynamo)"] = time.process_time() - start; start = time.process_time()
from p2p_diloco.core.compression import make_codec
make_codec("int8")
cpu["int8 codec (bitsandbytes)"] = time.process_time() - start; start = time.process_time()
import hivemind
cpu["hivemind"] = time.process_time() - start
print(json.dumps(cpu))
"""


def import_cpu_s() -> dict[str, float]:
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=300, cwd=root)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"timing the imports failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(lines[-1])


def one_start(out_dir: Path, flags: list[str]) -> dict[str, float]:
    swarm = LocalSwarm(out_dir, [*flags, "--max-outer-steps", "1", "--inner-steps", "20"])
    try:
        launched = time.monotonic()
        swarm.start("peer0", shard=0, num_shards=1)
        swarm.wait_until(lambda: bool(swarm.records("peer0")), 120, "the peer's first record")
        first_record_s = time.monotonic() - launched
        swarm.wait_all_exited(120)
        return {"first_record_s": first_record_s, "exit_s": time.monotonic() - launched}
    finally:
        swarm.stop_all()


def main(argv: list[str]) -> int:
    own, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="bench_startup.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(own)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    try:
        imports = import_cpu_s()
        print("import CPU s: " + ", ".join(f"{name} {cpu:.2f}" for name, cpu in imports.items()), flush=True)
        runs = []
        for index in range(args.runs):
            runs.append(one_start(args.out / f"run{index}", flags))
            print(f"run {index}: first record after {runs[-1]['first_record_s']:.2f} s, "
                  f"exit after {runs[-1]['exit_s']:.2f} s", flush=True)
    except (RuntimeError, OSError, ValueError) as e:
        print(f"bench_startup.py: error: {e}", file=sys.stderr)
        return 1
    median = statistics.median(run["first_record_s"] for run in runs)
    print(f"median time to the first record: {median:.2f} s over {len(runs)} runs")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.json").write_text(json.dumps({"import_cpu_s": imports, "runs": runs, "peer_flags": flags,
                                                       "median_first_record_s": median}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
