"""The learning study's report: the gaps to tuned sync DP per setting (``summarize``) and the tables of ``study.md``
(``report``, which draws ``study.png`` with experiments/learning_plot.py), read from ``results.jsonl`` and
``floor_probe.jsonl`` alone. The runs and their arithmetic live in experiments/learning_runs.py, their grids and plan
in learning_grids.py, learning_plan.py and learning_floor.py; this module trains nothing."""

from __future__ import annotations

from pathlib import Path

from experiments.learning import _load_probes, load
from experiments.learning_floor import _floor_clip, _floor_length
from experiments.learning_grids import (
    FLOOR_LENGTHS,
    ISLAND_BATCH,
    SIZE_DILOCO,
    _best,
    _muon_dp,
    _muon_runs,
    _same_outer,
    _standard,
)
from experiments.learning_runs import BATCH, CLIP, D_MODEL, PEERS, STEPS, Run
from p2p_diloco.core.config import ModelConfig
from p2p_diloco.train.model import build_model

_POINT = ("inner_steps", "compression", "schedule", "reducer_feedback", "inner_lr", "outer_lr", "outer_momentum",
          "outer_warmup")


def summarize(results: list[dict]) -> dict:
    """Sync DP's tuned loss and, per DiLoCo setting (_POINT), its gap to it over the seeds both ran (standard runs);
    the one-island checks beside."""
    best_dp = _best(results, method="syncdp")
    if best_dp is None:
        return dict(syncdp=None, points=[], checks=[], iid=[], islands=[], sizes=[], muon=dict(grid={}, points=[]))
    standard = [r for r in results if _standard(r)]
    dp = {r["seed"]: r["final_loss"] for r in standard if r["method"] == "syncdp" and r["inner_lr"] == best_dp["inner_lr"]}
    groups: dict[tuple, list[dict]] = {}
    for r in standard:
        if r["method"] == "diloco":
            groups.setdefault(tuple(r[k] for k in _POINT), []).append(r)
    points = []
    for key, runs in sorted(groups.items()):
        runs = [r for r in runs if r["seed"] in dp]
        if not runs:
            continue
        gaps = [r["final_loss"] / dp[r["seed"]] - 1 for r in runs]
        points.append(dict(
            zip(_POINT, key), seeds=len(gaps), gap_mean=sum(gaps) / len(gaps), gap_min=min(gaps), gap_max=max(gaps),
            gap_seed0=next((g for r, g in zip(runs, gaps) if r["seed"] == 0), None),
            loss_mean=sum(r["final_loss"] for r in runs) / len(runs), outer_steps=runs[0]["outer_steps"],
            wire_bytes_per_token=runs[0]["wire_bytes_per_token"], fewer_bytes_than_syncdp=runs[0]["fewer_bytes_than_syncdp"],
        ))
    checks = [r for r in results if r["peers"] == 1]
    iid_dp = {r["seed"]: r for r in results if r["data"] == "iid" and r["method"] == "syncdp"}
    iid = [dict(r, gap=r["final_loss"] / iid_dp[r["seed"]]["final_loss"] - 1, syncdp_loss=iid_dp[r["seed"]]["final_loss"])
           for r in results if r["data"] == "iid" and r["method"] == "diloco" and r["seed"] in iid_dp]
    # beside them, the shards' runs at the same H, codec and outer optimizer whose islands' agreement was measured
    iid += [dict(r, gap=r["final_loss"] / dp[r["seed"]] - 1, syncdp_loss=dp[r["seed"]]) for r in standard
            if r["method"] == "diloco" and "island_agreement_first_quarter" in r and r["seed"] in dp
            and any(_same_outer(r, other) for other in iid)]
    return dict(syncdp=dict(inner_lr=best_dp["inner_lr"], seeds=len(dp), loss_mean=sum(dp.values()) / len(dp),
                            bytes_per_token=best_dp["wire_bytes_per_token"],
                            grid={r["inner_lr"]: r["final_loss"] for r in standard if r["method"] == "syncdp" and r["seed"] == 0}),
                points=points, checks=checks, iid=iid, islands=_islands(results), sizes=_sizes(results),
                muon=_muon(results, dp))


def _muon(results: list[dict], adamw_dp: dict[int, float]) -> dict:
    """Phase muon: Muon sync DP's grid (seed 0) and its best lr's loss per seed; per Muon DiLoCo setting, its gap over
    the seeds to AdamW sync DP (tuned: ``adamw_dp``, loss per seed) and to the better of the two sync DPs at each seed
    (Muon sync DP where it ran at that seed): ``gap_*``, what the picture plots."""
    grid = {r["inner_lr"]: r["final_loss"] for r in _muon_runs(results, "syncdp") if r["seed"] == 0}
    best_lr = _muon_dp(results) or (min(grid, key=grid.get) if grid else None)
    muon_dp = {r["seed"]: r["final_loss"] for r in _muon_runs(results, "syncdp") if r["inner_lr"] == best_lr}
    groups: dict[tuple, list[dict]] = {}
    for r in _muon_runs(results, "diloco"):
        if r["seed"] in adamw_dp:
            groups.setdefault(tuple(r[k] for k in _POINT), []).append(r)
    points = []
    for key, runs in sorted(groups.items()):
        to_adamw = [r["final_loss"] / adamw_dp[r["seed"]] - 1 for r in runs]
        gaps = [r["final_loss"] / min(adamw_dp[r["seed"]], muon_dp.get(r["seed"], float("inf"))) - 1 for r in runs]
        points.append(dict(
            zip(_POINT, key), seeds=len(gaps), gap_mean=sum(gaps) / len(gaps), gap_min=min(gaps), gap_max=max(gaps),
            gap_seed0=next((g for r, g in zip(runs, gaps) if r["seed"] == 0), None),
            gap_adamw_mean=sum(to_adamw) / len(to_adamw), gap_adamw_min=min(to_adamw), gap_adamw_max=max(to_adamw),
            loss_mean=sum(r["final_loss"] for r in runs) / len(runs), outer_steps=runs[0]["outer_steps"],
            wire_bytes_per_token=runs[0]["wire_bytes_per_token"], fewer_bytes_than_syncdp=runs[0]["fewer_bytes_than_syncdp"],
            muon_dp_seeds=sum(r["seed"] in muon_dp for r in runs),
        ))
    return dict(grid=grid, best_lr=best_lr, syncdp=muon_dp, points=points)


def _islands(results: list[dict]) -> list[dict]:
    """The larger islands' DiLoCo runs, each with its gap to the best sync DP run of the same size and seed."""
    def size(r: dict) -> tuple:
        return r["peers"], r["batch_size"], r["steps"], r["seed"], r["data"]

    dp: dict[tuple, dict] = {}
    for r in results:
        if r["method"] == "syncdp" and r["batch_size"] == ISLAND_BATCH and (size(r) not in dp or r["final_loss"] < dp[size(r)]["final_loss"]):
            dp[size(r)] = r
    return [dict(r, gap=r["final_loss"] / dp[size(r)]["final_loss"] - 1, syncdp_loss=dp[size(r)]["final_loss"],
                 syncdp_lr=dp[size(r)]["inner_lr"])
            for r in results if r["method"] == "diloco" and r["batch_size"] == ISLAND_BATCH and size(r) in dp]


def _sizes(results: list[dict]) -> list[dict]:
    """The sizes phase at each width, the default's own runs among them: per width and seed, the best sync DP run and
    the best DiLoCo run at SIZE_DILOCO (over the inner lrs tried), with the gap between them."""
    h, c, o, m = SIZE_DILOCO
    def at(r: dict) -> bool:
        return ((r["peers"], r["batch_size"], r["steps"], r["data"], r["optimizer"]) == (PEERS, BATCH, STEPS, "shards", "adamw")
                and r["schedule"] == "fixed")

    best: dict[tuple, dict] = {}
    for r in results:
        if not at(r) or (r["method"] == "diloco" and ((r["inner_steps"], r["compression"], r["outer_lr"], r["outer_momentum"],
                                                       r["reducer_feedback"]) != (h, c, o, m, False))):
            continue
        key = (r["d_model"], r["seed"], r["method"])
        if key not in best or r["final_loss"] < best[key]["final_loss"]:
            best[key] = r
    widths = {key[0] for key in best if key[0] != D_MODEL}
    return [dict(d_model=d, seed=seed, params=_params(d), syncdp_lr=dp["inner_lr"],
                 syncdp_loss=dp["final_loss"], inner_lr=best[(d, seed, "diloco")]["inner_lr"],
                 loss=best[(d, seed, "diloco")]["final_loss"], gap=best[(d, seed, "diloco")]["final_loss"] / dp["final_loss"] - 1)
            for (d, seed, method), dp in sorted(best.items())
            if method == "syncdp" and (d, seed, "diloco") in best and widths]


def _params(d_model: int) -> int:
    return sum(p.numel() for p in build_model(ModelConfig(d_model=d_model), 0).parameters())


def method_name(point: dict, syncdp_lr: float | None) -> str:
    """One curve of the picture: the outer optimizer, the schedule, and the inner lr where it is not sync DP's (always,
    with ``syncdp_lr`` None)."""
    if point["outer_momentum"] == 0 and point["outer_lr"] == 1.0:
        name = "plain averaging (lr 1, momentum 0)"
    else:
        name = f"Nesterov lr {point['outer_lr']:g}, momentum {point['outer_momentum']:g}"
    if point["schedule"] == "grow":
        name += ", H growing"
    if point.get("outer_warmup"):
        name += f", outer lr warm-up over {point['outer_warmup']} rounds"
    if point.get("reducer_feedback"):
        name += ", reducer's error feedback"
    if point["inner_lr"] != syncdp_lr:
        name += f", inner lr {point['inner_lr']:g}"
    return name


def report(out: Path) -> str:
    summary = summarize(load(out))
    dp = summary["syncdp"]
    if dp is None:
        raise ValueError(f"no sync DP run in {out / 'results.jsonl'} yet")
    lines = [
        f"Sync DP, tuned inner lr {dp['inner_lr']:g} (grid, seed 0: "
        + ", ".join(f"{lr:g} → {loss:.4f}" for lr, loss in sorted(dp["grid"].items()))
        + f"): held-out loss {dp['loss_mean']:.4f} over {dp['seeds']} seed(s), {dp['bytes_per_token']:,.0f} wire bytes per token.",
        "",
        "| H | codec | method | outer steps | wire bytes / token | fewer bytes than fp32 sync DP | seeds | loss | gap to sync DP (min … max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in summary["points"]:
        spread = f" ({100 * p['gap_min']:+.1f} … {100 * p['gap_max']:+.1f})" if p["seeds"] > 1 else ""
        lines.append(
            f"| {p['inner_steps']} | {p['compression']} | {method_name(p, dp['inner_lr'])} | {p['outer_steps']} "
            f"| {p['wire_bytes_per_token']:.2f} | {p['fewer_bytes_than_syncdp']:,.0f}× | {p['seeds']} | {p['loss_mean']:.4f} "
            f"| **{100 * p['gap_mean']:+.1f}%**{spread} |"
        )
    if summary["checks"]:
        lines += ["", "One island (the broken-method checks): held-out loss after the same inner steps", "",
                  "| run | loss |", "|---|---|"]
        for r in summary["checks"]:
            name = "plain AdamW" if r["method"] == "syncdp" else f"H {r['inner_steps']} {r['compression']}, " + method_name(
                dict(r, schedule=r["schedule"]), r["inner_lr"])
            lines.append(f"| {name}, inner lr {r['inner_lr']:g} | {r['final_loss']:.4f} |")
    if summary["iid"]:
        lines += ["", "Every island on the whole corpus (iid) instead of its own quarter: gap to sync DP on the same data; "
                  "the islands' agreement, |mean|² / mean |gᵢ|² of the outer gradients (1: all alike, 1/4: orthogonal), "
                  "over the first and the last quarter of the rounds, where measured", "",
                  "| run | data | sync DP loss (same data) | loss | gap | islands' agreement |", "|---|---|---|---|---|---|"]
        for r in sorted(summary["iid"], key=lambda r: (r["inner_steps"], r["compression"], -r["inner_lr"], r["data"])):
            name = f"H {r['inner_steps']} {r['compression']}, " + method_name(r, r["inner_lr"]) + f", inner lr {r['inner_lr']:g}"
            agreement = (f"{r['island_agreement_first_quarter']:.3f} / {r['island_agreement_last_quarter']:.3f}"
                         if "island_agreement_first_quarter" in r else "–")
            lines.append(f"| {name} | {r['data']} | {r['syncdp_loss']:.4f} | {r['final_loss']:.4f} | **{100 * r['gap']:+.1f}%** "
                         f"| {agreement} |")
    if summary["islands"]:
        lines += ["", f"Islands of {ISLAND_BATCH} sequences per inner step ({ISLAND_BATCH // BATCH}× the study's): gap to the "
                  "best sync DP run at the same global batch, steps and seed", "",
                  "| run | seed | inner steps | outer steps | fewer bytes than fp32 sync DP | sync DP loss (its lr) | loss | gap |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in sorted(summary["islands"], key=lambda r: (r["inner_steps"], r["inner_lr"], r["seed"])):
            name = f"H {r['inner_steps']} {r['compression']}, " + method_name(r, r["inner_lr"]) + f", inner lr {r['inner_lr']:g}"
            lines.append(f"| {name} | {r['seed']} | {r['steps']} | {r['outer_steps']} | {r['fewer_bytes_than_syncdp']:,.0f}× "
                         f"| {r['syncdp_loss']:.4f} ({r['syncdp_lr']:g}) | {r['final_loss']:.4f} | **{100 * r['gap']:+.1f}%** |")
    if summary["sizes"]:
        h, c, o, m = SIZE_DILOCO
        lines += ["", f"Model width (the default {D_MODEL}; layers, heads, context and tokens unchanged): DiLoCo at H {h} {c}, "
                  f"Nesterov {o:g} / {m:g}, against the best sync DP at the same width and seed", "",
                  "| d_model | params | seed | sync DP loss (its lr) | DiLoCo loss (its inner lr) | gap |", "|---|---|---|---|---|---|"]
        for r in summary["sizes"]:
            lines.append(f"| {r['d_model']} | {r['params'] / 1e6:.2f}M | {r['seed']} | {r['syncdp_loss']:.4f} ({r['syncdp_lr']:g}) "
                         f"| {r['loss']:.4f} ({r['inner_lr']:g}) | **{100 * r['gap']:+.1f}%** |")
    muon = summary["muon"]
    if muon["grid"]:
        lines += ["", "Muon islands (the block matrices with Muon, the rest with AdamW; phase muon). Muon sync DP, lr grid at "
                  "seed 0: " + ", ".join(f"{lr:g} → {loss:.4f}" for lr, loss in sorted(muon["grid"].items()))
                  + (f"; its best ({muon['best_lr']:g}) over {len(muon['syncdp'])} seed(s): "
                     + ", ".join(f"{loss:.4f}" for _, loss in sorted(muon["syncdp"].items())) if muon["syncdp"] else ""), ""]
        if muon["points"]:
            lines += ["| H | codec | method | outer steps | fewer bytes than fp32 sync DP | seeds | loss | gap to AdamW sync DP "
                      "| gap to the better sync DP per seed |", "|---|---|---|---|---|---|---|---|---|"]
            for p in muon["points"]:
                lines.append(f"| {p['inner_steps']} | {p['compression']} | Muon islands, {method_name(p, None)} "
                             f"| {p['outer_steps']} | {p['fewer_bytes_than_syncdp']:,.0f}× | {p['seeds']} | {p['loss_mean']:.4f} "
                             f"| {_gap(p, 'gap_adamw')} | **{_gap(p, 'gap')}** |")
    lines += _floor_length_table(load(out))
    lines += _floor_clip_table(load(out))
    lines += _overlap_table(load(out))
    lines += _probe_table(_load_probes(out))
    table = "\n".join(lines) + "\n"
    (out / "study.md").write_text(table)
    from experiments.learning_plot import plot  # it imports this module

    plot(summary, out / "study.png")
    return table


def _floor_length_table(results: list[dict]) -> list[str]:
    """Phase floor-length, one table per length: sync DP's grid (seed 0), and each DiLoCo run's gap to sync DP's best
    lr at the same seed."""
    lines = []
    for steps in sorted(FLOOR_LENGTHS):
        runs = [r for r in results if _floor_length(r, steps)]
        grid = {r["inner_lr"]: r["final_loss"] for r in runs if r["method"] == "syncdp" and r["seed"] == 0}
        if not grid:
            continue
        best_lr = min(grid, key=grid.get)
        dp = {r["seed"]: r["final_loss"] for r in runs if r["method"] == "syncdp" and r["inner_lr"] == best_lr}
        lines += ["", f"The floor over {steps} steps (phase floor-length: islands of {BATCH} sequences, {steps / STEPS:g}× "
                  "the study's tokens; H = 1, fp32, plain averaging). Sync DP, lr grid at seed 0: "
                  + ", ".join(f"{lr:g} → {loss:.4f}" for lr, loss in sorted(grid.items()))
                  + f"; its best ({best_lr:g}) per seed: " + ", ".join(f"{loss:.4f}" for _, loss in sorted(dp.items())), "",
                  "| DiLoCo inner lr | × sync DP's | seed | loss | gap |", "|---|---|---|---|---|"]
        for r in sorted((r for r in runs if r["method"] == "diloco" and r["seed"] in dp), key=lambda r: (r["inner_lr"], r["seed"])):
            lines.append(f"| {r['inner_lr']:g} | {r['inner_lr'] / best_lr:g} | {r['seed']} | {r['final_loss']:.4f} "
                         f"| **{100 * (r['final_loss'] / dp[r['seed']] - 1):+.1f}%** |")
    return lines


def _floor_clip_table(results: list[dict]) -> list[str]:
    """Phase floor-clip: unclipped sync DP's grid (seed 0); each unclipped DiLoCo run beside the same run clipped, its
    gap to unclipped sync DP's best lr, to the clipped sync DP's and to the better of the two, at its seed."""
    clipped = _best(results, method="syncdp")
    runs = [r for r in results if _floor_clip(r)]
    if clipped is None or not runs:
        return []
    grid = {r["inner_lr"]: r["final_loss"] for r in runs if r["method"] == "syncdp" and r["seed"] == 0}
    best_lr = min(grid, key=grid.get) if grid else None
    dp = {r["seed"]: r["final_loss"] for r in results if _standard(r) and r["method"] == "syncdp" and r["inner_lr"] == clipped["inner_lr"]}
    unclipped = {r["seed"]: r["final_loss"] for r in runs if r["method"] == "syncdp" and r["inner_lr"] == best_lr}
    loss = {r["key"]: r["final_loss"] for r in results}

    def gap(x: float, base: float | None) -> str:
        return "–" if base is None else f"{100 * (x / base - 1):+.1f}%"

    lines = ["", "Unclipped (phase floor-clip: every inner step's gradient as it is, --grad-clip-norm 0; and islands "
             "clipped at a higher norm). Sync DP "
             "unclipped, lr grid at seed 0: " + (", ".join(f"{lr:g} → {x:.4f}" for lr, x in sorted(grid.items())) or "none yet")
             + (f"; its best ({best_lr:g}) per seed: " + ", ".join(f"{x:.4f}" for _, x in sorted(unclipped.items())) if grid else "")
             + f"; clipped, its best ({clipped['inner_lr']:g}) per seed: " + ", ".join(f"{x:.4f}" for _, x in sorted(dp.items())), "",
             "| DiLoCo | inner lr (× sync DP's) | seed | loss | the same run clipped at 1 | gap to unclipped sync DP "
             "| gap to clipped sync DP | gap to the better |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted((r for r in runs if r["method"] == "diloco" and r["seed"] in dp),
                    key=lambda r: (r["inner_steps"], r["clip"], r["inner_lr"], r["seed"])):
        same = loss.get(_key_without(r, "clip"))
        setting = "H = 1, fp32, plain averaging" if r["inner_steps"] == 1 else _outer_setting(r)
        setting += f", islands clipped at {r['clip']:g}" if r["clip"] else ", unclipped"
        better = min(dp[r["seed"]], unclipped.get(r["seed"], dp[r["seed"]]))
        lines.append(f"| {setting} | {r['inner_lr']:g} ({r['inner_lr'] / clipped['inner_lr']:g}) | {r['seed']} "
                     f"| {r['final_loss']:.4f} | {'–' if same is None else f'{same:.4f}'} | {gap(r['final_loss'], None if r['clip'] else unclipped.get(r['seed']))} "
                     f"| {gap(r['final_loss'], dp[r['seed']])} | **{gap(r['final_loss'], better)}** |")
    return lines


def _key_without(result: dict, *fields: str) -> str:
    """The key of ``result``'s run with ``fields`` at their defaults (the same run without what a phase varied)."""
    return Run(**{k: result[k] for k in Run.__dataclass_fields__ if k not in fields}).key


def _outer_setting(result: dict) -> str:
    return (f"H = {result['inner_steps']}, {result['compression']}, Nesterov {result['outer_lr']:g} / "
            f"{result['outer_momentum']:g}")


def _lag(result: dict) -> str:
    """An overlap in inner steps and as a share of the round."""
    return f"{result['overlap']} ({result['overlap'] / result['inner_steps']:.0%})"


def _overlap_table(results: list[dict]) -> list[str]:
    """Phase overlap: each overlapped run beside the same run with its average applied before the next inner step,
    both as gaps to the tuned sync DP at the same seed."""
    best = _best(results, method="syncdp")
    runs = [r for r in results if r.get("overlap", 0) and r["method"] == "diloco"]
    if best is None or not runs:
        return []
    dp = {r["seed"]: r["final_loss"] for r in results if _standard(r) and r["method"] == "syncdp" and r["inner_lr"] == best["inner_lr"]}
    loss = {r["key"]: r["final_loss"] for r in results}
    lines = ["", "The peer's overlap (phase overlap): the islands keep training while their round's average is on the wire "
             "and keep that work when it lands, so the outer step reaches them this many inner steps late; eager: those "
             "steps start from the outer step's preview with an estimated average", "",
             "| DiLoCo | overlap (inner steps, share of H) | seed | loss | gap | the same run, no overlap: loss, gap |",
             "|---|---|---|---|---|---|"]
    for r in sorted((r for r in runs if r["seed"] in dp), key=lambda r: (r["inner_steps"], r["eager"], r["overlap"], r["seed"])):
        same = loss.get(_key_without(r, "overlap", "eager"))
        base = dp[r["seed"]]
        setting = f"{_outer_setting(r)}, inner lr {r['inner_lr']:g}" + (", eager" if r["eager"] else "")
        lines.append(f"| {setting} | {_lag(r)} | {r['seed']} | {r['final_loss']:.4f} "
                     f"| **{100 * (r['final_loss'] / base - 1):+.1f}%** "
                     f"| {'–' if same is None else f'{same:.4f}, {100 * (same / base - 1):+.1f}%'} |")
    waits = [(r, w) for r in runs if not r["eager"] for w in results if w["method"] == "diloco" and not w.get("overlap")
             and w["steps"] == STEPS * r["inner_steps"] // (r["inner_steps"] + r["overlap"]) and w["steps"] < STEPS
             and all(w[k] == r[k] for k in _POINT) and w["seed"] == r["seed"]]
    if waits:
        lines += ["", "Waiting for the average instead of training meanwhile, in the same wall time: H / (H + overlap) of "
                  "the tokens, the lr schedule over that length", "",
                  "| DiLoCo | overlap it waits out | seed | tokens | loss (waiting) | loss (overlapped, all the tokens) |",
                  "|---|---|---|---|---|---|"]
        for r, w in sorted(waits, key=lambda pair: (pair[0]["inner_steps"], pair[0]["overlap"], pair[0]["seed"])):
            lines.append(f"| {_outer_setting(r)} | {_lag(r)} | {r['seed']} | {w['tokens']:,} "
                         f"| {w['final_loss']:.4f} | {r['final_loss']:.4f} |")
    return lines


def _probe_table(probes: list[dict]) -> list[str]:
    """The floor's probe (_FloorProbe): per run and quarter of its steps, the islands' mean step against sync DP's."""
    if not probes:
        return []
    lines = ["", "The floor's steps (`probe`: H = 1, plain averaging; sync DP's step from the same params on the same batches, "
             "at its own lr, beside each): the islands' mean step, its part along sync DP's step and across it, as "
             "fractions of sync DP's step's length; their cosine; one island's step (RMS) against sync DP's; the share of "
             "steps whose gradient was clipped (islands / sync DP); AdamW's divisor sqrt(v), island's against sync DP's "
             "(median over the coordinates) at the quarter's end", "",
             "| run | quarter | mean step | along | across | cosine | one island's step | clipped | divisor | loss (results.jsonl) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(probes, key=lambda r: (r["batch_size"], r["optimizer"], r["steps"], -r.get("clip", CLIP), r["inner_lr"])):
        name = (f"{'Muon' if r['optimizer'] == 'muon' else 'AdamW'}, {r['batch_size']} sequences, inner lr {r['inner_lr']:g} "
                f"({r['inner_lr'] / r['shadow_lr']:g}× sync DP's)" + (f", {r['steps']} steps" if r["steps"] != STEPS else "")
                + (", unclipped (sync DP too)" if r.get("clip", CLIP) == 0 else ""))
        for q, row in enumerate(r["floor_probe"]["quarters"], 1):
            divisor = "–" if row["divisor"] is None else f"{row['divisor']:.3f}"
            stored = "–" if r["stored_final_loss"] is None else f"{r['stored_final_loss']:.4f}"
            loss = f"{r['final_loss']:.4f} ({stored})" if q == 1 else ""
            lines.append(f"| {name if q == 1 else ''} | {q} | {row['length']:.3f} | {row['along']:.3f} | {row['across']:.3f} "
                         f"| {row['cosine']:.3f} | {row['island_length']:.3f} | {row['island_clipped']:.2f} / "
                         f"{row['shadow_clipped']:.2f} | {divisor} | {loss} |")
    return lines


def _gap(point: dict, kind: str) -> str:
    """A gap's mean over the seeds, with its spread where there is more than one."""
    spread = f" ({100 * point[f'{kind}_min']:+.1f} … {100 * point[f'{kind}_max']:+.1f})" if point["seeds"] > 1 else ""
    return f"{100 * point[f'{kind}_mean']:+.1f}%{spread}"
