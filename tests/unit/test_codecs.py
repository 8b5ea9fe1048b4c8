"""Outer-gradient codecs: round-trip error bounds, wire size, determinism and payload validation."""

from __future__ import annotations

import struct

import pytest
import torch

from p2p_diloco.core.compression import make_codec

BLOCK = 256  # the int8 codec's default block size


def _gaussian(numel: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale


def _relative_l2(decoded: torch.Tensor, original: torch.Tensor) -> float:
    return ((decoded - original).norm() / original.norm()).item()


def test_none_is_exact_and_four_bytes_per_value():
    codec = make_codec("none")
    values = _gaussian(1000)
    payload = codec.encode(values)
    assert len(payload) == 4 * 1000
    decoded = codec.decode(payload, 1000)
    torch.testing.assert_close(decoded, values, rtol=0, atol=0)
    assert decoded.dtype == torch.float32


def test_fp16_relative_error_below_1e_3_and_two_bytes_per_value():
    codec = make_codec("fp16")
    values = _gaussian(5000, scale=0.01)
    payload = codec.encode(values)
    assert len(payload) == 2 * 5000
    decoded = codec.decode(payload, 5000)
    assert decoded.dtype == torch.float32
    assert _relative_l2(decoded, values) < 1e-3
    torch.testing.assert_close(decoded, values, rtol=1e-3, atol=1e-7)


def test_fp16_saturates_instead_of_overflowing_to_inf():
    codec = make_codec("fp16")
    decoded = codec.decode(codec.encode(torch.tensor([1e6, -1e6, 1.0])), 3)
    torch.testing.assert_close(decoded, torch.tensor([65504.0, -65504.0, 1.0]))


@pytest.mark.parametrize("numel", [64 * BLOCK, 1000, BLOCK + 1])
def test_int8_blockwise_error_bounds(numel: int):
    """Relative L2 error < 2%, and every value within 1% of its block's absmax."""
    codec = make_codec("int8")
    values = _gaussian(numel, seed=numel, scale=3.0)
    decoded = codec.decode(codec.encode(values), numel)
    assert decoded.shape == (numel,) and decoded.dtype == torch.float32
    assert _relative_l2(decoded, values) < 0.02

    blocks = -(-numel // BLOCK)
    padded_values, padded_errors = torch.zeros(blocks * BLOCK), torch.zeros(blocks * BLOCK)
    padded_values[:numel], padded_errors[:numel] = values, (decoded - values).abs()
    absmax = padded_values.view(blocks, BLOCK).abs().amax(dim=1)
    worst = padded_errors.view(blocks, BLOCK).amax(dim=1)
    assert bool((worst <= 0.01 * absmax).all()), f"worst error / absmax = {(worst / absmax).max().item():.4f}"


def test_int8_is_about_a_quarter_of_fp32():
    codec = make_codec("int8")
    for numel in (64 * BLOCK, 10_000, 100_003):
        size = len(codec.encode(_gaussian(numel)))
        assert 0.25 <= size / (4 * numel) <= 0.27, (numel, size)
    assert codec.bytes_per_value() == pytest.approx(1 + 4 / BLOCK)


@pytest.mark.parametrize("name", ["none", "fp16", "int8", "int2"])
def test_encoding_is_deterministic(name: str):
    codec = make_codec(name)
    values = _gaussian(3 * BLOCK + 17, seed=5)
    first = codec.encode(values)
    assert first == codec.encode(values.clone())
    assert first == make_codec(name).encode(values)
    # decoding is deterministic too: same bytes, same tensor
    torch.testing.assert_close(codec.decode(first, values.numel()), codec.decode(first, values.numel()), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["none", "fp16", "int8", "int2"])
def test_decode_rejects_wrong_length_payload(name: str):
    codec = make_codec(name)
    payload = codec.encode(_gaussian(600))
    for bad in (payload[:-1], payload + b"\0", b"x"):
        with pytest.raises(ValueError, match=name):
            codec.decode(bad, 600)
    with pytest.raises(ValueError):
        codec.decode(payload, 601)


@pytest.mark.parametrize("name", ["none", "fp16", "int8", "int2"])
def test_empty_tensor_round_trips(name: str):
    codec = make_codec(name)
    payload = codec.encode(torch.zeros(0))
    assert payload == b""
    decoded = codec.decode(payload, 0)
    assert decoded.numel() == 0 and decoded.dtype == torch.float32


@pytest.mark.parametrize("name", ["none", "fp16", "int8"])
@pytest.mark.parametrize("numel", [1, BLOCK - 1, BLOCK + 1, 5 * BLOCK + 3])
def test_lengths_that_are_not_a_multiple_of_the_block_size(name: str, numel: int):
    codec = make_codec(name)
    values = _gaussian(numel, seed=numel)
    decoded = codec.decode(codec.encode(values), numel)
    assert decoded.shape == (numel,)
    torch.testing.assert_close(decoded, values, rtol=0.02, atol=0.01 * values.abs().max().item())


def test_int8_zeros_decode_to_zeros():
    codec = make_codec("int8")
    decoded = codec.decode(codec.encode(torch.zeros(300)), 300)
    torch.testing.assert_close(decoded, torch.zeros(300), rtol=0, atol=0)


def test_unknown_codec_name_raises():
    with pytest.raises(ValueError, match="unknown compression 'zstd'"):
        make_codec("zstd")


def test_topk_keeps_the_largest_values_of_each_block_at_two_bits():
    codec = make_codec("topk")
    values = _gaussian(3 * 64 + 10, seed=3)
    payload = codec.encode(values)
    blocks = 4
    assert len(payload) == (4 + codec.keep) * blocks and codec.bytes_per_value() == pytest.approx(6 / 64)
    decoded = codec.decode(payload, values.numel())
    assert decoded.shape == values.shape and decoded.dtype == torch.float32
    padded = torch.zeros(blocks * 64)
    padded[: values.numel()] = values
    for block, (original, sent) in enumerate(zip(padded.view(blocks, 64), torch.nn.functional.pad(decoded, (0, 54)).view(blocks, 64))):
        kept = sent.nonzero().view(-1)
        assert set(kept.tolist()) == set(original.abs().topk(2).indices.tolist()), block
        absmax = original.abs().max()
        assert torch.equal(torch.sign(sent[kept]), torch.sign(original[kept]))
        assert set(sent[kept].abs().tolist()) <= {absmax.item(), absmax.item() / 2}
        assert sent.abs().max() == absmax  # the largest value is sent exactly
    assert codec.encode(values) == payload and codec.decode(payload, values.numel()).equal(decoded)  # deterministic
    for bad in (payload[:-1], payload + b"\0"):
        with pytest.raises(ValueError, match="topk"):
            codec.decode(bad, values.numel())
    assert codec.encode(torch.zeros(0)) == b"" and codec.decode(b"", 0).numel() == 0
    assert codec.decode(codec.encode(torch.zeros(100)), 100).equal(torch.zeros(100))


@pytest.mark.parametrize("numel", [1, 63, 64, 65, 3 * 64 + 10])
def test_int2_sends_each_value_at_one_of_two_magnitudes_of_its_block_with_the_least_squares_scale(numel: int):
    codec = make_codec("int2")
    values = _gaussian(numel, seed=numel) * torch.linspace(0.1, 10.0, numel)  # blocks of unlike scales
    payload = codec.encode(values)
    blocks = -(-numel // 64)
    assert len(payload) == 4 * blocks + -(-numel // 4) and codec.bytes_per_value() == pytest.approx(0.3125)
    decoded = codec.decode(payload, numel)
    assert decoded.shape == values.shape and decoded.dtype == torch.float32
    for block in range(blocks):
        original, sent = values[64 * block : 64 * (block + 1)], decoded[64 * block : 64 * (block + 1)]
        rms = original.square().mean().sqrt()  # of the block's own values: the last block may be partial
        large = original.abs() >= rms * (1 + 1e-6)
        small = original.abs() < rms * (1 - 1e-6)  # (the codec sums in another order: the threshold's last bits)
        level = torch.where(large, 1.0, 1 / 3)
        scale = float((original.abs() * level).sum() / level.square().sum())  # least squares for these levels
        assert torch.equal(torch.sign(sent), torch.sign(original))
        torch.testing.assert_close(sent[large].abs(), torch.full((int(large.sum()),), scale), rtol=1e-5, atol=0)
        torch.testing.assert_close(sent[small].abs(), torch.full((int(small.sum()),), scale / 3), rtol=1e-5, atol=0)
    if numel >= 64:
        assert 0.25 < _relative_l2(decoded, values) < 0.5  # a third of the norm or more: error feedback is a must
    assert codec.encode(values) == payload  # deterministic
    assert codec.decode(codec.encode(torch.zeros(numel)), numel).equal(torch.zeros(numel))


@pytest.mark.parametrize("name", ["none", "fp16", "int4", "int2", "topk"])
def test_a_decoded_part_encodes_to_itself(name: str):
    """A peer's error feedback encodes its outer gradient, and the all-reduce encodes what came out once more for the
    wire: that second encode must send what the feedback counted as sent (to the last bits), or every hop loses
    what no feedback sees. (int8 is left out: it has no error feedback, so the wire encodes its values once; encoded
    twice, some would move by one of its 8-bit steps, ~0.5% of the norm.)"""
    codec = make_codec(name)
    values = _gaussian(10_000, seed=9) * torch.linspace(0.01, 3.0, 10_000)
    once = codec.decode(codec.encode(values), values.numel())
    twice = codec.decode(codec.encode(once), values.numel())
    assert _relative_l2(twice, once) < 1e-6, _relative_l2(twice, once)


def test_int2_never_decodes_a_finite_scale_to_inf():
    codec = make_codec("int2")
    largest = torch.finfo(torch.float32).max
    values = torch.tensor([largest, -largest, largest / 3, 1.0] * 16)
    assert bool(torch.isfinite(codec.decode(codec.encode(values), values.numel())).all())
    scale = struct.pack("<f", largest)  # any finite scale a stranger may send
    assert bool(torch.isfinite(codec.decode(scale + b"\xff" * 16, 64)).all())
    values[3] = torch.inf  # and a non-finite input is not made finite: it stays visible to the checks after decoding
    assert not bool(torch.isfinite(codec.decode(codec.encode(values), values.numel())[:64]).any())


@pytest.mark.parametrize("name", ["int4", "int2", "topk"])
def test_error_feedback_loses_nothing_over_rounds(name: str):
    """What a lossy codec drops is sent in later rounds: the sum of what was sent plus the residual equals the sum
    of the outer gradients, and the residual stays bounded, so the sum sent converges on the true sum. Without
    feedback the codec's loss adds up round after round."""
    from p2p_diloco.core.feedback import ErrorFeedback

    codec = make_codec(name)
    feedback, rounds = ErrorFeedback(codec), 120
    true_sum, sent_sum, plain_sum = torch.zeros(4096), torch.zeros(4096), torch.zeros(4096)
    drift = _gaussian(4096, seed=1, scale=0.05)  # a consistent direction, as consecutive outer gradients share
    for r in range(rounds):
        grad = drift + _gaussian(4096, seed=100 + r, scale=0.1)
        sent, residual = feedback.prepare([grad])
        feedback.commit(residual)
        true_sum += grad
        sent_sum += sent[0]
        plain_sum += codec.decode(codec.encode(grad), grad.numel())
    torch.testing.assert_close(sent_sum + feedback.residual[0], true_sum, rtol=0, atol=1e-4)
    with_feedback, without = _relative_l2(sent_sum, true_sum), _relative_l2(plain_sum, true_sum)
    assert with_feedback < 0.5 * without, (with_feedback, without)
    assert with_feedback < {"int4": 0.01, "int2": 0.02, "topk": 0.2}[name], with_feedback


def test_a_failed_round_keeps_the_previous_residual():
    from p2p_diloco.core.feedback import ErrorFeedback

    feedback = ErrorFeedback(make_codec("topk"))
    sent, residual = feedback.prepare([_gaussian(640, seed=7)])
    feedback.commit(residual)
    kept = feedback.residual[0].clone()
    feedback.prepare([_gaussian(640, seed=8)])  # a round that failed commits nothing
    assert torch.equal(feedback.residual[0], kept)


def test_the_reducers_feedback_is_used_only_in_the_next_round_of_the_same_fragment():
    from p2p_diloco.core.feedback import ReducerFeedback

    codec = make_codec("topk")
    mean = _gaussian(640, seed=9)
    plain = codec.encode(mean)
    feedback = ReducerFeedback(codec, stride=2)  # two fragments: outer step s carries fragment s % 2
    feedback.begin(4)
    assert feedback.encode(0, mean) == plain  # nothing kept yet: the plain encode
    feedback.commit()
    feedback.begin(5)  # the other fragment: part 0 there is other values
    assert feedback.encode(0, mean) == plain
    feedback.abandon()  # that round failed
    feedback.begin(6)  # fragment 0 again, the round after step 4: what step 4 dropped is added
    residual = mean - codec.decode(plain, 640)
    assert feedback.encode(0, mean) == codec.encode(mean + residual) != plain
    assert feedback.encode(1, mean) == plain  # a part we did not reduce at step 4
    feedback.abandon()
    feedback.begin(8)  # step 6 failed: step 4's residual is two rounds old and not used
    assert feedback.encode(0, mean) == plain
    feedback.commit()
    feedback.begin(10)
    assert feedback.encode(0, mean) == codec.encode(mean + residual)  # step 8's


def test_a_kernel_wrapped_while_bitsandbytes_imports_is_compiled_at_its_first_call_only():
    """compression._compile_at_first_call stands in for torch.compile while bitsandbytes is imported: both ways
    of decorating keep the function and its options, and nothing is compiled until it is called, then once."""
    from p2p_diloco.core.compression import _compile_at_first_call

    compiled = []

    def compile_now(fn, **options):
        compiled.append((fn.__name__, options))
        return lambda *args, **kwargs: ("compiled", fn(*args, **kwargs))

    compile_later = _compile_at_first_call(compile_now)

    @compile_later(dynamic=False)
    def double(x):
        return 2 * x

    def square(x):
        return x * x

    square_later = compile_later(square)
    assert compiled == [] and double.__name__ == "double" and square_later.__name__ == "square"
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert compiled == [("double", {"dynamic": False})]
    assert square_later(5) == ("compiled", 25) and compiled[-1] == ("square", {})
