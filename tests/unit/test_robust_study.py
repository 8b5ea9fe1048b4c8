"""The in-process clipping study (robust_study.py): its aggregation is the reducers' rule, part by part, and bad
input is one line."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.robust_study import aggregate, main


def test_the_plain_mean_weighs_by_tokens():
    grads = [torch.full((6,), 1.0), torch.full((6,), 4.0)]
    assert torch.allclose(aggregate(grads, [1.0, 2.0], None), torch.full((6,), 3.0))


def test_clipping_cuts_a_scaled_sender_to_the_radius_and_leaves_an_honest_group_alone():
    torch.manual_seed(0)
    honest = [torch.randn(300) for _ in range(3)]
    weights = [1.0] * 4
    calm = aggregate(honest, weights[:3], 2.0, norm_clip=math.inf)
    plain = aggregate(honest, weights[:3], None)
    # three honest senders: the median deviation's double clips nobody here, so the result is the plain mean; the
    # norm clip (the peer's default) cuts the larger norms to the median one, a few percent
    assert torch.allclose(calm, plain, atol=1e-6)
    assert float((aggregate(honest, weights[:3], 2.0) - plain).norm()) < 0.1 * float(plain.norm())
    scaled = honest + [honest[0] * 90]
    for clip in (2.0, 1.0):
        moved = aggregate(scaled, weights, clip)
        # the scaled sender moves each part by at most its share of the radius around the coordinate-wise median
        assert float((moved - aggregate(honest + [honest[0]], weights, clip)).norm()) < float(honest[0].norm()) * clip
    off = math.inf  # the radius alone: the smaller one keeps the scaled sender closer
    assert float(aggregate(scaled, weights, 1.0, off).norm()) < float(aggregate(scaled, weights, 2.0, off).norm())
    # with the norm clip the scaled sender counts as an honest one: the result is the honest mean's size
    assert float(aggregate(scaled, weights, 1.0).norm()) < 1.2 * float(aggregate(honest + [honest[0]], weights, 1.0).norm())
    assert float(aggregate(scaled, weights, None).norm()) > 10 * float(plain.norm())  # no defence: it wins


@pytest.mark.parametrize("argv", [["--outer-steps", "2"], ["--clip-ratios", "0.5"], ["--workers", "0"]])
def test_bad_input_is_one_line(tmp_path, capsys, argv):
    assert main(["--out", str(tmp_path / "out"), *argv]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
