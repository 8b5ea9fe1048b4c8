"""What an inner step costs with each inner optimizer: AdamW and Muon (``--inner-optimizer``), side by side.

    python scripts/bench_inner_optimizer.py --out runs/inner-optimizer [--batch-sizes 2 8 16] [--steps 40] [--threads 1]

One process, the built-in model (or ``--d-model``), random tokens: forward, backward, clip and the optimizer's step,
as a peer's inner step makes them (train/inner_optimizer.py builds both). The two optimizers alternate in blocks of
``--steps`` steps, ``--repeats`` times, so that a machine whose speed drifts moves both; the median block counts.
Prints milliseconds per step and the ratio, and writes ``bench_inner_optimizer.json``. Muon's Newton–Schulz steps
cost the same at any batch (they act on the weights), so its share falls as the batch grows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

import torch  # noqa: E402

from p2p_diloco.core.config import INNER_OPTIMIZERS, InnerConfig, ModelConfig  # noqa: E402
from p2p_diloco.train.inner_optimizer import build_inner_optimizer  # noqa: E402
from p2p_diloco.train.model import build_model  # noqa: E402


def time_block(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int, steps: int) -> float:
    """Seconds per inner step over ``steps`` steps of ``batch`` random sequences."""
    config = ModelConfig()
    inputs = torch.randint(0, config.vocab_size, (batch, config.seq_len))
    targets = torch.randint(0, config.vocab_size, (batch, config.seq_len))
    started = time.perf_counter()
    for _ in range(steps):
        loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), InnerConfig().grad_clip_norm)
        optimizer.step()
    return (time.perf_counter() - started) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/inner-optimizer", help="folder for bench_inner_optimizer.json")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 8, 16], help="sequences per inner step")
    parser.add_argument("--steps", type=int, default=40, help="inner steps per timed block (default 40)")
    parser.add_argument("--repeats", type=int, default=3, help="blocks per optimizer and batch size (default 3)")
    parser.add_argument("--d-model", type=int, default=ModelConfig().d_model, help="the model's width")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, as a peer)")
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.steps < 1 or args.repeats < 1 or args.threads < 1 or args.d_model < 8:
        print("bench_inner_optimizer.py: error: batch sizes, --steps, --repeats and --threads must be >= 1, "
              "--d-model >= 8", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    config = ModelConfig(d_model=args.d_model)
    rows = []
    for batch in args.batch_sizes:
        blocks: dict[str, list[float]] = {kind: [] for kind in INNER_OPTIMIZERS}
        setups = {}
        for kind in INNER_OPTIMIZERS:
            model = build_model(config, 0)
            setups[kind] = (model, build_inner_optimizer(kind, model, 1e-3, 0.1))
            time_block(*setups[kind], batch, 3)  # warm-up: allocations and the optimizer's state
        for _ in range(args.repeats):
            for kind in INNER_OPTIMIZERS:
                blocks[kind].append(time_block(*setups[kind], batch, args.steps))
        ms = {kind: 1000 * statistics.median(times) for kind, times in blocks.items()}
        rows.append(dict(batch_size=batch, tokens_per_step=batch * config.seq_len, ms_per_step=ms,
                         muon_over_adamw=ms["muon"] / ms["adamw"]))
        print(f"batch {batch:3d} x {config.seq_len}: AdamW {ms['adamw']:7.1f} ms/step, Muon {ms['muon']:7.1f} ms/step, "
              f"Muon / AdamW {ms['muon'] / ms['adamw']:.2f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(d_model=args.d_model, threads=args.threads, steps=args.steps, repeats=args.repeats,
                  torch=torch.__version__, rows=rows)
    (out / "bench_inner_optimizer.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / 'bench_inner_optimizer.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
