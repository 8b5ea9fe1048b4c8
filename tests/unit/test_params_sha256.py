"""params_sha256 is equal for byte-identical tensors and changes with a one-ulp change or a reordering."""

from __future__ import annotations

import torch

from p2p_diloco.core.outer import params_sha256


def _tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 6, generator=generator), torch.randn(9, generator=generator)]


def test_equal_tensors_give_equal_hashes():
    first, second = _tensors(), [t.clone() for t in _tensors()]
    digest = params_sha256(first)
    assert digest == params_sha256(second)
    assert len(digest) == 64 and int(digest, 16) >= 0


def test_one_ulp_change_changes_the_hash():
    tensors = _tensors()
    before = params_sha256(tensors)
    changed = [t.clone() for t in tensors]
    changed[1][3] = torch.nextafter(changed[1][3], torch.tensor(float("inf")))
    assert not torch.equal(changed[1], tensors[1])
    torch.testing.assert_close(changed[1], tensors[1])  # numerically indistinguishable, yet...
    assert params_sha256(changed) != before


def test_order_matters_and_layout_does_not():
    a, b = _tensors()
    assert params_sha256([a, b]) != params_sha256([b, a])
    transposed_copy = a.t().contiguous().t()  # same values, non-contiguous strides
    assert not transposed_copy.is_contiguous()
    assert params_sha256([transposed_copy, b]) == params_sha256([a, b])
