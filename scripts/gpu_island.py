"""A GPU island beside CPU islands in one swarm, and the bytes of the shared state on the GPU against the CPU.

    python scripts/gpu_island.py --out runs/gpu-island --device cuda --outer-steps 12 --n-layers 8 --d-model 512
    python scripts/gpu_island.py --out runs/gpu-island-cpu --device cpu     # the same, with no GPU (tested)

1. Bytes: ``scripts/portable_bytes.py`` on ``--device`` and on the CPU (and on the CPU's default kernels): the seeded
   init, the outer step and every codec's decoding must give the same sha256 everywhere (docs/design.md §5).
2. One swarm: island0 on ``--device`` with bf16 autocast inner steps, island1 and island2 on the CPU in fp32, the
   same model (flags after the script's own go to every peer), at least ``--outer-steps`` outer steps. Prints
   per island: device, tokens/s, weight share in the averages, healing downloads (forks healed), catch-ups after a
   failed round, and outer steps computed otherwise than its group; and invariant 1 over the swarm.

Without CUDA, ``--device cpu`` runs island0 on the CPU with bf16 autocast: every part but the GPU itself. Writes
``OUT/gpu_island.json`` and exits 1 if any bytes differ, invariant 1 failed or any island healed a fork.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

from p2p_diloco.cli.peer_processes import LocalSwarm  # noqa: E402
from p2p_diloco.observe.report import build_report, invariant_1_status  # noqa: E402

BYTES_SCRIPT = Path(__file__).resolve().parent / "portable_bytes.py"


def shared_state_bytes(device: str, capability: str | None = None, threads: int = 1) -> dict:
    env = dict(os.environ, **({"ATEN_CPU_CAPABILITY": capability} if capability else {}))
    done = subprocess.run([sys.executable, str(BYTES_SCRIPT), "--device", device, "--threads", str(threads)], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"portable_bytes.py on {device} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_bytes(device: str) -> tuple[bool, list[dict]]:
    """The portable computations' sha256 on ``device`` and on the CPU's kernels; whether all agree, and the runs."""
    runs = [shared_state_bytes("cpu"), shared_state_bytes("cpu", capability="default", threads=2)]
    if device != "cpu":
        runs.append(shared_state_bytes(device))
    reference = runs[0]["portable"]
    print(f"{'computation':<22}" + "".join(f"{run['device'] + '/' + run['capability']:>20}" for run in runs), flush=True)
    for name in reference:
        print(f"{name:<22}" + "".join(f"{run['portable'].get(name, '-')[:16]:>20}" for run in runs), flush=True)
    same = all(run["portable"] == reference for run in runs)
    print(f"shared-state bytes: {'the same on every device and kernel set' if same else 'DIFFERENT'}", flush=True)
    return same, runs


def run_swarm(out: Path, device: str, outer_steps: int, peer_flags: list[str], timeout_s: float) -> dict:
    """island0 on ``device`` (bf16 autocast), island1 and island2 on the CPU (fp32); the run report."""
    flags = [*peer_flags, "--max-outer-steps", str(outer_steps), "--wait-for-peers", "3"]
    swarm = LocalSwarm(out, flags)
    try:
        swarm.start("island0", shard=0, num_shards=3, extra=["--device", device, "--precision", "bf16"])
        for index in (1, 2):
            swarm.start(f"island{index}", shard=index, num_shards=3, extra=["--device", "cpu", "--precision", "fp32"])
        swarm.wait_all_exited(timeout_s)
    finally:
        swarm.stop_all()
    return build_report({name: peer.metrics_file for name, peer in swarm.peers.items()})


def summarise(report: dict, device: str) -> list[dict]:
    rows = []
    for name, peer in sorted(report["peers"].items()):
        ok = [r for r in report["records"][name] if r["status"] == "ok" and r.get("weight_share") is not None]
        rows.append(dict(
            island=name, device=device if name == "island0" else "cpu", precision="bf16" if name == "island0" else "fp32",
            outer_steps=peer["final_outer_step"], tokens_per_s=peer["tokens_per_s"],
            weight_share=round(sum(r["weight_share"] for r in ok) / len(ok), 3) if ok else None,
            forks_healed=peer["forks_healed"], catch_ups=peer["catch_ups"] - peer["forks_healed"],
            arithmetic_mismatches=peer["arithmetic_mismatches"], group_sizes=peer["group_sizes"],
        ))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/gpu-island", help="folder for logs, metrics and gpu_island.json")
    parser.add_argument("--device", default="cuda", help="island0's device: cuda, cuda:N, or cpu without a GPU")
    parser.add_argument("--outer-steps", type=int, default=10, help="outer steps of the swarm (default 10)")
    parser.add_argument("--timeout-s", type=float, default=480.0, help="bound on the swarm's run (default 480)")
    args, peer_flags = parser.parse_known_args()
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"gpu_island.py: error: --device {args.device}, but torch sees no GPU (use --device cpu)", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    same, runs = compare_bytes(args.device)
    report = run_swarm(out, args.device, args.outer_steps, peer_flags, args.timeout_s)
    rows = summarise(report, args.device)
    print(f"\n{'island':<9}{'device':<8}{'prec':<6}{'steps':>6}{'tok/s':>10}{'weight share':>14}{'forks healed':>14}"
          f"{'catch-ups':>11}{'mismatches':>12}  groups", flush=True)
    for row in rows:
        share = f"{row['weight_share']:.3f}" if row["weight_share"] is not None else "-"
        print(f"{row['island']:<9}{row['device']:<8}{row['precision']:<6}{row['outer_steps']:>6}{row['tokens_per_s']:>10.0f}"
              f"{share:>14}{row['forks_healed']:>14}{row['catch_ups']:>11}{row['arithmetic_mismatches']:>12}"
              f"  {row['group_sizes']}", flush=True)
    print(f"invariant 1: {invariant_1_status(report)}", flush=True)
    clean = report["invariant_1"]["status"] == "held" and all(
        row["forks_healed"] == 0 and row["arithmetic_mismatches"] == 0 and row["outer_steps"] >= args.outer_steps for row in rows
    )
    (out / "gpu_island.json").write_text(json.dumps(dict(
        device=args.device, bytes_same=same, bytes_runs=runs, islands=rows, invariant_1=report["invariant_1"],
        peer_flags=peer_flags, clean=clean,
    ), indent=1))
    print(f"results: {out / 'gpu_island.json'}", flush=True)
    return 0 if same and clean else 1


if __name__ == "__main__":
    sys.exit(main())
