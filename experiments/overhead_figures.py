"""The overhead benchmark's figures (experiments/overhead.py), from what its processes wrote alone: each bare
worker's and each peer's rates over their windows, a swarm phase against the bare phases around it, each
process's ratio factored (tokens per CPU second x core share x steps' share of the wall), the table."""

from __future__ import annotations

import bisect
from typing import Any


def _rate(tokens: float, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _at(ends: list[float], values: list[float], moment: float) -> float:
    """A cumulative count at ``moment`` (seconds since the timed steps began), ``values[k]`` reached at ``ends[k]``,
    0 at 0, linear in between (steps are back to back: a step's tokens and CPU accrue over its own time)."""
    if moment <= 0 or not ends:
        return 0.0
    index = bisect.bisect_left(ends, moment)
    if index >= len(ends):
        return values[-1]
    start, before = (ends[index - 1], values[index - 1]) if index else (0.0, 0.0)
    span = ends[index] - start
    return before + (values[index] - before) * (moment - start) / span if span > 0 else values[index]


def bare_figures(record: dict, together: tuple[float, float] | None = None) -> dict[str, Any]:
    """One bare worker's figures from its result record (``worker_main`` writes it).

    ``together``: the wall-clock window in which every worker of the phase was in its timed steps. The rates are
    taken in it (from the record's per-step trace) when given: a worker that finishes first leaves its CPU to the
    others, and a rate over each one's own window counts that CPU twice (the three rates' core shares once summed
    to 2.05 of the 2 cores). The rates over the worker's own window stay beside them (``own_window_*``)."""
    tokens, wall = record["tokens"], record["wall_s"]
    warmup_tokens = record["warmup_steps"] * record["tokens_per_step"]
    compute_fraction = record["compute_s"] / wall if wall > 0 else 1.0  # the loop's own overhead: ~0.1%
    figures = dict(
        steps=record["steps"],
        tokens=tokens,
        wall_s=wall,
        tokens_per_s=_rate(tokens, wall),
        compute_tokens_per_s=_rate(tokens, record["compute_s"]),
        cpu_tokens_per_s=_rate(tokens, record.get("cpu_s", 0.0)),
        cpu_share=_rate(record["cpu_s"], record["compute_s"]) if record.get("cpu_s") else None,
        tokens_per_s_with_warmup=_rate(tokens + warmup_tokens, wall + record["warmup_s"]),
        warmup_s=record["warmup_s"],
        unix_start=record["unix_start"],
        unix_end=record["unix_end"],
        window="own",
        window_s=wall,
    )
    figures["own_window_tokens_per_s"] = figures["tokens_per_s"]
    ends, cpu = record.get("step_end_s"), record.get("step_cpu_s")
    if together is None or not ends or not cpu or together[1] <= together[0]:
        return figures
    first, last = (moment - record["unix_start"] for moment in together)
    done = [record["tokens_per_step"] * (k + 1) for k in range(len(ends))]  # tokens by the end of each step
    counted = _at(ends, done, last) - _at(ends, done, first)
    spent = _at(ends, cpu, last) - _at(ends, cpu, first)
    seconds = last - first
    figures.update(
        window="together",
        window_s=seconds,
        tokens_in_window=counted,
        tokens_per_s=_rate(counted, seconds),
        compute_tokens_per_s=_rate(counted, seconds * compute_fraction),
        cpu_tokens_per_s=_rate(counted, spent),
        cpu_share=_rate(spent, seconds * compute_fraction),
    )
    return figures


def together_window(records: list[dict]) -> tuple[float, float] | None:
    """The wall-clock window in which every record's worker was in its timed steps, or None if there is none."""
    if not records:
        return None
    window = (max(r["unix_start"] for r in records), min(r["unix_end"] for r in records))
    return window if window[1] > window[0] else None


def swarm_figures(records: list[dict]) -> dict[str, Any]:
    """One peer's figures from its metrics records: tokens over the wall time from the start of its training to its
    last record, and where that time went. Cumulative counters are taken net of the ``init`` record's (its
    evaluation ran before the clock of ``time_s`` started). Raises ValueError if it recorded no training."""
    init = next((r for r in records if r.get("status") == "init"), None)
    trained = [r for r in records if r.get("status") != "init"]
    if not trained or trained[-1]["time_s"] <= 0:
        raise ValueError("no record after the init record: the peer trained nothing it recorded")
    last = trained[-1]
    base = {key: (init or {}).get(key) or 0.0 for key in ("compute_s", "compute_cpu_s", "blocked_s", "eval_s")}
    wall = last["time_s"]
    compute, blocked, evaluating = (last[key] - base[key] for key in ("compute_s", "blocked_s", "eval_s"))
    cpu = last.get("compute_cpu_s", 0.0) - base["compute_cpu_s"]  # 0 from a peer that predates the field
    # the peer's DHT, averager and p2pd processes: their CPU per minute from its first round's record to its last one's
    # (rounds 2 on: the first peer writes its init record before its averager's process has finished starting, ~1 CPU
    # s that falls before the training's clock but after that record; docs/benchmarks.md, "What is left"); with one
    # round, from the init record on
    since = trained[0] if len(trained) > 1 and trained[0].get("background_cpu_s") is not None else init
    background = [None if r is None else r.get("background_cpu_s") for r in (since, last)]
    window = last["unix_time"] - since["unix_time"] if since is not None else 0.0
    return dict(
        outer_steps=last["outer_step"],
        rounds_ok=sum(r.get("status") == "ok" for r in trained),
        steps=sum(r.get("inner_steps", 0) for r in trained),
        tokens=last["tokens"],
        wall_s=wall,
        tokens_per_s=_rate(last["tokens"], wall),
        compute_tokens_per_s=_rate(last["tokens"], compute),
        cpu_tokens_per_s=_rate(last["tokens"], cpu),
        cpu_share=_rate(cpu, compute) if cpu > 0 else None,
        background_cpu_s_per_min=(60 * (background[1] - background[0]) / window
                                  if None not in background and window > 0 else None),
        compute_fraction=compute / wall,
        blocked_fraction=blocked / wall,
        eval_fraction=evaluating / wall,
        other_fraction=1.0 - (compute + blocked + evaluating) / wall,
        blocked_s=blocked,
        eval_s=evaluating,
        unix_start=last["unix_time"] - wall,
        unix_end=last["unix_time"],
    )


def concurrency(windows: list[tuple[float, float]]) -> float | None:
    """The time all processes ran at once, as a fraction of the mean window: 1.0 = all began and ended together."""
    if not windows:
        return None
    together = min(end for _, end in windows) - max(start for start, _ in windows)
    mean = sum(end - start for start, end in windows) / len(windows)
    return max(together, 0.0) / mean if mean > 0 else None


RATES = ("tokens_per_s", "compute_tokens_per_s", "cpu_tokens_per_s", "cpu_share", "own_window_tokens_per_s")


def bracket(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Each bare process's rates as the mean of the bare phases before and after a swarm phase (figures by name), so
    that a machine that drifts in speed over the run (a shared machine does) moves both sides alike. A process that
    one side lacks takes the other's; a rate that either side lacks is left out (None)."""
    merged = {}
    for name in sorted({*before, *after}):
        sides = [f for f in (before.get(name), after.get(name)) if f is not None]
        figures = dict(sides[0])
        for key in RATES:
            values = [f.get(key) for f in sides]
            figures[key] = sum(values) / len(values) if all(v is not None for v in values) else None
        merged[name] = figures
    return merged


def bare_sum(figures: dict[str, dict], key: str = "tokens_per_s") -> float | None:
    """The bare processes' tokens/s in all (None if one has none); ``key``: which of their rates."""
    values = [f.get(key) for f in figures.values()]
    return sum(values) if values and all(v is not None for v in values) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarise(bare: dict[str, dict], swarm: dict[str, dict], peers: int) -> dict[str, Any]:
    """Process i of each phase side by side (both on shard i of N), the sums and the ratio swarm / bare, from the
    figures of ``bare_figures`` and ``swarm_figures`` (by name: ``bare{i}`` and ``peer{i}``)."""
    rows = []
    for index in range(peers):
        b, s = bare.get(f"bare{index}"), swarm.get(f"peer{index}")
        rows.append(dict(
            process=index,
            bare_tokens_per_s=b and b["tokens_per_s"],
            swarm_tokens_per_s=s and s["tokens_per_s"],
            ratio=_ratio(s and s["tokens_per_s"], b and b["tokens_per_s"]),
            bare_compute_tokens_per_s=b and b["compute_tokens_per_s"],
            swarm_compute_tokens_per_s=s and s["compute_tokens_per_s"],
            compute_ratio=_ratio(s and s["compute_tokens_per_s"], b and b["compute_tokens_per_s"]),
            # the ratio, factored exactly (tokens/wall = tokens/CPU x CPU/compute x compute/wall): what a token
            # costs in CPU, the share of a core the steps got, the steps' share of the wall time (bare: ~1)
            cpu_cost_factor=_ratio(s and s["cpu_tokens_per_s"], b and b["cpu_tokens_per_s"]),
            cpu_share_factor=_ratio(s and s["cpu_share"], b and b["cpu_share"]),
            steps_share_factor=_ratio(s and _ratio(s["tokens_per_s"], s["compute_tokens_per_s"]),
                                      b and _ratio(b["tokens_per_s"], b["compute_tokens_per_s"])),
            swarm_background_cpu_s_per_min=s and s["background_cpu_s_per_min"],
            bare_cpu_share=b and b["cpu_share"],
            swarm_cpu_share=s and s["cpu_share"],
            swarm_blocked_fraction=s and s["blocked_fraction"],
            swarm_eval_fraction=s and s["eval_fraction"],
            swarm_other_fraction=s and s["other_fraction"],
        ))
    complete = all(r["bare_tokens_per_s"] and r["swarm_tokens_per_s"] for r in rows)

    def total(key: str) -> float | None:
        values = [r[key] for r in rows]
        return sum(values) if all(v is not None for v in values) else None

    bare_total, swarm_total = total("bare_tokens_per_s"), total("swarm_tokens_per_s")
    # each bare process's rate had its tokens cost its CPU what the swarm's did: what is left of the ratio is the
    # core share and the steps' share, what a peer takes from its trainer (tokens per CPU s move with the machine)
    at_cost = [r["bare_tokens_per_s"] * r["cpu_cost_factor"] if r["bare_tokens_per_s"] and r["cpu_cost_factor"]
               else None for r in rows]
    bare_at_cost = sum(at_cost) if at_cost and None not in at_cost else None
    own_total = bare_sum(bare, "own_window_tokens_per_s") if len(bare) == peers else None
    return dict(
        complete=complete,
        per_process=rows,
        bare_tokens_per_s_sum=bare_total,
        swarm_tokens_per_s_sum=swarm_total,
        ratio=_ratio(swarm_total, bare_total),
        # each bare worker over its own window instead (how this benchmark counted before the common window)
        bare_own_windows_tokens_per_s_sum=own_total,
        ratio_own_windows=_ratio(swarm_total, own_total),
        ratio_at_equal_cpu_cost=_ratio(swarm_total, bare_at_cost),
        compute_ratio=_ratio(total("swarm_compute_tokens_per_s"), total("bare_compute_tokens_per_s")),
        bare_concurrency=concurrency([(f["unix_start"], f["unix_end"]) for f in bare.values()]),
        swarm_concurrency=concurrency([(f["unix_start"], f["unix_end"]) for f in swarm.values()]),
    )


def cell(value: float | None, form: str) -> str:
    return "—" if value is None else format(value, form)


def markdown_table(summary: dict[str, Any]) -> str:
    lines = [
        "| process | bare tok/s | swarm tok/s | swarm / bare | compute tok/s bare | compute tok/s swarm | "
        "swarm blocked | swarm eval | swarm other | = tokens per CPU s | x core share (bare -> swarm) | x steps' share of wall "
        "| background CPU s/min |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in summary["per_process"]:
        lines.append(
            f"| {r['process']} | {cell(r['bare_tokens_per_s'], ',.0f')} | {cell(r['swarm_tokens_per_s'], ',.0f')} | "
            f"{cell(r['ratio'], '.3f')} | {cell(r['bare_compute_tokens_per_s'], ',.0f')} | "
            f"{cell(r['swarm_compute_tokens_per_s'], ',.0f')} | {cell(r['swarm_blocked_fraction'], '.1%')} | "
            f"{cell(r['swarm_eval_fraction'], '.1%')} | {cell(r['swarm_other_fraction'], '.1%')} | "
            f"{cell(r['cpu_cost_factor'], '.3f')} | {cell(r['cpu_share_factor'], '.3f')} "
            f"({cell(r['bare_cpu_share'], '.3f')} -> {cell(r['swarm_cpu_share'], '.3f')}) | "
            f"{cell(r['steps_share_factor'], '.3f')} | {cell(r['swarm_background_cpu_s_per_min'], '.2f')} |"
        )
    s = summary
    lines.append(f"| **sum** | {cell(s['bare_tokens_per_s_sum'], ',.0f')} | {cell(s['swarm_tokens_per_s_sum'], ',.0f')} | "
                 f"**{cell(s['ratio'], '.3f')}** | | | | | | | | | |")
    return "\n".join(lines) + "\n"
