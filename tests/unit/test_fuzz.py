"""Fuzzing the three readers of untrusted input: the config loader, the checkpoint loader and the wire decoder.

Property, for whatever bytes or values hypothesis makes up: the reader either succeeds with something sane, or
raises its documented error with a one-line message (ValueError for config and checkpoints, whose message is
what peer.py prints; MalformedPayloadError for a received tensor). Anything else (a TypeError, an
AttributeError, a NaN that got through, a hang caught by pytest-timeout) fails the test. The runs are
derandomized, so CI sees the same examples every time, and sized to take well under a minute on two cores.
"""

from __future__ import annotations

import copy
import math
import struct
from pathlib import Path

import pytest
import torch
from google.protobuf.message import DecodeError
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from p2p_diloco.core import checkpoint
from p2p_diloco.core.compression import MalformedPayloadError, make_codec
from p2p_diloco.core.config import COMPRESSIONS, DataConfig, InnerConfig, PeerConfig, RunConfig
from p2p_diloco.core.config_load import build_config, load_toml
from p2p_diloco.core.link import LocalLink
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.swarm.wire import WireCodec, install_wire_codecs
from p2p_diloco.train.learner import Learner

from .helpers import TINY_MODEL, make_dataset

pytestmark = pytest.mark.timeout(120)


def fuzz(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        # no deadline: no test asserts on time (bitsandbytes compiles its CPU int4 decoder anew for each odd number
        # of values, seconds on a busy machine); a hang is caught by pytest-timeout (pyproject.toml)
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
    )


def assert_one_line(error: BaseException) -> None:
    message = str(error)
    assert message and "\n" not in message, f"not a one-line message: {message!r}"


# config ------------------------------------------------------------------------------------------------------

_DEFAULTS = PeerConfig().to_dict()
_FIELDS = {name: sorted(values) for name, values in _DEFAULTS.items()}
_EDGE_NUMBERS = [math.inf, -math.inf, math.nan, 0, -1, 0.5, 1e300, 2**63, 10**30, 2**53 + 1]
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from(_EDGE_NUMBERS),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=10),
    st.sampled_from(["int8", "none", "run-1", "/ip4/127.0.0.1/tcp/1", "", "\x00"]),
)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


def _mostly(common: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """``common`` seven times in eight, else ``rare``."""
    return st.integers(0, 7).flatmap(lambda i: rare if i == 0 else common)


_SECTION_NAMES = _mostly(st.sampled_from(sorted(_FIELDS)), st.text(max_size=6))


def _values_like(default: object) -> st.SearchStrategy:
    """Mostly edge values of the field's own type, so that they get past the type check to the range checks."""
    if isinstance(default, bool):
        typed = st.booleans()
    elif isinstance(default, int | float):
        typed = _mostly(st.sampled_from(_EDGE_NUMBERS), st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**64), 2**64)))
    elif isinstance(default, str) or default is None:
        typed = st.one_of(st.none(), st.text(max_size=10), st.sampled_from(["\x00", "int8", "/nonexistent"]), st.integers())
    else:
        typed = st.lists(st.one_of(st.text(max_size=10), st.integers()), max_size=3)
    return _mostly(typed, _VALUES)


@st.composite
def config_dicts(draw: st.DrawFn) -> dict:
    """Real sections and keys, mostly one of them set to an odd value; now and then an unknown section or key,
    or a section that is not a table."""
    result: dict = {}
    for _ in range(draw(_mostly(st.just(1), st.integers(2, 3)))):
        section = draw(_SECTION_NAMES)
        if section in _FIELDS:
            key = draw(_mostly(st.sampled_from(_FIELDS[section]), st.text(max_size=6)))
            value = draw(_values_like(_DEFAULTS[section].get(key)))
        else:
            key, value = draw(st.text(max_size=6)), draw(_VALUES)
        target = result.setdefault(section, {})
        if isinstance(target, dict):
            target[key] = value
    if draw(st.integers(0, 15)) == 0:
        result[draw(_SECTION_NAMES)] = draw(_SCALARS)
    return result


def assert_well_typed(config: PeerConfig) -> None:
    """Every accepted value has its field's type, and every number is finite."""
    for section, values in config.to_dict().items():
        for key, value in values.items():
            default, where = _DEFAULTS[section][key], f"{section}.{key} = {value!r}"
            if default is None:
                assert value is None or isinstance(value, str), where
            elif isinstance(default, tuple):
                assert isinstance(value, tuple) and all(isinstance(v, str) for v in value), where
            elif isinstance(default, float):
                # inf passes "> 0" checks, and then sleeps, times out or trains forever
                assert isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value), where
            else:
                assert type(value) is type(default), where


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan" if math.isnan(value) else repr(value))
    if isinstance(value, str):
        return '"' + value.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'
    return repr(value)


@st.composite
def toml_texts(draw: st.DrawFn) -> str:
    """TOML-shaped text: real and made-up tables and keys, odd values, and now and then random characters."""
    lines = []
    for section in draw(st.lists(_SECTION_NAMES, max_size=3)):
        lines.append(f"[{section}]")
        keys = st.sampled_from(_FIELDS[section]) if section in _FIELDS else st.text("abc_", min_size=1, max_size=5)
        for _ in range(draw(st.integers(0, 3))):
            scalar = draw(_SCALARS.filter(lambda v: v is not None))
            lines.append(f"{draw(keys)} = {_toml_value(scalar)}")
    if draw(st.booleans()):
        lines.insert(draw(st.integers(0, len(lines))), draw(st.text(max_size=20)))
    return "\n".join(lines)


@fuzz(300)
@given(overrides=config_dicts())
@example(overrides={"inner": {"lr": math.inf}})  # each of these once got through
@example(overrides={"run": {"seed": 2**63 - 1}})
@example(overrides={"data": {"corpus_dir": 5}})
@example(overrides={"swarm": {"initial_peers": [1, 2]}})
@example(overrides={"inner": 5})
def test_build_config_accepts_only_sane_values(overrides):
    try:
        config = build_config(overrides)
    except ValueError as e:
        assert_one_line(e)
        return
    assert_well_typed(config)
    assert build_config(config.to_dict()) == config  # what was accepted is accepted again as it is


@fuzz(150)
@given(text=st.one_of(toml_texts(), st.text(max_size=200)))
def test_config_file_loader_accepts_or_names_the_problem(tmp_path, text):
    path = tmp_path / "peer.toml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        build_config(load_toml(path))
    except ValueError as e:
        assert_one_line(e)


# checkpoints -------------------------------------------------------------------------------------------------


class Resumer:
    """A tiny learner and a real checkpoint of it; ``resume(bytes)`` puts the bytes in its checkpoint folder."""

    def __init__(self, corpus_dir: str, directory: Path):
        self.directory = directory
        config = PeerConfig(
            model=TINY_MODEL, data=DataConfig(corpus_dir=corpus_dir), inner=InnerConfig(inner_steps=1, batch_size=2),
            run=RunConfig(max_outer_steps=1, checkpoint_dir=str(directory), checkpoint_every=1, eval_batches=1),
        )
        first = Learner(config, make_dataset(config), NullSink())
        first.run(LocalLink("none"))
        self.path = checkpoint.newest(directory)
        self.good_bytes = self.path.read_bytes()
        self.good_state = checkpoint.load(self.path)
        self.learner = Learner(config, make_dataset(config), NullSink())

    def resume(self, data: bytes) -> None:
        """Resume from ``data``: success leaves a sane learner, failure is a one-line ValueError."""
        self.path.write_bytes(data)
        try:
            self.learner.resume()
        except ValueError as e:
            assert_one_line(e)
            return
        learner = self.learner
        tensors = [*learner.global_params, *learner.outer.state_tensors(), *learner.model.parameters()]
        assert all(bool(torch.isfinite(t).all()) for t in tensors)
        assert learner.outer_step >= 0 and 0 <= learner.dataset.train.position <= 2**53
        learner.dataset.train.next_batch()  # the data position it resumed at can still be read


@pytest.fixture(scope="module")
def resumer(tiny_corpus: str, tmp_path_factory: pytest.TempPathFactory) -> Resumer:
    return Resumer(tiny_corpus, tmp_path_factory.mktemp("fuzz-checkpoint"))


@fuzz(60)
@given(data=st.binary(max_size=3000))
def test_checkpoint_loader_on_random_bytes(resumer, data):
    resumer.resume(data)


@fuzz(80)
@given(cut=st.one_of(st.none(), st.integers(0, 10**9)), flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 7)), max_size=4))
def test_checkpoint_loader_on_truncated_and_bit_flipped_checkpoints(resumer, cut, flips):
    data = bytearray(resumer.good_bytes)
    for offset, bit in flips:
        data[offset % len(data)] ^= 1 << bit
    resumer.resume(bytes(data[: cut % (len(data) + 1)] if cut is not None else data))


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.bool, torch.uint8]


@st.composite
def odd_tensors(draw: st.DrawFn) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    fill = draw(st.sampled_from([0.0, 1.0, 1e30, math.nan, math.inf]))
    dtype = draw(st.sampled_from(_DTYPES))
    return torch.full(shape, fill).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)


_ODD_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.binary(max_size=8), odd_tensors(), st.lists(odd_tensors(), max_size=3),
    st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-1, 40)), odd_tensors(), max_size=3),
)


@fuzz(120)
@given(data=st.data())
def test_checkpoint_loader_on_valid_torch_files_with_wrong_contents(resumer, data, tmp_path):
    """A file torch reads fine, written by someone else: a field replaced, removed, or one tensor in it
    replaced (by another shape or dtype, or the same one full of NaN)."""
    state = copy.deepcopy(resumer.good_state)
    container, key = state, data.draw(st.sampled_from(sorted(state)))
    while isinstance(container[key], dict | list) and container[key] and data.draw(st.booleans()):
        container = container[key]
        key = data.draw(st.sampled_from(sorted(container) if isinstance(container, dict) else range(len(container))))
    action = data.draw(st.sampled_from(["replace", "remove", "poison"]))
    if action == "remove" and isinstance(container, dict):
        del container[key]
    elif action == "poison" and isinstance(container[key], torch.Tensor) and container[key].is_floating_point():
        container[key] = torch.full_like(container[key], data.draw(st.sampled_from([math.nan, math.inf, -math.inf])))
    else:
        container[key] = data.draw(_ODD_VALUES)
    torch.save(state, tmp_path / "mutated.pt")
    resumer.resume((tmp_path / "mutated.pt").read_bytes())


def test_a_pickle_payload_is_never_run(resumer, tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    torch.save({"outer_step": 1, "payload": Payload()}, tmp_path / "evil.pt")
    resumer.resume((tmp_path / "evil.pt").read_bytes())
    assert not marker.exists()


# wire decoder ------------------------------------------------------------------------------------------------

_WIRE_TYPES = sorted(runtime_pb2.CompressionType.values())
_BAD_FLOATS = [struct.pack("<f", v) for v in (math.nan, math.inf, -1.0, 3e38)]


@pytest.fixture(scope="module")
def wire_codecs() -> dict[str, WireCodec]:
    install_wire_codecs()  # what every peer does before its averager starts
    return {name: WireCodec(make_codec(name)) for name in COMPRESSIONS}


def check_decode(message: runtime_pb2.Tensor) -> None:
    """Decode as a receiving peer does: the declared tensor and never more values than the bytes carry,
    finite values from a quantized codec; or a one-line MalformedPayloadError."""
    try:
        result = deserialize_torch_tensor(message)
    except MalformedPayloadError as e:
        assert_one_line(e)
        return
    except ValueError as e:
        # a wire type number hivemind does not know: its registry lookup refuses it before any decoder runs
        assert message.compression not in _WIRE_TYPES, e
        return
    assert tuple(result.shape) == tuple(message.size)
    # topk: at most 64 values in 6 bytes; int2 packs four values per byte, int4 two; every other layout less
    per_byte = {runtime_pb2.QUANTILE_8BIT: 64 / 6, runtime_pb2.MEANSTD_16BIT: 4}.get(message.compression, 2)
    assert result.numel() <= per_byte * len(message.buffer)
    if message.compression in (runtime_pb2.BLOCKWISE_8BIT, runtime_pb2.UNIFORM_8BIT, runtime_pb2.QUANTILE_8BIT,
                               runtime_pb2.MEANSTD_16BIT):
        assert bool(torch.isfinite(result).all())


_SIZES = st.lists(st.one_of(st.integers(0, 600), st.integers(0, 2**32 - 1)), max_size=9)
_DTYPE_NAMES = st.one_of(st.sampled_from(["float32", "float16", "bfloat16", "int64", "bool", "object", "V8"]), st.text(max_size=8))


@fuzz(300)
@given(compression=st.sampled_from(_WIRE_TYPES), buffer=st.binary(max_size=2048), size=_SIZES, dtype=_DTYPE_NAMES, grad=st.booleans())
@example(compression=runtime_pb2.FLOAT16, buffer=b"", size=[2**31, 2**31, 4], dtype="float32", grad=False)  # 2**64 values
@example(compression=runtime_pb2.NONE, buffer=b"\0" * 8, size=[1], dtype="int64", grad=True)
def test_wire_decoder_on_random_messages(wire_codecs, compression, buffer, size, dtype, grad):
    check_decode(runtime_pb2.Tensor(compression=compression, buffer=buffer, size=size, dtype=dtype, requires_grad=grad))


@fuzz(200)
@given(raw=st.binary(max_size=600))
def test_wire_decoder_on_random_bytes(wire_codecs, raw):
    try:
        message = runtime_pb2.Tensor.FromString(raw)
    except DecodeError:
        return  # not a message at all: hivemind's RPC layer drops it before any decoder runs
    check_decode(message)


@fuzz(300)
@given(data=st.data())
def test_wire_decoder_on_damaged_parts(wire_codecs, data):
    """A real part of each codec with bytes overwritten (NaN, inf or negative block scales among them), cut
    short or extended, or with another declared shape or dtype."""
    name = data.draw(st.sampled_from(COMPRESSIONS))
    numel = data.draw(st.one_of(st.integers(0, 350).map(lambda n: 2 * n), st.sampled_from([1, 7])))  # few compiles
    values = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * data.draw(st.sampled_from([1.0, 1e-30, 1e30]))
    part = wire_codecs[name].compress(values, None)
    buffer = bytearray(part.buffer)
    for _ in range(data.draw(st.integers(0, 3))):
        offset = data.draw(_mostly(st.integers(0, 3).map(lambda k: 4 * k), st.integers(0, len(buffer))))  # scales first
        chunk = data.draw(st.one_of(st.sampled_from(_BAD_FLOATS), st.binary(min_size=1, max_size=3)))
        buffer[offset : offset + len(chunk)] = chunk
    if data.draw(st.integers(0, 7)) == 0:
        buffer = buffer[: data.draw(st.integers(0, len(buffer)))]
    size = data.draw(_mostly(st.just(list(part.size)), _SIZES))
    dtype = data.draw(_mostly(st.just("float32"), _DTYPE_NAMES))
    check_decode(runtime_pb2.Tensor(compression=part.compression, buffer=bytes(buffer), size=size, dtype=dtype))


@pytest.mark.parametrize("name", ["int8", "int4", "int2", "topk"])
@pytest.mark.parametrize("scale", _BAD_FLOATS[:3])
def test_a_bad_block_scale_is_refused(wire_codecs, name, scale):
    part = wire_codecs[name].compress(torch.randn(300), None)
    damaged = runtime_pb2.Tensor(compression=part.compression, buffer=scale + part.buffer[4:], size=part.size, dtype="float32")
    with pytest.raises(MalformedPayloadError, match="block scales"):
        deserialize_torch_tensor(damaged)


@pytest.mark.parametrize("name", COMPRESSIONS)
def test_wire_decoder_round_trips_good_parts(wire_codecs, name):
    values = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    decoded = deserialize_torch_tensor(wire_codecs[name].compress(values, None))
    torch.testing.assert_close(decoded, make_codec(name).decode(make_codec(name).encode(values), 1000))
