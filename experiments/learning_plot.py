"""The learning study's picture, study.png: the gap to tuned sync DP against wire bytes per token, one line per
setting (``curves``), seeds as a band; from the summary experiments/learning_report.py makes."""

from __future__ import annotations

from pathlib import Path

from experiments.learning_grids import LOW_BIT_POINTS, PLOT_GAP_LIMIT
from experiments.learning_report import method_name
from experiments.learning_runs import PEERS, STEPS


def curves(summary: dict) -> dict[str, list[dict]]:
    """The picture's curves, each a list of points (one per H and codec) sorted by bytes per token:

    - *tuned*: at each H and codec, the setting with the lowest gap at seed 0 (outer optimizer and inner lr tuned),
      plotted with its mean over its seeds;
    - the outer optimizers of the grid at sync DP's inner lr (the default 0.7/0.9 among them);
    - *H growing*, *reducer's error feedback*: the tuned settings with that one change;
    - *topk*: sparse 2-bit outer gradients, with and without the reducer's error feedback;
    - *int2*, *int4* of the low-bit phase (a cheaper codec at a smaller H, both error feedbacks): the best outer
      optimizer tried at each H;
    - *Muon islands* (phase muon): at each H the best, its gap to the better sync DP (AdamW's or Muon's) per seed.
    """
    dp_lr = summary["syncdp"]["inner_lr"]
    fixed = [p for p in summary["points"] if p["schedule"] == "fixed"]
    found: dict[str, list[dict]] = {}
    by_point: dict[tuple, list[dict]] = {}
    for p in fixed:
        if not p["reducer_feedback"] and p["compression"] != "topk":
            by_point.setdefault((p["inner_steps"], p["compression"]), []).append(p)
    found["tuned (outer optimizer and inner lr per H)"] = [_best_setting(ps) for ps in by_point.values()]
    for ps in by_point.values():
        for p in ps:
            if p["inner_lr"] == dp_lr:
                found.setdefault(method_name(p, dp_lr) + ", sync DP's inner lr", []).append(p)
    low_bit = {(h, c) for h, c, _ in LOW_BIT_POINTS}
    low_bit_found: dict[str, dict[int, list[dict]]] = {}
    for p in summary["points"]:
        if p["schedule"] == "grow":
            found.setdefault("H growing, " + ("sync DP's inner lr" if p["inner_lr"] == dp_lr else "tuned"), []).append(p)
        elif p["compression"] == "topk":
            outer = "plain averaging" if p["outer_momentum"] == 0 else f"Nesterov {p['outer_lr']:g}/{p['outer_momentum']:g}"
            name = f"topk, {outer}" + (" + reducer's error feedback" if p["reducer_feedback"] else "")
            found.setdefault(name, []).append(p)
        elif p["reducer_feedback"] and (p["inner_steps"], p["compression"]) in low_bit:
            low_bit_found.setdefault(p["compression"], {}).setdefault(p["inner_steps"], []).append(p)
        elif p["reducer_feedback"]:
            found.setdefault("tuned + reducer's error feedback", []).append(p)
    for codec, by_h in low_bit_found.items():
        found[f"{codec}, both error feedbacks, more rounds (best outer per H)"] = [_best_setting(ps)
                                                                              for ps in by_h.values()]
    if summary["muon"]["points"]:  # the best outer optimizer per H, against the better sync DP at each seed
        by_h: dict[int, list[dict]] = {}
        for p in summary["muon"]["points"]:
            by_h.setdefault(p["inner_steps"], []).append(p)
        found["Muon islands vs sync DP with Muon (both error feedbacks, best per H)"] = [_best_setting(ps) for ps in by_h.values()]
    for points in found.values():
        points.sort(key=lambda p: p["wire_bytes_per_token"])
    return found


def _best_setting(points: list[dict]) -> dict:
    """The best of several settings at one H: compared at seed 0, which every setting ran (a mean over 3 seeds is not
    comparable with one seed's gap); one without a seed-0 run by its mean."""
    return min(points, key=lambda p: p["gap_mean"] if p["gap_seed0"] is None else p["gap_seed0"])


def plot(summary: dict, path: Path) -> None:
    """study.png: the gap against wire bytes per token, one line per setting of ``curves``, seeds as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8.5, 5))
    colors = iter(plt.get_cmap("tab20").colors)
    for name, points in curves(summary).items():
        points = [p for p in points if p["gap_mean"] <= PLOT_GAP_LIMIT]
        if not points:
            continue
        x = [p["wire_bytes_per_token"] for p in points]
        tuned = name.startswith("tuned (")
        style = dict(marker="o", linewidth=2.2 if tuned else 1.2, linestyle="-" if tuned or name.startswith(("topk", "int2", "Muon")) else ":")
        color = next(colors)
        axes.plot(x, [100 * p["gap_mean"] for p in points], label=name, color=color, **style)
        if any(p["seeds"] > 1 for p in points):
            axes.fill_between(x, [100 * p["gap_min"] for p in points], [100 * p["gap_max"] for p in points], alpha=0.2,
                              color=color)
        if tuned:
            for p in points:
                axes.annotate(f"H{p['inner_steps']} {p['compression']}, {p['fewer_bytes_than_syncdp']:,.0f}×",
                              (p["wire_bytes_per_token"], 100 * p["gap_mean"]), fontsize=7, xytext=(3, 4),
                              textcoords="offset points")
    axes.axhline(0, color="black", linewidth=0.8)
    axes.set_xscale("log")
    axes.set_xlabel("wire bytes per token, per peer (log); fp32 sync DP: "
                    f"{summary['syncdp']['bytes_per_token']:,.0f}")
    axes.set_ylabel("held-out loss gap to tuned sync DP (%)")
    axes.set_title(f"DiLoCo vs sync DP at equal tokens ({PEERS} islands, {STEPS} inner steps each); band: seeds\n"
                   f"(runs more than {100 * PLOT_GAP_LIMIT:.0f}% behind: in the table only)", fontsize=10)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=7)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
