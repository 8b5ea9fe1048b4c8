"""``scripts/simulate.py``: the command line of the simulator (sweep, report, bandwidth, calibrate).

Parses flags into the configs of ``scenarios`` and ``bandwidth``, runs them, prints the tables and writes
OUT/*.json, *.md and *.png. Bad input ends in one line on stderr and exit status 2, never a traceback. A
progress line goes to stderr while simulations run. No simulation logic lives here.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from experiments.sim import report
from experiments.sim.bandwidth import TOPOLOGIES, BandwidthConfig, inner_steps_for_round, island_bandwidth
from experiments.sim.calibrate import calibrate, replay
from experiments.sim.goodput import YEAR_S
from experiments.sim.scenarios import (
    ReportBandwidth,
    ReportScenario,
    SweepConfig,
    report_bandwidth,
    report_goodput,
    sweep,
)

GBIT = 1e9


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # the reason, not the whole usage
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Progress:
    """One line on stderr, rewritten in place on a terminal, one line per update otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.width = 0

    def __call__(self, line: str) -> None:
        if self.tty:
            sys.stderr.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()


def _chips(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(float(v)) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated chip counts, got {text!r}") from None
    return values


def _common() -> argparse.ArgumentParser:
    """--out and --seed, accepted after every subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", default="runs/sim", help="folder for the JSON, markdown and PNG outputs (default runs/sim)")
    common.add_argument("--seed", type=int, default=0, help="seed of the simulated interruptions (default 0)")
    return common


def _add_sweep(commands: argparse._SubParsersAction) -> None:
    d = SweepConfig()
    p = commands.add_parser("sweep", parents=[_common()], help="goodput of the three methods from tens to a million chips")
    p.add_argument("--chips", type=_chips, default=d.chips, help="comma-separated totals (default 10,...,1e6)")
    p.add_argument("--island-chips", type=int, default=d.island_chips, help=f"chips per decoupled island (default {d.island_chips})")
    p.add_argument("--slice-chips", type=int, default=d.slice_chips, help=f"chips one interruption takes out (default {d.slice_chips})")
    p.add_argument("--mtbi-chip-h", type=float, default=d.mtbi_chip_s / 3600, help="mean hours between interruptions of one chip (default 8760: a year)")
    for flag, field, what in (("--restart-s", "restart_s", "sync DP restart / island back after a failure"),
                              ("--checkpoint-interval-s", "checkpoint_interval_s", "sync DP checkpoint period"),
                              ("--reform-s", "reform_s", "elastic DP stall to drop a slice"),
                              ("--rejoin-s", "rejoin_s", "elastic DP stall to take a slice back"),
                              ("--repair-s", "repair_s", "a failed slice is out this long"),
                              ("--round-s", "round_s", "decoupled round length (work a killed island loses)"),
                              ("--neighbour-stall-s", "neighbour_stall_s", "stall of a failed island's averaging partners")):
        p.add_argument(flag, type=float, default=getattr(d, field), help=f"{what} (default {getattr(d, field):g})")
    p.add_argument("--model-params", type=float, default=d.model_params, help=f"parameters, for the state download (default {d.model_params:g})")
    p.add_argument("--link-gbit", type=float, default=d.link_gbit, help=f"an island's link, Gbit/s (default {d.link_gbit:g})")
    p.add_argument("--interruptions", type=int, default=d.interruptions_per_point, help="interruptions simulated per point, about (default 2000)")
    p.add_argument("--calibrate-from", metavar="RUN_DIR", help="take our protocol's overheads from a chaos or swarm run folder")


def _add_bandwidth(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bandwidth", parents=[_common()], help="bits per second each island sends: data parallel vs DiLoCo")
    p.add_argument("--params", type=float, required=True, help="model parameters, e.g. 12e9")
    p.add_argument("--islands", type=int, required=True, help="islands exchanging over the slow links")
    p.add_argument("--tokens-per-s", type=float, required=True, help="tokens per second one island trains at")
    p.add_argument("--tokens-per-step", type=float, required=True, help="tokens of one island's inner step")
    rounds = p.add_mutually_exclusive_group(required=True)
    rounds.add_argument("--inner-steps", type=float, help="H: inner steps per round (per fragment sync)")
    rounds.add_argument("--tokens-per-round", type=float, help="swarm-wide tokens per round (H is derived)")
    p.add_argument("--bits", type=float, default=4.0, help="bits per outer-gradient value on the wire (default 4)")
    p.add_argument("--dp-bits", type=float, default=16.0, help="bits per data-parallel gradient value (default 16)")
    p.add_argument("--fragments", type=int, default=1, help="P: streaming fragments (default 1)")
    p.add_argument("--overlap-steps", type=float, default=1.0, help="tau: inner steps an exchange may take (default 1)")
    p.add_argument("--dp-overlap-fraction", type=float, default=1.0, help="share of a step a DP all-reduce may take (default 1)")
    p.add_argument("--topology", choices=TOPOLOGIES, default="allreduce", help="DiLoCo exchange (default allreduce)")


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description="Goodput and bandwidth of p2p-diloco at 10 to 1,000,000 chips, "
                            "by simulation, beside data parallel; see docs/scale.md.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    _add_sweep(commands)
    report_parser = commands.add_parser("report", parents=[_common()], help="the Decoupled DiLoCo report's goodput and bandwidth cases")
    d = ReportScenario()
    report_parser.add_argument("--interruptions", type=int, default=d.interruptions,
                               help=f"interruptions per simulated run, about (default {d.interruptions})")
    report_parser.add_argument("--slice-chips", type=int, default=d.slice_chips,
                               help=f"chips one interruption takes out (default {d.slice_chips}: a TPU cube)")
    report_parser.add_argument("--repair-s", type=float, default=d.repair_s,
                               help=f"a failed slice is out this long (default {d.repair_s:g})")
    report_parser.add_argument("--checkpoint-interval-s", type=float, default=d.checkpoint_interval_s,
                               help=f"sync DP checkpoint period (default {d.checkpoint_interval_s:g})")
    _add_bandwidth(commands)
    cal = commands.add_parser("calibrate", parents=[_common()], help="read a run's metrics; replay its faults in the simulator")
    cal.add_argument("run_dir", metavar="RUN_DIR", help="a chaos folder (chaos.json) or a swarm folder (peer*.jsonl)")
    cal.add_argument("--part", choices=("chaotic", "calm"), default="chaotic", help="which run of a chaos folder")
    return parser


def _sweep(args: argparse.Namespace, out: Path, progress: _Progress) -> None:
    config = SweepConfig(
        chips=args.chips, island_chips=args.island_chips, slice_chips=args.slice_chips, mtbi_chip_s=args.mtbi_chip_h * 3600,
        restart_s=args.restart_s, checkpoint_interval_s=args.checkpoint_interval_s, reform_s=args.reform_s,
        rejoin_s=args.rejoin_s, repair_s=args.repair_s, round_s=args.round_s, model_params=args.model_params,
        link_gbit=args.link_gbit, neighbour_stall_s=args.neighbour_stall_s, interruptions_per_point=args.interruptions,
        seed=args.seed,
    )
    calibration = calibrate(args.calibrate_from) if args.calibrate_from else None
    rows = sweep(config, calibration, progress)
    progress.done()
    markdown = report.sweep_markdown(rows)
    years = config.mtbi_chip_s / YEAR_S
    title = (f"one interruption per chip every {years:g} year{'s' if years != 1 else ''}; islands of {config.island_chips} chips; "
             f"restart {config.restart_s:g} s, re-form {config.reform_s:g} s" + (", calibrated" if calibration else ""))
    report.write_json(out / "sweep.json", dict(config=config.__dict__, calibration=calibration and calibration.to_dict(), rows=rows))
    (out / "sweep.md").write_text(markdown + "\n")
    report.plot_sweep(rows, out / "sweep.png", title)
    print(markdown)
    print(f"\nwrote {out / 'sweep.json'}, {out / 'sweep.md'}, {out / 'sweep.png'}")


def _report(args: argparse.Namespace, out: Path, progress: _Progress) -> None:
    scenario = replace(ReportScenario(), interruptions=args.interruptions, slice_chips=args.slice_chips,
                       repair_s=args.repair_s, checkpoint_interval_s=args.checkpoint_interval_s, seed=args.seed)
    goodput = report_goodput(scenario, progress)
    progress.done()
    bandwidth = report_bandwidth(ReportBandwidth())
    markdown = report.report_markdown(goodput, bandwidth)
    report.write_json(out / "report.json", dict(goodput=goodput, bandwidth=bandwidth))
    (out / "report.md").write_text(markdown + "\n")
    report.plot_report(goodput, out / "report.png")
    print(markdown)
    print(f"\nwrote {out / 'report.json'}, {out / 'report.md'}, {out / 'report.png'}")


def _bandwidth(args: argparse.Namespace, out: Path) -> None:
    inner_steps = args.inner_steps or inner_steps_for_round(args.tokens_per_round, args.islands, args.tokens_per_step)
    config = BandwidthConfig(
        params=args.params, islands=args.islands, tokens_per_s=args.tokens_per_s, tokens_per_step=args.tokens_per_step,
        inner_steps=inner_steps, outer_bits=args.bits, dp_bits=args.dp_bits, fragments=args.fragments,
        overlap_steps=args.overlap_steps, dp_overlap_fraction=args.dp_overlap_fraction, topology=args.topology,
    )
    result = island_bandwidth(config)
    rows = [["data parallel", f"{result.dp_sustained_bits_per_s / GBIT:.4g}", f"{result.dp_required_bits_per_s / GBIT:.4g}"],
            [f"DiLoCo (H {inner_steps:g}, {args.bits:g}-bit, P {args.fragments}, tau {args.overlap_steps:g})",
             f"{result.diloco_sustained_bits_per_s / GBIT:.4g}", f"{result.diloco_required_bits_per_s / GBIT:.4g}"],
            ["data parallel / DiLoCo", f"{result.sustained_reduction:.4g}x", f"{result.required_reduction:.4g}x"]]
    print(f"step {result.step_s:.4g} s; each island sends (and receives as much):")
    print(report.table(["", "sustained Gbit/s", "required Gbit/s"], rows))
    path = report.write_json(out / "bandwidth.json", dict(config=config.__dict__, result=result.to_dict()))
    print(f"\nwrote {path}")


def _calibrate(args: argparse.Namespace, out: Path) -> None:
    calibration = calibrate(args.run_dir, args.part)
    result = replay(calibration, seed=args.seed)
    markdown = report.calibration_markdown(calibration.to_dict(), result.goodput)
    report.write_json(out / "calibration.json", dict(calibration=calibration.to_dict(), replay=result.to_dict()))
    print(markdown)
    print(f"\nwrote {out / 'calibration.json'}")


def main(argv: list[str] | None = None, prog: str = "simulate.py") -> int:
    args = build_parser(prog).parse_args(argv)
    out = Path(args.out)
    progress = _Progress()
    try:
        if args.command == "sweep":
            _sweep(args, out, progress)
        elif args.command == "report":
            _report(args, out, progress)
        elif args.command == "bandwidth":
            _bandwidth(args, out)
        else:
            _calibrate(args, out)
    except (ValueError, OSError) as e:
        progress.done()
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
