"""Output of the simulations: JSON files, markdown tables and PNG plots.

Formatting only: every number printed here was computed by ``goodput``, ``bandwidth``, ``calibrate`` or
``scenarios``; nothing is simulated or looked up here. matplotlib is imported when a plot is drawn, not at
import time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METHOD_LABELS = {
    "sync_dp": "synchronous data parallel (restart from checkpoint)",
    "elastic_dp": "elastic data parallel (drop the slice, re-form)",
    "decoupled": "p2p-diloco islands (left out, rejoin after restart + download)",
}


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def _percent(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{100 * value:.{digits}f}%"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def sweep_markdown(rows: list[dict]) -> str:
    """Chips down, methods across; goodput in each cell, the decoupled islands' count beside it."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by_size: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_size.setdefault(row["total_chips"], {})[row["method"]] = row
    body = []
    for chips, cells in sorted(by_size.items()):
        islands = cells.get("decoupled", {}).get("groups")
        interruptions = max(cell["interruptions"] for cell in cells.values())
        body.append([f"{chips:,}", *(_percent(cells[m]["goodput"], 2) if m in cells else "—" for m in methods),
                     f"{islands:,}" if islands else "—", f"{interruptions:,}"])
    return table(["chips", *methods, "islands", "interruptions simulated (most of the three)"], body)


def report_markdown(goodput: dict, bandwidth: dict) -> str:
    rows = []
    for row in goodput["rows"]:
        target = row["reported"]
        gap = f"{100 * (row['goodput'] - target):+.1f} points" if target is not None else "—"
        rows.append([row["method"], row["role"], _percent(row["goodput"]), _percent(target), gap])
    parts = [table(["method", "role", "simulated", "report", "difference"], rows), ""]
    parts.append(f"Fitted: sync DP restart {goodput['fitted_restart_s']:.1f} s; elastic DP re-form = rejoin "
                 f"{goodput['fitted_reform_s']:.1f} s; one interruption in the cluster every "
                 f"{goodput['cluster_mtbi_s']:.1f} s; horizon {goodput['horizon_s'] / 86400:.1f} days.")
    parts.append("")
    brows = [[f"{r['dp_bits']:.0f}-bit, all-reduce", r["topology"], f"{r['step_s']:.2f}",
              f"{r['tokens_per_s_per_island']:,.0f}", f"{r['dp_gbit']:.0f}", f"{r['decoupled_required_gbit']:.2f}",
              f"{r['reduction']:.0f}x", f"{r['vs_reported']:.2f}x"] for r in bandwidth["rows"]]
    reported = bandwidth["inputs"]["reported_decoupled_gbit"]
    parts.append(table(["data-parallel gradient", "decoupled exchange", "implied step (s)", "implied tokens/s per DC",
                        "DP Gbit/s", "decoupled Gbit/s", "reduction", f"vs reported {reported}"], brows))
    return "\n".join(parts)


def _axes(figsize: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=figsize)


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_sweep(rows: list[dict], path: Path, title: str) -> Path:
    plt, figure, axis = _axes((8, 5))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = sorted((r["total_chips"], r["goodput"]) for r in rows if r["method"] == method)
        axis.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o",
                  label=METHOD_LABELS.get(method, method))
    axis.set_xscale("log")
    axis.set_ylim(0, 102)
    axis.set_xlabel("total chips")
    axis.set_ylabel("goodput (%): useful compute / (chips x wall time)")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8, loc="lower left")
    axis.set_title(title, fontsize=10)
    return _save(plt, figure, path)


def plot_report(goodput: dict, path: Path) -> Path:
    """Bars: simulated goodput of each case of the report scenario, the report's figure beside where it has one."""
    plt, figure, axis = _axes((12, 5))
    names, simulated, theirs = [], [], []
    for row in goodput["rows"]:
        names.append(row["method"].replace(" (", "\n(").replace(", M=", "\nM="))
        simulated.append(100 * row["goodput"])
        theirs.append(100 * row["reported"] if row["reported"] is not None else 0)
    positions = range(len(names))
    axis.bar([p - 0.2 for p in positions], simulated, width=0.4, label="simulated")
    axis.bar([p + 0.2 for p in positions], theirs, width=0.4, label="Decoupled DiLoCo report")
    for p, value in zip(positions, simulated):
        axis.text(p - 0.2, value + 1, f"{value:.0f}", ha="center", fontsize=7)
    axis.set_xticks(list(positions), names, fontsize=6)
    axis.set_ylabel("goodput (%)")
    axis.set_ylim(0, 105)
    axis.legend(fontsize=8)
    axis.set_title("1.2M chips, one interruption per chip-year: data-parallel timings fitted, the rest predicted",
                   fontsize=10)
    return _save(plt, figure, path)


def calibration_markdown(calibration: dict, replay_goodput: float) -> str:
    c = calibration
    rows = [
        ["compute fraction (training intervals)", f"{c['compute_fraction']:.4f}"],
        ["round length (s)", f"{c['round_s']:.1f}"],
        ["process start after a restart (s)", "—" if c["process_start_s"] is None else f"{c['process_start_s']:.1f}"],
        ["rejoin: first record to training (s)", f"{c['rejoin_s']:.2f}"],
        ["of which state download (s)", f"{c['state_download_s']:.2f}"],
        ["neighbour stall per fault (s)", f"{c['neighbour_stall_s']:.2f}"],
        ["faults replayed", str(len(c["faults"]))],
        ["measured swarm goodput (as chaos.analyse computes it)", _percent(c["measured_swarm_goodput"])],
        ["  recorded compute done before the start (s)", f"{c['compute_before_start_s']:.1f}"],
        ["  frozen time counted as compute (s)", f"{c['frozen_counted_s']:.1f}"],
        ["  compute after each peer's last record, not recorded (s)", f"{c['unrecorded_tail_s']:.1f}"],
        ["measured goodput inside the run's window", _percent(c["window_goodput"])],
        ["simulated (replay of the recorded faults)", _percent(replay_goodput)],
    ]
    return table(["calibration: " + c["source"], "value"], rows)
