"""report.check_invariant_1 flags a fork (two global_sha256 for one outer step) and passes consistent records."""

from __future__ import annotations

import json

from p2p_diloco.observe.report import build_report, check_invariant_1, invariant_1_status, read_metrics

H0, H1, H1_FORK, H2 = "0" * 64, "1" * 64, "f" * 64, "2" * 64


def _record(step: int, digest: str, status: str = "ok") -> dict:
    return dict(outer_step=step, global_sha256=digest, status=status, group_size=2, bytes_sent=10, bytes_received=10)


def test_consistent_records_hold():
    result = check_invariant_1(
        {
            "a": [_record(0, H0, "init"), _record(1, H1), _record(2, H2)],
            "b": [_record(0, H0, "init"), _record(1, H1)],
            "c": [_record(2, H2)],  # joined late, caught up
        }
    )
    assert result["held"] is True
    assert result["forks"] == {}
    assert result["outer_steps_checked"] == 3
    assert result["outer_steps_reported_by_several_peers"] == 3


def test_a_fork_is_detected_and_named():
    result = check_invariant_1(
        {
            "a": [_record(0, H0, "init"), _record(1, H1), _record(2, H2)],
            "b": [_record(0, H0, "init"), _record(1, H1_FORK)],
        }
    )
    assert result["held"] is False
    assert result["forks"] == {"1": sorted([H1, H1_FORK])}


def test_a_fork_within_one_peer_is_detected():
    result = check_invariant_1({"a": [_record(3, H1), _record(3, H1_FORK)]})
    assert result["held"] is False and list(result["forks"]) == ["3"]


def test_a_fork_healed_by_an_explicit_record_holds_and_is_counted():
    result = check_invariant_1(
        {
            "a": [_record(1, H1), _record(2, H2)],
            "b": [_record(1, H1_FORK), _record(1, H1, "fork_healed"), _record(2, H2)],
        }
    )
    assert result["held"] is True and result["healed_forks"] == [1]


def test_bytes_a_peer_left_by_downloading_a_later_state_are_a_healed_fork():
    """Two groups averaged step 1 apart; one peer of the smaller went stale and took the swarm's step 2: it did not
    carry its step-1 bytes on. A peer that averages on from other bytes does."""
    left = check_invariant_1({"a": [_record(1, H1), _record(2, H2)],
                              "b": [_record(1, H1_FORK), _record(1, H1_FORK, "stale"), _record(2, H2, "caught_up")]})
    assert left["held"] is True and left["healed_forks"] == [1]
    carried = check_invariant_1({"a": [_record(1, H1), _record(2, H2)], "b": [_record(1, H1_FORK), _record(2, "e" * 64)]})
    assert carried["held"] is False and set(carried["forks"]) == {"1", "2"}


def test_failed_rounds_repeating_a_step_with_the_same_hash_are_fine():
    records = [_record(0, H0, "init"), _record(0, H0, "no_group"), _record(0, H0, "partial"), _record(1, H1)]
    result = check_invariant_1({"a": records})
    assert result["held"] is True and result["outer_steps_checked"] == 2


def test_a_step_reported_by_one_peer_only_is_not_checked_and_never_called_held():
    result = check_invariant_1({"a": [_record(0, H0, "init"), _record(1, H1)], "b": [_record(2, H2)]})
    assert result["status"] == "not checked" and result["outer_steps_reported_by_several_peers"] == 0
    assert invariant_1_status(dict(invariant_1=result)).startswith("not checked")
    both = check_invariant_1({"a": [_record(1, H1)], "b": [_record(1, H1)]})
    assert both["status"] == "held" and invariant_1_status(dict(invariant_1=both)).startswith("held over 1 outer step")


def test_records_without_a_hash_are_ignored():
    result = check_invariant_1(
        {"a": [{"outer_step": 1}, _record(1, H1)], "b": [{"outer_step": 1, "global_sha256": ""}]}
    )
    assert result["held"] is True and result["outer_steps_checked"] == 1


def test_build_report_reads_metrics_files_with_a_torn_last_line(tmp_path):
    paths = {}
    for name, digest in (("a", H1), ("b", H1_FORK)):
        path = tmp_path / f"{name}.jsonl"
        lines = [json.dumps(_record(0, H0, "init")), json.dumps(_record(1, digest)), '{"outer_step": 2, "glo']
        path.write_text("\n".join(lines), encoding="utf-8")
        paths[name] = path
    assert len(read_metrics(paths["a"])) == 2
    report = build_report(paths)
    assert report["invariant_1"]["held"] is False
    assert report["invariant_1"]["forks"] == {"1": sorted([H1, H1_FORK])}


def test_a_peer_s_summary_says_how_late_its_outer_steps_landed_as_the_median_share_of_a_round(tmp_path):
    def ok(step: int, during: int, steps: int) -> dict:
        return dict(_record(step, H1), steps_during_averaging=during, inner_steps=steps)

    path = tmp_path / "a.jsonl"
    records = [_record(0, H0, "init"), ok(1, 2, 50), ok(2, 25, 50), dict(ok(3, 50, 50), status="stale"), ok(4, 5, 50)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    assert build_report({"a": path})["peers"]["a"]["outer_step_lag"] == 0.1  # 4%, 50%, 10%; the failed round not
    path.write_text(json.dumps(_record(1, H1)) + "\n", encoding="utf-8")  # records written before the field
    assert build_report({"a": path})["peers"]["a"]["outer_step_lag"] is None
