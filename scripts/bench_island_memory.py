"""Peak memory of each rank of a 2-rank island, DDP against FSDP, beside one process alone, on the same model.

    python scripts/bench_island_memory.py --out runs/island-memory [--d-model 768 --n-layers 12 --n-heads 12]

Each configuration trains a swarm of one for ``--outer-steps`` outer steps of ``--inner-steps`` inner steps
(``single``: ``peers/peer.py`` alone; ``ddp``, ``fsdp``: ``torchrun --nproc-per-node 2`` with
``--island-sharding``). Every 0.2 s the script reads each training process's peak resident set (the kernel's
``VmHWM``: the most it ever held, so a peak between two reads is not missed) and, for scale, its current one.
A rank is a process that torchrun's agent started (its hivemind DHT and averager processes are not counted).
Writes ``island_memory.json`` and prints a markdown table: peak RSS per rank, the model's fp32 size, the
compute time per inner step (from the metrics), and whether the run ended with exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runnable from a clone without installing


def _status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _training_processes(root: int, torchrun: bool) -> dict[int, int]:
    """rank -> pid of the processes that train: torchrun's agent's direct children, or the peer itself."""
    if not torchrun:
        return {0: root}
    found = {}
    for child in _children(root):
        rank = _rank_of(child)
        if rank is not None:
            found[rank] = child
    return found


def run_one(name: str, out: Path, model_flags: list[str], args: argparse.Namespace, port: int) -> dict:
    metrics = out / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    peer_flags = [
        *model_flags,
        "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
        "--inner-steps", str(args.inner_steps), "--max-outer-steps", str(args.outer_steps),
        "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--metrics-file", str(metrics), "--run-id", f"memory-{name}",
        "--threads", "1",
    ]
    if name == "single":
        command = [sys.executable, str(ROOT / "peers" / "peer.py"), *peer_flags]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
            str(ROOT / "peers" / "peer.py"), "--island-sharding", name, *peer_flags,
        ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    started = time.monotonic()
    with open(out / f"{name}.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    peaks: dict[int, int] = {}
    try:
        while process.poll() is None:
            if time.monotonic() - started > args.timeout_s:
                raise TimeoutError(f"{name} did not finish within {args.timeout_s} s")
            for rank, pid in _training_processes(process.pid, name != "single").items():
                peak = _status_kib(pid, "VmHWM")
                if peak is not None:
                    peaks[rank] = max(peaks.get(rank, 0), peak)
            time.sleep(0.2)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    last = records[-1] if records else {}
    steps = sum(r.get("inner_steps", 0) for r in records) or None  # per record; compute_s is cumulative
    return dict(
        name=name,
        exit_code=process.returncode,
        wall_s=round(time.monotonic() - started, 1),
        peak_rss_mib_by_rank={rank: round(kib / 1024) for rank, kib in sorted(peaks.items())},
        outer_steps=last.get("outer_step"),
        tokens=last.get("tokens"),
        compute_s=last.get("compute_s"),
        eval_loss=[r.get("eval_loss") for r in records if r.get("eval_loss") is not None],
        inner_steps_recorded=steps,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/island-memory")
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--n-layers", type=int, default=12)
    parser.add_argument("--n-heads", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--inner-steps", type=int, default=3)
    parser.add_argument("--outer-steps", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["single", "ddp", "fsdp"], choices=["single", "ddp", "fsdp"])
    parser.add_argument("--timeout-s", type=float, default=900.0, help="bound on each configuration's run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_flags = ["--d-model", str(args.d_model), "--n-layers", str(args.n_layers), "--n-heads", str(args.n_heads)]

    from p2p_diloco.core.config import ModelConfig
    from p2p_diloco.train.model import build_model

    model = build_model(ModelConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, seq_len=args.seq_len), seed=0)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    results = []
    for index, name in enumerate(args.configs):
        try:
            result = run_one(name, out, model_flags, args, 29400 + index)
        except TimeoutError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        results.append(result)
        print(json.dumps(result), flush=True)
    summary = dict(
        parameters=parameters,
        fp32_model_mib=round(4 * parameters / 2**20),
        flags=vars(args),
        results=results,
    )
    (out / "island_memory.json").write_text(json.dumps(summary, indent=2))
    print(f"\nmodel: {parameters:,} parameters, {summary['fp32_model_mib']} MiB in fp32\n")
    print("| island | exit | peak RSS rank 0 (MiB) | peak RSS rank 1 (MiB) | compute s per inner step |")
    print("|---|---|---|---|---|")
    for r in results:
        ranks = r["peak_rss_mib_by_rank"]
        per_step = r["compute_s"] / r["inner_steps_recorded"] if r["compute_s"] and r["inner_steps_recorded"] else None
        print(
            f"| {r['name']} | {r['exit_code']} | {ranks.get(0, '–')} | {ranks.get(1, '–')} | "
            f"{per_step:.2f} |" if per_step else f"| {r['name']} | {r['exit_code']} | {ranks.get(0, '–')} | {ranks.get(1, '–')} | – |"
        )
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
