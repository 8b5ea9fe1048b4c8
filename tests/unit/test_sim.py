"""The internet-scale simulator (p2p_diloco/sim): its bookkeeping against hand computation, its determinism,
the bandwidth arithmetic, and the calibration against a recorded run as the chaos harness measures it."""

from __future__ import annotations

import json
import math
import random

import pytest

from experiments.sim.bandwidth import BandwidthConfig, allreduce_time_s, island_bandwidth
from experiments.sim.calibrate import CalibrationError, calibrate, replay
from experiments.sim.cli import main
from experiments.sim.goodput import FaultConfig, Interruption, MethodConfig, elastic_dp, simulate, sync_dp
from experiments.sim.scenarios import ReportBandwidth, report_bandwidth

NEVER = FaultConfig(mtbi_chip_s=1e30)


@pytest.mark.parametrize("method", [
    sync_dp(restart_s=60, checkpoint_interval_s=300, compute_fraction=0.9),
    elastic_dp(reform_s=20, rejoin_s=20, compute_fraction=0.9),
    MethodConfig("decoupled", groups=4, restart_s=100, save_interval_s=50, compute_fraction=0.9, neighbours=3,
                 neighbour_stall_s=30),
])
def test_without_interruptions_goodput_is_the_compute_fraction(method):
    result = simulate(method, NEVER, total_chips=16, horizon_s=10_000, seed=1)
    assert result.interruptions == 0 and result.lost_chip_s == 0
    assert result.goodput == pytest.approx(0.9, rel=1e-12)


def test_a_late_start_costs_its_share_of_the_wall_time():
    method = MethodConfig("decoupled", groups=2, startup_s=1_000, compute_fraction=0.5)
    assert simulate(method, NEVER, total_chips=2, horizon_s=10_000).goodput == pytest.approx(0.5 * 0.9)


HORIZON = 10_000.0
AT = 1_000.0  # one interruption, group 0
CHIPS = 16


def test_one_interruption_of_synchronous_data_parallel_costs_the_restart_and_the_work_since_the_checkpoint():
    method = sync_dp(restart_s=50, checkpoint_interval_s=300, compute_fraction=0.9)
    result = simulate(method, FaultConfig(slice_chips=4), CHIPS, HORIZON, trace=[Interruption(AT, 0)])
    lost = CHIPS * 0.9 * (AT % 300)  # 100 s since the checkpoint at 900 s
    assert result.lost_chip_s == pytest.approx(lost)
    assert result.useful_chip_s == pytest.approx(CHIPS * 0.9 * (HORIZON - 50) - lost)


def test_one_interruption_of_elastic_data_parallel_costs_two_stalls_and_a_missing_slice():
    method = elastic_dp(reform_s=20, rejoin_s=30, compute_fraction=0.9)
    result = simulate(method, FaultConfig(slice_chips=4, repair_s=500), CHIPS, HORIZON, trace=[Interruption(AT, 0)])
    # 16 chips until 1000; everyone stalls 20 s; 12 chips until the slice is back at 1500; everyone stalls 30 s
    expected = 0.9 * (16 * AT + 12 * (1_500 - 1_020) + 16 * (HORIZON - 1_530))
    assert result.lost_chip_s == 0
    assert result.useful_chip_s == pytest.approx(expected)


def test_one_interruption_of_a_decoupled_island_costs_that_island_and_one_bounded_stall_of_a_partner():
    method = MethodConfig("decoupled", groups=4, restart_s=200, save_interval_s=300, compute_fraction=0.9,
                          neighbours=1, neighbour_stall_s=10)
    result = simulate(method, FaultConfig(slice_chips=4), CHIPS, HORIZON, seed=3, trace=[Interruption(AT, 0)])
    lost = 4 * 0.9 * (AT % 300)
    expected = 0.9 * (CHIPS * HORIZON - 4 * 200 - 4 * 10) - lost
    assert result.lost_chip_s == pytest.approx(lost)
    assert result.useful_chip_s == pytest.approx(expected)


def test_a_freeze_keeps_its_progress():
    method = MethodConfig("decoupled", groups=2, restart_s=999, save_interval_s=300)
    result = simulate(method, NEVER, 2, HORIZON, trace=[Interruption(AT, 1, down_s=50, loses_work=False)])
    assert result.lost_chip_s == 0 and result.useful_chip_s == pytest.approx(2 * HORIZON - 50)


def test_same_seed_same_result_other_seed_another():
    faults = FaultConfig(mtbi_chip_s=1e6, slice_chips=2, repair_s=300)
    method = MethodConfig("decoupled", groups=10, restart_s=120, save_interval_s=60, neighbours=2, neighbour_stall_s=5)
    first, again, other = (simulate(method, faults, 100, 200_000, seed=s) for s in (7, 7, 8))
    assert first == again
    assert first.interruptions > 10 and (other.interruptions, other.goodput) != (first.interruptions, first.goodput)


def test_poisson_interruptions_of_computing_chips_match_the_renewal_formula():
    # restart whole, nothing lost: each interruption costs R, arrivals at rate chips/MTBI while computing,
    # so goodput = 1 / (1 + rate R) for one group, and the same per island for independent islands
    faults = FaultConfig(mtbi_chip_s=100_000.0)
    for groups in (1, 8):
        method = MethodConfig("x", groups=groups, restart_s=100, save_interval_s=1e-9)
        result = simulate(method, faults, 64, 2_000_000, seed=groups)
        rate = 64 / groups / faults.mtbi_chip_s
        assert result.goodput == pytest.approx(1 / (1 + rate * 100), abs=0.01)
        assert result.interruptions > 1_000


def test_bad_configs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="compute_fraction"):
        MethodConfig("x", compute_fraction=0)
    with pytest.raises(ValueError, match="neighbours"):
        MethodConfig("x", groups=2, neighbours=2)
    with pytest.raises(ValueError, match="slices"):
        simulate(MethodConfig("x", groups=3), FaultConfig(slice_chips=2), 8, 100)


def test_bandwidth_arithmetic_by_hand():
    config = BandwidthConfig(params=1e9, islands=4, tokens_per_s=1e5, tokens_per_step=2e5, inner_steps=100,
                             outer_bits=4, dp_bits=16, fragments=4, overlap_steps=5)
    result = island_bandwidth(config)
    assert result.step_s == 2.0
    # data parallel: each of 4 islands sends 2 x 3/4 x 1e9 x 16 bits per 2 s step
    assert result.dp_bits_per_step == pytest.approx(2.4e10)
    assert result.dp_sustained_bits_per_s == pytest.approx(1.2e10) == result.dp_required_bits_per_s
    # DiLoCo: one quarter of the params, 4 bits, x 1.5, every 100/4 = 25 steps (50 s), allowed 5 steps (10 s)
    assert result.outer_bits_per_exchange == pytest.approx(1.5e9)
    assert result.diloco_sustained_bits_per_s == pytest.approx(3e7)
    assert result.diloco_required_bits_per_s == pytest.approx(1.5e8)
    assert (result.sustained_reduction, result.required_reduction) == (pytest.approx(400), pytest.approx(80))
    syncer = island_bandwidth(BandwidthConfig(**{**config.__dict__, "topology": "syncer", "overlap_steps": 50}))
    assert syncer.diloco_required_bits_per_s == pytest.approx(1e9 / 4 * 4 / 50) == syncer.diloco_sustained_bits_per_s
    assert allreduce_time_s(8e9, 4, 1e9, latency_s=0.05) == pytest.approx(1.5 * 8 + 0.1)


def test_report_bandwidth_case_is_16_bits_over_4_times_h():
    rows = report_bandwidth(ReportBandwidth())["rows"]
    baseline = next(r for r in rows if r["dp_bits"] == 16 and r["topology"] == "allreduce")
    assert baseline["reduction"] == pytest.approx(16 / 4 * 24)
    assert baseline["dp_gbit"] == pytest.approx(198)


# --- calibration: a recorded chaos run, written in the format the learner and the chaos harness write ---

BEGAN, DURATION = 1_000_000.0, 300.0
KILLS = {"peer1": 100.0, "peer2": 160.0}  # killed at (s after the start), back 10 s later, process up 20 s after that
STOP = ("peer3", 200.0)  # frozen 10 s, frozen time not counted as compute
PROCESS_START_S, DOWNLOAD_S = 20.0, 1.0


def _peer_records(name: str, rng: random.Random) -> list[dict]:
    records, compute, blocked = [], 0.0, 0.0

    def write(t: float, status: str) -> None:
        records.append(dict(peer_id=name, unix_time=BEGAN + t, status=status, outer_step=len(records), compute_s=compute,
                            blocked_s=blocked, interval_compute_s=0.0, longest_block_s=0.0, global_sha256="x", loss=2.0,
                            eval_loss=None, reason=""))

    t = 0.0
    write(t, "init")
    while True:
        wall = rng.uniform(13.0, 17.0)
        if name in KILLS and t < KILLS[name] <= t + wall:  # killed mid-round: this round's work is lost
            compute, blocked = 0.0, 0.0
            t = KILLS[name] + 10 + PROCESS_START_S
            write(t, "init")
            t += DOWNLOAD_S
            blocked += 0.5
            write(t, "caught_up")
            continue
        frozen = 10.0 if name == STOP[0] and t < STOP[1] <= t + wall else 0.0
        if t + wall + frozen > DURATION:
            return records
        t += wall + frozen
        compute += wall * rng.uniform(0.88, 0.92)
        write(t, "ok")


@pytest.fixture
def chaos_folder(tmp_path):
    rng = random.Random(5)
    metrics = {}
    for name in ("peer0", "peer1", "peer2", "peer3"):
        path = tmp_path / "chaotic" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in _peer_records(name, rng)))
        metrics[name] = str(path)
    faults = [dict(peer=p, kind="kill", at=BEGAN + at, back_at=BEGAN + at + 10, had_checkpoint=True) for p, at in KILLS.items()]
    faults.append(dict(peer=STOP[0], kind="stop", at=BEGAN + STOP[1], back_at=BEGAN + STOP[1] + 10, had_checkpoint=False))
    run = dict(began=BEGAN, ended=BEGAN + DURATION, faults=faults, exit_codes={}, metrics=metrics,
               checkpoints={name: str(tmp_path / "ckpt" / name) for name in metrics}, lives={})
    (tmp_path / "chaos.json").write_text(json.dumps(dict(chaotic_run=run)))
    return tmp_path, run


def test_calibration_reads_the_recorded_overheads(chaos_folder):
    folder, _ = chaos_folder
    calibration = calibrate(folder)
    assert calibration.peers == ("peer0", "peer1", "peer2", "peer3")
    assert calibration.compute_fraction == pytest.approx(0.90, abs=0.01)
    assert calibration.round_s == pytest.approx(15.0, abs=1.0)
    assert calibration.process_start_s == pytest.approx(PROCESS_START_S)
    assert calibration.rejoin_s == pytest.approx(DOWNLOAD_S) and calibration.state_download_s == pytest.approx(0.5)
    kills = [f.down_s for f in calibration.faults if f.kind == "kill"]
    assert kills == pytest.approx([10 + PROCESS_START_S + DOWNLOAD_S] * 2)


def test_calibration_reproduces_the_goodput_the_chaos_harness_measured(chaos_folder):
    from experiments.chaos import analyse  # the harness's own figure, computed independently of the simulator

    folder, run = chaos_folder
    measured = analyse(run, averaging_timeout_s=60)["swarm_goodput"]
    calibration = calibrate(folder)
    simulated = replay(calibration).goodput
    assert calibration.measured_swarm_goodput == pytest.approx(measured, abs=1e-4)
    assert simulated == pytest.approx(calibration.window_goodput, abs=0.006)
    assert simulated == pytest.approx(measured, abs=0.03)
    assert measured < 0.85  # the faults cost something: a simulator that ignored them would miss by more


def test_calibration_of_a_plain_swarm_folder_and_of_nothing(tmp_path):
    rng = random.Random(1)
    for name in ("peer0", "peer4"):  # neither killed nor frozen: a calm swarm
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _peer_records(name, rng)))
    calibration = calibrate(tmp_path)
    assert calibration.faults == () and math.isclose(replay(calibration).goodput, calibration.window_goodput, abs_tol=0.01)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationError, match="no chaos.json"):
        calibrate(tmp_path / "empty")


def test_command_line_bad_input_is_one_line_and_status_2(tmp_path, capsys):
    assert main(["calibrate", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    assert main(["bandwidth", "--params", "1e9", "--islands", "1", "--tokens-per-s", "1", "--tokens-per-step", "1",
                 "--inner-steps", "10", "--out", str(tmp_path)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(line.startswith("simulate.py: error: ") for line in errors)
    assert "Traceback" not in "".join(errors)


def test_command_line_bandwidth_prints_and_writes(tmp_path, capsys):
    code = main(["bandwidth", "--params", "1e9", "--islands", "4", "--tokens-per-s", "1e5", "--tokens-per-step", "2e5",
                 "--inner-steps", "100", "--fragments", "4", "--overlap-steps", "5", "--out", str(tmp_path)])
    assert code == 0
    assert "| data parallel / DiLoCo | 400x | 80x |" in capsys.readouterr().out
    assert json.loads((tmp_path / "bandwidth.json").read_text())["result"]["required_reduction"] == pytest.approx(80)
