"""What the portable arithmetic costs: the outer step, the decoding of an averaged outer gradient and the seeded
init on the default model, each timed the portable way and the way before it (docs/design.md §5), side by side.

    python scripts/bench_portable.py --out runs/bench-portable --repeats 30

"Before" is the arithmetic of the releases before the portable rule, kept here only to be timed: the outer step
with ``add(alpha=)``, bitsandbytes' own dequantize kernels, torch's seeded ``normal_``. Prints milliseconds per
call (median of ``--repeats``) and the ratio, and writes them to OUT/bench_portable.json. One outer step and one
decode happen per round of H inner steps; the last column puts their extra cost against a round of the default
H = 50 inner steps timed here too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runnable from a clone without installing

import torch  # noqa: E402

from p2p_diloco.core import compression  # noqa: E402
from p2p_diloco.core.config import ModelConfig, OuterConfig  # noqa: E402
from p2p_diloco.core.outer import OuterOptimizer  # noqa: E402
from p2p_diloco.train.model import GPT, build_model  # noqa: E402


def median_ms(function: Callable[[], object], repeats: int) -> float:
    function()  # warm-up: first-call allocations and lazy imports are not the steady cost
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


@torch.no_grad()
def fused_outer_step(params: list[torch.Tensor], buffers: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for param, buffer, grad in zip(params, buffers, grads):
        buffer.mul_(0.9).add_(grad)
        param.add_(grad.add(buffer, alpha=0.9), alpha=-0.7)


def bitsandbytes_decode(name: str, data: bytes, numel: int) -> torch.Tensor:
    from bitsandbytes.functional import QuantState, dequantize_4bit, dequantize_blockwise

    codec = compression.make_codec(name)
    blocks = -(-numel // codec.block_size)
    absmax = torch.frombuffer(bytearray(data), dtype=torch.float32, count=blocks)
    if name == "int8":
        indices = torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=4 * blocks, count=numel)
        return dequantize_blockwise(indices, absmax=absmax, code=compression.dynamic_code(), blocksize=codec.block_size)
    packed = torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=4 * blocks, count=-(-numel // 2)).view(-1, 1)
    state = QuantState(absmax=absmax, shape=torch.Size([numel]), code=compression.nf4_code(), blocksize=codec.block_size,
                       quant_type="nf4", dtype=torch.float32)
    return dequantize_4bit(packed, state)


def seeded_torch_init(config: ModelConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(config)


def inner_steps_ms(model: torch.nn.Module, steps: int) -> float:
    """Milliseconds of ``steps`` inner AdamW steps of the default batch (16 x 128 bytes) on this model."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (16, 129))
    started = time.perf_counter()
    for _ in range(steps):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return 1000 * (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench-portable", help="folder for bench_portable.json")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per figure (default 30)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, as a peer's --threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = ModelConfig()
    model = build_model(config, seed=0)
    params = [p.detach().clone() for p in model.parameters()]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    numel = sum(p.numel() for p in params)
    portable = OuterOptimizer([p.clone() for p in params], OuterConfig(lr=0.7, momentum=0.9))
    fused_params, fused_buffers = [p.clone() for p in params], [torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    rows = {
        "outer step": (median_ms(lambda: portable.step(grads), args.repeats),
                       median_ms(lambda: fused_outer_step(fused_params, fused_buffers, grads), args.repeats)),
        "seeded init": (median_ms(lambda: build_model(config, seed=0), max(3, args.repeats // 5)),
                        median_ms(lambda: seeded_torch_init(config), max(3, args.repeats // 5))),
    }
    for name in ("int8", "int4"):
        codec = compression.make_codec(name)
        data = codec.encode(flat)
        rows[f"decode {name}"] = (median_ms(lambda c=codec, d=data: c.decode(d, numel), args.repeats),
                                  median_ms(lambda n=name, d=data: bitsandbytes_decode(n, d, numel), args.repeats))
    round_ms = inner_steps_ms(model, 50)
    print(f"default model: {numel:,} parameters, {args.threads} thread(s); 50 inner steps of 16 x 128 tokens: "
          f"{round_ms:.0f} ms", flush=True)
    print(f"{'':<14}{'portable ms':>12}{'before ms':>11}{'ratio':>8}{'extra per round of H=50':>26}", flush=True)
    result = dict(parameters=numel, threads=args.threads, round_of_50_inner_steps_ms=round(round_ms, 1), rows={})
    for name, (new, old) in rows.items():
        per_round = "(once per start)" if name == "seeded init" else f"{100 * (new - old) / round_ms:+.3f}%"
        print(f"{name:<14}{new:>12.2f}{old:>11.2f}{new / old:>8.2f}{per_round:>26}", flush=True)
        result["rows"][name] = dict(portable_ms=round(new, 3), before_ms=round(old, 3), ratio=round(new / old, 3))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_portable.json").write_text(json.dumps(result, indent=1))
    print(f"results: {out / 'bench_portable.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
