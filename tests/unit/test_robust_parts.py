"""What a reducer accepts from its senders and a sender from its reducer (robust.py), and the reducer built on it."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hivemind.dht.validation import DHTRecord

from p2p_diloco.core.bans import TokenLedger, demote_reducers
from p2p_diloco.core.robust import (
    RobustPolicy,
    clamp_weights,
    part_problem,
    result_excess,
    result_problem,
    robust_average,
)
from p2p_diloco.swarm.guarded import RobustPartReducer
from p2p_diloco.swarm.membership import MemberRecordValidator, load_swarm_key

POLICY = RobustPolicy()
SHAPE = torch.Size([512])


def _parts(count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=generator) for _ in range(count)]


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        (torch.zeros(512), None),
        (torch.zeros(511), "shape"),
        (torch.zeros(2, 256), "shape"),
        (torch.zeros(512, dtype=torch.float64), "dtype"),
        (torch.zeros(512, dtype=torch.int32), "dtype"),
        (torch.tensor([0.0] * 511 + [math.nan]), "non-finite"),
        (torch.tensor([0.0] * 511 + [math.inf]), "non-finite"),
        ("not a tensor", "not a tensor"),
    ],
)
def test_part_problem_names_the_defect(part, expected):
    problem = part_problem(part, SHAPE)
    assert (problem is None) if expected is None else (expected in problem)


def _norm_clipped(parts: list[torch.Tensor], weights: list[float], ratio: float = POLICY.norm_clip_ratio) -> list[torch.Tensor]:
    """The norm clip written out: each part cut to ``ratio`` times the larger of the lower median norm per token
    (times its weight) and the lower median norm."""
    norms = [float(p.norm()) for p in parts]
    middle = (len(parts) - 1) // 2
    per_token = sorted(n / w for n, w in zip(norms, weights))[middle]
    limits = [ratio * max(per_token * w, sorted(norms)[middle]) for w in weights]
    return [p * min(1.0, limit / n) for p, n, limit in zip(parts, norms, limits)]


def _clipped_mean(parts: list[torch.Tensor], weights: list[float], clip_ratio: float) -> torch.Tensor:
    """Centered clipping written out for three or more senders: each part norm-clipped, then around the
    coordinate-wise median, each deviation cut to ``clip_ratio`` times the median deviation, then their weighted mean."""
    parts = _norm_clipped(parts, weights)
    ordered = torch.stack(parts).sort(dim=0).values
    count = len(parts)
    centre = (ordered[(count - 1) // 2] + ordered[count // 2]) / 2
    deviations = [p - centre for p in parts]
    distances = sorted(float(d.norm()) for d in deviations)
    radius = clip_ratio * (distances[(count - 1) // 2] + distances[count // 2]) / 2
    cut = [d * min(1.0, radius / float(d.norm())) for d in deviations]
    return centre + sum(w * d for w, d in zip(weights, cut)) / sum(weights)


def test_honest_parts_give_the_clipped_weighted_mean_and_no_notes():
    parts, weights = _parts(3), [1000.0, 2000.0, 3000.0]
    result, notes, left_out = robust_average(parts, weights, [None] * 3, SHAPE, POLICY)
    # the radius is the median deviation: the farthest of three alike honest parts is cut a little, nobody by half
    torch.testing.assert_close(result, _clipped_mean(parts, weights, POLICY.clip_ratio))
    assert notes == {} and left_out == frozenset()
    plain = sum(w * p for w, p in zip(weights, parts)) / sum(weights)
    assert float((result - plain).norm()) < 0.1 * float(plain.norm())
    # with a radius of twice the median deviation, three alike honest parts are not cut at all: the plain mean
    wide, _, _ = robust_average(parts, weights, [None] * 3, SHAPE, RobustPolicy(clip_ratio=2.0))
    torch.testing.assert_close(wide, plain)
    again, _, _ = robust_average(parts, weights, [None] * 3, SHAPE, POLICY)
    assert torch.equal(result, again)  # deterministic: same bytes every time


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (lambda p: torch.full_like(p, math.nan), "non-finite"),
        (lambda p: p * 1e4, "median"),
        (lambda p: p[:100].clone(), "shape"),
        (lambda p: p.double(), "dtype"),
    ],
)
def test_a_bad_sender_is_left_out_of_the_average(bad, reason):
    parts = _parts(3)
    honest = robust_average(parts[:2], [1.0, 1.0], [None] * 2, SHAPE, POLICY)[0]
    result, notes, left_out = robust_average([parts[0], bad(parts[2]), parts[1]], [1.0, 1.0, 1.0], [None] * 3, SHAPE, POLICY)
    assert set(notes) == {1} and reason in notes[1] and left_out == {1}
    torch.testing.assert_close(result, honest)
    assert torch.isfinite(result).all()


def test_honest_parts_of_unequal_progress_are_all_kept():
    # a peer that caught up a moment ago sends a part 40x smaller than a fast peer's, with 40x less weight:
    # per token they are alike, and neither is rejected (raw norms would have rejected one of them)
    small, large = _parts(2)
    parts, weights = [small * 0.025, large], [100.0, 4000.0]
    result, notes, left_out = robust_average(parts, weights, [None, None], SHAPE, POLICY)
    assert notes == {} and left_out == frozenset()
    cut = _norm_clipped(parts, weights)  # the larger of two alike norms per token is cut to the smaller: a few %
    assert float((cut[1] - parts[1]).norm()) < 0.1 * float(parts[1].norm())
    torch.testing.assert_close(result, (100 * cut[0] + 4000 * cut[1]) / 4100)


def test_a_part_large_for_its_weight_is_rejected_even_in_a_pair():
    honest, scaled = _parts(2)
    result, notes, left_out = robust_average([honest, scaled * 1e4], [1000.0, 1000.0], [None, None], SHAPE, POLICY)
    assert set(notes) == {1} and "per token" in notes[1] and left_out == {1}
    torch.testing.assert_close(result, honest)


def test_norm_clipping_scales_a_part_large_for_its_weight_down_to_the_limit_and_keeps_it():
    policy = RobustPolicy(norm_clip_ratio=1.5, clip_ratio=100.0)  # a wide radius: the norm clip alone at work
    honest = _parts(3)
    for part in honest:
        part.div_(part.norm())  # equal norms per token: nobody is over 1.5x the median
    weights = [1000.0] * 4
    calm, notes, _ = robust_average(honest, weights[:3], [None] * 3, SHAPE, policy)
    assert notes == {}
    off = RobustPolicy(clip_ratio=100.0, norm_clip_ratio=math.inf)
    plain, _, _ = robust_average(honest, weights[:3], [None] * 3, SHAPE, off)
    torch.testing.assert_close(calm, plain)
    scaled = honest[0] * 90
    result, notes, left_out = robust_average([*honest, scaled], weights, [None] * 4, SHAPE, policy)
    assert set(notes) == {3} and "cut to" in notes[3] and left_out == frozenset()  # cut, still counted
    # the scaled part counts as honest[0] at 1.5 times its norm (the median norm per token is 1 / 1000)
    expected, _, _ = robust_average([*honest, honest[0] * 1.5], weights, [None] * 4, SHAPE, policy)
    torch.testing.assert_close(result, expected)
    unclipped, _, _ = robust_average([*honest, scaled], weights, [None] * 4, SHAPE, off)
    assert float((result - calm).norm()) < 0.05 * float((unclipped - calm).norm())
    # honest parts of unequal tokens are not cut: fewer tokens give a larger norm per token but not a larger norm
    # (an outer gradient's norm grows slower than its tokens), more tokens a larger norm but not per token
    unequal = [honest[0] * 0.6, honest[1], honest[2] * 2.0]
    uneven_weights = [300.0, 1000.0, 4000.0]
    kept, notes, _ = robust_average(unequal, uneven_weights, [None] * 3, SHAPE, policy)
    assert notes == {}
    torch.testing.assert_close(kept, robust_average(unequal, uneven_weights, [None] * 3, SHAPE, off)[0])


def test_declared_weights_are_clamped_to_published_progress_and_to_the_median():
    weights, notes = clamp_weights([1000.0, 1e9, 1200.0], [1000.0, 1100.0, None], POLICY)
    assert weights == [1000.0, POLICY.weight_margin * 1100.0, 1200.0] and set(notes) == {1}
    weights, notes = clamp_weights([1000.0, 1e9, 1200.0, 900.0], [None] * 4, POLICY)  # nothing published: median cap
    assert weights[1] == POLICY.max_weight_ratio * 1000.0 and set(notes) == {1}
    weights, notes = clamp_weights([1000.0, 1e9], [0.0, 0.0], POLICY)  # records lag: never below the median
    assert weights == [1000.0, 1000.0] and set(notes) == {1}
    weights, notes = clamp_weights([math.nan, -1.0, math.inf, 5.0], [None] * 4, POLICY)
    assert all(math.isnan(w) for w in weights[:3]) and weights[3] == 5.0 and set(notes) == {0, 1, 2}


def test_an_inflated_weight_cannot_take_over_the_average():
    parts = _parts(3)
    result, notes, left_out = robust_average(parts, [1000.0, 1e9, 1000.0], [1000.0, 1000.0, 1000.0], SHAPE, POLICY)
    torch.testing.assert_close(result, _clipped_mean(parts, [1000.0, POLICY.weight_margin * 1000.0, 1000.0], POLICY.clip_ratio))
    assert "clamped" in notes[1] and left_out == frozenset()  # clamped, but it still counts


def test_no_acceptable_sender_averages_to_zeros():
    nan = torch.full(SHAPE, math.nan)
    result, notes, left_out = robust_average([nan, nan], [1.0, 1.0], [None, None], SHAPE, POLICY)
    assert torch.equal(result, torch.zeros(SHAPE)) and set(notes) == {0, 1} and left_out == {0, 1}


def test_a_result_far_from_what_we_sent_is_refused():
    sent = _parts(1)[0]
    assert result_problem(sent * 0.5, sent, POLICY) is None
    assert "norm" in result_problem(sent * 1e4, sent, POLICY)
    assert "non-finite" in result_problem(torch.full_like(sent, math.nan), sent, POLICY)
    assert "shape" in result_problem(sent[:10], sent, POLICY)


def test_a_peer_that_trained_few_tokens_allows_a_larger_average_up_to_a_cap():
    sent = _parts(1)[0]  # a peer that caught up a moment ago: honest averages were up to 190x its part's norm
    assert "norm" in result_problem(sent * 190, sent, POLICY)
    assert result_problem(sent * 190, sent, POLICY, weight_ratio=40.0) is None  # the others trained 40x more tokens
    assert result_problem(sent * 0.5, sent, POLICY, weight_ratio=0.1) is None  # a ratio below 1 counts as 1
    assert "norm" in result_problem(sent * 200, sent, POLICY, weight_ratio=0.1)
    # the cap: however large the weights claimed, a garbage average (1e4x) is still refused
    assert "norm" in result_problem(sent * 1e4, sent, POLICY, weight_ratio=1e6)


def test_how_far_over_the_limit_an_average_is():
    sent = _parts(1)[0]
    assert result_excess(sent * 190, sent, POLICY) == pytest.approx(1.9, rel=1e-5)  # an honest one seen once: 1 strike
    assert result_excess(sent * 1e4, sent, POLICY) == pytest.approx(100, rel=1e-5)  # over result_ban_excess: banned
    assert result_excess(sent * 1e4, sent, POLICY, weight_ratio=1e6) == pytest.approx(1e4 / 3000, rel=1e-5)
    assert result_excess(sent, torch.zeros_like(sent), POLICY) == 0.0


def test_robust_reducer_keeps_hivemind_part_order_and_reports_rejections():
    parts = [_parts(3, seed=k) for k in range(2)]  # two parts, three senders
    reports: list[tuple[int, str, bool]] = []

    async def run() -> list[torch.Tensor]:
        reducer = RobustPartReducer([SHAPE, SHAPE], 3, POLICY, [None, None, None], lambda s, r, out: reports.append((s, r, out)))
        sender_parts = [[parts[k][s] for k in range(2)] for s in range(3)]
        sender_parts[2][1] = sender_parts[2][1] * 1e4  # sender 2 misbehaves on part 1 only

        async def send(sender: int) -> list[torch.Tensor]:
            return [await reducer.accumulate_part(sender, k, sender_parts[sender][k], weight=1.0) for k in range(2)]

        results = await asyncio.gather(*(send(s) for s in (2, 0, 1)))  # arrival order must not matter
        assert all(torch.equal(r[k], results[0][k]) for r in results for k in range(2))
        return results[0]

    averaged = asyncio.run(run())
    torch.testing.assert_close(averaged[0], _clipped_mean(parts[0], [1.0, 1.0, 1.0], POLICY.clip_ratio))
    kept = _norm_clipped([parts[1][0], parts[1][1]], [1.0, 1.0])
    torch.testing.assert_close(averaged[1], (kept[0] + kept[1]) / 2)
    assert [(s, out) for s, _, out in reports] == [(2, True)] and "median" in reports[0][1]


def test_token_ledger_keeps_the_most_each_peer_published_per_round():
    ledger = TokenLedger()
    for peer, round_index, tokens in [("a", 3, 100), ("a", 3, 400), ("a", 4, 50), ("b", 2, 900), ("a", "x", 5)]:
        ledger.observe(peer, round_index, tokens)
    assert ledger.allowed(3) == {"a": 400.0}
    assert ledger.allowed(4, rounds=2) == {"a": 450.0}
    assert ledger.allowed(3, rounds=2) == {"a": 400.0, "b": 900.0}


def test_member_records_are_tagged_and_anything_else_is_refused(tmp_path):
    key_file = tmp_path / "swarm.key"
    key_file.write_text("a secret of more than sixteen bytes\n")
    validator = MemberRecordValidator(load_swarm_key(key_file))
    record = DHTRecord(b"key", b"subkey", b"value", 1234.5)
    signed = DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)
    assert validator.validate(signed) and validator.strip_value(signed) == b"value"
    assert not validator.validate(record)  # untagged: a non-member's record
    for field, value in [("value", b"other" + signed.value[5:]), ("subkey", b"other"), ("expiration_time", 1e9)]:
        forged = DHTRecord(**{**signed.__dict__, field: value})
        assert not validator.validate(forged), field
    other = tmp_path / "other.key"
    other.write_text("another secret, also long enough")
    assert not MemberRecordValidator(load_swarm_key(other)).validate(signed)
    short = tmp_path / "short.key"
    short.write_text("short")
    with pytest.raises(ValueError, match="at least 16"):
        load_swarm_key(short)
    with pytest.raises(ValueError, match="cannot read"):
        load_swarm_key(tmp_path / "missing.key")


def test_a_peer_banned_by_a_groupmate_reduces_nothing_and_the_others_share_its_part():
    peers = ["a", "b", "g"]
    fractions, demoted = demote_reducers(peers, (0.25, 0.25, 0.5), [["g"], None, []])
    assert fractions == (0.5, 0.5, 0.0) and demoted == {"g": "a"}
    assert demote_reducers(peers, (0.25, 0.25, 0.5), [None, [], "g"]) == ((0.25, 0.25, 0.5), {})  # not a list: none


def test_demotion_ignores_self_bans_strangers_and_bans_that_would_leave_no_reducer():
    peers = ["a", "b", "g"]
    assert demote_reducers(peers, (0.5, 0.5, 0.0), [["a"], ["x", 3], ["g"]]) == ((0.5, 0.5, 0.0), {})
    # a member naming most of its group is not believed: the banned one naming the others back changes nothing
    fractions, demoted = demote_reducers(peers, (0.25, 0.25, 0.5), [["g"], [], ["a", "b"]])
    assert fractions == (0.5, 0.5, 0.0) and demoted == {"g": "a"}
    # bans that would leave no reducer: nobody is demoted
    assert demote_reducers(["a", "g"], (0.5, 0.5), [["g"], ["a"]]) == ((0.5, 0.5), {})
    # a client (share 0) named by someone is not reported as demoted
    assert demote_reducers(peers, (0.5, 0.5, 0.0), [["g"], [], []]) == ((0.5, 0.5, 0.0), {})
    fractions, demoted = demote_reducers(peers, (0.2, 0.3, 0.5), [["b"], [], ["a"]])
    assert fractions == (0.0, 0.0, 1.0) and demoted == {"a": "g", "b": "a"}
