"""The chaos harness's figures, computed from hand-made metrics files and a fault log."""

from __future__ import annotations

import json

import pytest

from experiments.chaos import analyse
from p2p_diloco.core import checkpoint


def _record(t, step, status="ok", compute=0.0, block=0.0, sha="a", eval_loss=None, reason="", loss=2.0):
    # one wait per interval: the longest wait is all the interval's blocked time
    return dict(unix_time=t, outer_step=step, status=status, compute_s=compute, longest_block_s=block,
                interval_blocked_s=block, global_sha256=f"{sha}{step}", eval_loss=eval_loss, reason=reason, loss=loss)


def _write(tmp_path, name, records):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    directory = tmp_path / "ckpt" / name
    checkpoint.save_atomic(directory, records[-1]["outer_step"], dict(outer_step=records[-1]["outer_step"]))
    return str(path), str(directory)


def test_goodput_leaves_out_the_victims_fault_window_and_times_its_return(tmp_path):
    survivor = [_record(0, 0, "init"), _record(10, 1, compute=9.0, block=0.5), _record(20, 2, compute=18.0, block=2.0),
                _record(30, 3, compute=27.0, eval_loss=2.5),
                # after the run's end, its last round waits for peers the harness is stopping: not counted
                _record(45, 3, "no_group", compute=27.5, block=15.0)]
    victim = [_record(0, 0, "init"), _record(10, 1, compute=9.5),
              # killed at 12, restarted at 17; resumed; first contribution at 24
              _record(18, 1, "init", compute=0.0, reason="resumed from ckpt/outer_step_00000001.pt"),
              _record(19, 2, "caught_up", compute=0.5, block=0.8), _record(24, 2, "ok", compute=5.0, block=9.0),
              _record(30, 3, compute=10.0, eval_loss=2.5)]
    metrics, checkpoints = {}, {}
    for name, records in (("a", survivor), ("b", victim)):
        metrics[name], checkpoints[name] = _write(tmp_path, name, records)
    run = dict(began=0.0, ended=30.0, faults=[dict(peer="b", kind="kill", at=12.0, back_at=17.0, had_checkpoint=True)],
               exit_codes={"a": 0, "b": 0}, metrics=metrics, checkpoints=checkpoints)

    result = analyse(run, averaging_timeout_s=30)

    # survivor: 27 s of compute in 30 s; victim: only 0->10 (9.5 s) and 24->30 (5 s) count, 16 s of wall
    assert result["survivors_goodput"] == pytest.approx((27.0 + 9.5 + 5.0) / (30.0 + 16.0), abs=1e-4)
    assert result["swarm_goodput"] == pytest.approx((27.0 + 9.5 + 10.0) / (2 * 30.0), abs=1e-4)
    assert result["longest_stall_s"] == {"a": 2.0, "b": 0.0}  # the victim's recovery waits are not a survivor's
    assert result["survivors_blocked_s"] == {"a": 2.5, "b": 0.0}  # nor in its blocked time; the survivor's add up
    (restart,) = result["restarts"]
    assert restart["to_first_contribution_s"] == 7.0 and restart["down_s"] == 5.0
    assert restart["resumed_from_checkpoint"] is True and result["lost_checkpoints"] == 0
    assert result["every_restart_contributed"] and result["invariant_1"]["held"]
    assert result["final_eval_loss"] == 2.5 and result["non_finite_values"] == 0


def test_a_restart_that_did_not_resume_its_checkpoint_and_a_nan_are_reported(tmp_path):
    survivor = [_record(0, 0, "init"), _record(10, 1, compute=9.0, loss=float("nan"))]
    victim = [_record(0, 0, "init"), _record(4, 0, "init"), _record(8, 1, compute=3.0)]
    metrics, checkpoints = {}, {}
    for name, records in (("a", survivor), ("b", victim)):
        metrics[name], checkpoints[name] = _write(tmp_path, name, records)
    run = dict(began=0.0, ended=10.0, faults=[dict(peer="b", kind="kill", at=1.0, back_at=3.0, had_checkpoint=True)],
               exit_codes={}, metrics=metrics, checkpoints=checkpoints)
    result = analyse(run, averaging_timeout_s=30)
    assert result["lost_checkpoints"] == 1
    assert result["non_finite_values"] == 1


def test_a_restart_cut_short_by_the_next_fault_is_reported_but_not_timed(tmp_path):
    survivor = [_record(0, 0, "init"), _record(40, 3, compute=38.0)]
    victim = [_record(0, 0, "init"), _record(8, 1, compute=7.0),
              _record(14, 1, "init", reason="resumed from x"),  # restarted at 13, killed again at 16
              _record(22, 1, "init", reason="resumed from x"), _record(30, 2, "ok", compute=6.0)]
    metrics, checkpoints = {}, {}
    for name, records in (("a", survivor), ("b", victim)):
        metrics[name], checkpoints[name] = _write(tmp_path, name, records)
    faults = [dict(peer="b", kind="kill", at=10.0, back_at=13.0, had_checkpoint=True),
              dict(peer="b", kind="kill", at=16.0, back_at=21.0, had_checkpoint=True)]
    run = dict(began=0.0, ended=40.0, faults=faults, exit_codes={}, metrics=metrics, checkpoints=checkpoints)
    result = analyse(run, averaging_timeout_s=30)
    first, second = result["restarts"]
    assert first["interrupted_by_next_fault"] and first["to_first_contribution_s"] is None
    assert not second["interrupted_by_next_fault"] and second["to_first_contribution_s"] == 9.0
    assert result["every_restart_contributed"] and result["longest_time_to_contribute_s"] == 9.0
