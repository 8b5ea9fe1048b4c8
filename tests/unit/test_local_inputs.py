"""Hostile local input, one process: corpus folders, checkpoint files and folders, identity files, and models
too large for the machine each end in a ValueError naming the problem (what peer.py prints as one line),
never a hang, another exception, or a lost checkpoint."""

from __future__ import annotations

import io
import os
import re
import zipfile
from pathlib import Path

import pytest
import torch

from p2p_diloco.cli.preflight import check_identity_file, check_local_inputs, check_memory
from p2p_diloco.core import checkpoint
from p2p_diloco.core.config import DataConfig, InnerConfig, ModelConfig, PeerConfig, RunConfig
from p2p_diloco.core.link import LocalLink
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.train.data import load_corpus
from p2p_diloco.train.learner import Learner

from .helpers import TINY_MODEL, make_dataset

pytestmark = pytest.mark.timeout(60)  # a reader that blocks on a pipe must fail here, not hang the suite

TEXT = "def f(x):\n    return x + 1\n" * 3000  # ~80 KB: more than the 64 KiB a corpus needs


# corpus ------------------------------------------------------------------------------------------------------


def test_pipes_devices_and_link_loops_in_a_corpus_are_skipped_without_blocking(tmp_path):
    (tmp_path / "code.py").write_text(TEXT)
    os.mkfifo(tmp_path / "a_pipe")  # opening it for reading would block until a writer came
    (tmp_path / "zeros").symlink_to("/dev/zero")  # reading it would never end
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    (tmp_path / "up").symlink_to(tmp_path, target_is_directory=True)  # a folder loop: links are not followed
    corpus = load_corpus(str(tmp_path))
    assert bytes(corpus.numpy()) == TEXT.encode()


def test_a_folder_of_pipes_only_is_named_as_holding_no_text(tmp_path):
    os.mkfifo(tmp_path / "a_pipe")
    with pytest.raises(ValueError, match=rf"corpus folder {re.escape(str(tmp_path))} holds only 0 bytes of text"):
        load_corpus(str(tmp_path))


def test_binary_files_are_skipped_and_a_binary_only_folder_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(bytes(range(256)) * 1000)
    with pytest.raises(ValueError, match="holds only 0 bytes of text"):
        load_corpus(str(tmp_path))
    (tmp_path / "code.py").write_text(TEXT)
    assert bytes(load_corpus(str(tmp_path)).numpy()) == TEXT.encode()


def test_a_corpus_too_large_to_hold_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr("p2p_diloco.train.data.MAX_CORPUS_BYTES", 100_000)
    for index in range(2):
        (tmp_path / f"part{index}.txt").write_text(TEXT)
    with pytest.raises(ValueError, match="goes past"):
        load_corpus(str(tmp_path))


# checkpoints -------------------------------------------------------------------------------------------------


def _config(make_config, directory: Path, resume: bool = False):
    return make_config(
        inner=InnerConfig(inner_steps=1, batch_size=2),
        run=RunConfig(max_outer_steps=2, checkpoint_dir=str(directory), checkpoint_every=1, eval_batches=1, resume=resume),
    )  # the same model, data and seed as checkpoint_bytes' run


@pytest.fixture(scope="module")
def checkpoint_bytes(tiny_corpus, tmp_path_factory) -> list[tuple[str, bytes]]:
    """A real run's two checkpoints (name, bytes), newest first; made once, copied for each test."""
    directory = tmp_path_factory.mktemp("checkpoints")
    config = PeerConfig(
        model=TINY_MODEL, data=DataConfig(corpus_dir=tiny_corpus), inner=InnerConfig(inner_steps=1, batch_size=2),
        run=RunConfig(max_outer_steps=2, checkpoint_dir=str(directory), checkpoint_every=1, eval_batches=1),
    )
    Learner(config, make_dataset(config), NullSink()).run(LocalLink("none"))
    return [(path.name, path.read_bytes()) for path in checkpoint.candidates(directory)]


@pytest.fixture
def two_checkpoints(checkpoint_bytes, tmp_path) -> list[Path]:
    for name, data in checkpoint_bytes:
        (tmp_path / name).write_bytes(data)
    return checkpoint.candidates(tmp_path)  # newest first: steps 2 and 1


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("global_params", [1, 2, 3], "global_params is not a list of tensors"),
        ("momentum", "abc", "momentum is not a list of tensors"),
        ("data_position", -5, "data_position"),
        ("data_position", 2**62, "data_position"),
        ("outer_step", 1.5, "outer_step"),
        ("global_sha256", 5, "global_sha256"),
        ("local_model", [1], "local_model"),
        ("unsynced_by_fragment", "ab", "unsynced_by_fragment"),
        ("inner_optimizer", {"state": 5, "param_groups": 7}, "inner_optimizer"),
    ],
)
def test_a_checkpoint_with_wrong_contents_is_named_and_the_previous_one_used(make_config, two_checkpoints, field, value, expected, caplog):
    newest, previous = two_checkpoints
    state = checkpoint.load(newest)
    state[field] = value
    torch.save(state, newest)
    hostile = newest.read_bytes()
    with pytest.raises(ValueError, match=re.escape(expected)):
        checkpoint.load(newest)
    learner = Learner(_config(make_config, newest.parent, resume=True), make_dataset(_config(make_config, newest.parent)), NullSink())
    assert learner.resume() == previous
    assert str(newest) in caplog.text and newest.read_bytes() == hostile  # reported, not deleted or rewritten


# each loads into torch's AdamW without complaint and then fails at the first inner step or trains on NaN
DAMAGE_THE_SHA256_DOES_NOT_COVER = {
    "nan_local_model": lambda state: next(iter(state["local_model"].values())).fill_(float("nan")),
    "inf_optimizer_state": lambda state: state["inner_optimizer"]["state"][0]["exp_avg_sq"].fill_(float("inf")),
    "optimizer_state_of_another_shape": lambda state: state["inner_optimizer"]["state"][0].update(exp_avg=torch.zeros(3)),
    "optimizer_state_missing": lambda state: state["inner_optimizer"]["state"][0].pop("exp_avg"),
    "string_learning_rate": lambda state: state["inner_optimizer"]["param_groups"][0].update(lr="0.1"),
    "capturable_on_cpu": lambda state: state["inner_optimizer"]["param_groups"][0].update(capturable=True),
    "optimizer_of_other_params": lambda state: state["inner_optimizer"]["param_groups"][0].update(params=[99]),
}


@pytest.mark.parametrize("damage", list(DAMAGE_THE_SHA256_DOES_NOT_COVER))
def test_damage_the_sha256_does_not_cover_is_found(two_checkpoints, damage):
    newest = two_checkpoints[0]
    state = checkpoint.load(newest)
    DAMAGE_THE_SHA256_DOES_NOT_COVER[damage](state)
    torch.save(state, newest)
    with pytest.raises(ValueError, match=rf"checkpoint {re.escape(str(newest))} is damaged"):
        checkpoint.load(newest)


def test_no_usable_checkpoint_leaves_every_file_as_it_was(make_config, two_checkpoints):
    for path in two_checkpoints:
        state = checkpoint.load(path)
        state["global_params"] = [7]
        torch.save(state, path)
    before = {path: path.read_bytes() for path in two_checkpoints}
    learner = Learner(_config(make_config, two_checkpoints[0].parent, resume=True), make_dataset(_config(make_config, two_checkpoints[0].parent)), NullSink())
    with pytest.raises(ValueError, match="no usable checkpoint"):
        learner.resume()
    assert {path: path.read_bytes() for path in checkpoint.candidates(two_checkpoints[0].parent)} == before


def test_files_that_are_not_plain_torch_archives_are_refused(two_checkpoints, tmp_path):
    good = two_checkpoints[0].read_bytes()
    legacy = tmp_path / "legacy" / "outer_step_00000001.pt"  # the pre-zip format allocates what it declares
    legacy.parent.mkdir()
    with legacy.open("wb") as handle:
        torch.save({"outer_step": 1}, handle, _use_new_zipfile_serialization=False)
    compressed = tmp_path / "outer_step_00000002.pt"  # deflated entries may declare more than the file holds
    with zipfile.ZipFile(io.BytesIO(good)) as source, zipfile.ZipFile(compressed, "w", zipfile.ZIP_DEFLATED) as target:
        for entry in source.infolist():
            target.writestr(entry.filename, source.read(entry))
    pipe = tmp_path / "outer_step_00000003.pt"
    os.mkfifo(pipe)
    folder = tmp_path / "outer_step_00000004.pt"
    folder.mkdir()
    for path in (legacy, compressed, pipe, folder):
        with pytest.raises(ValueError, match=re.escape(str(path))):
            checkpoint.load(path)


def test_a_fresh_run_refuses_a_folder_that_holds_checkpoints(two_checkpoints):
    directory = two_checkpoints[0].parent
    with pytest.raises(ValueError, match="already holds checkpoints.*--resume"):
        checkpoint.check_folder(directory, resume=False)
    checkpoint.check_folder(directory, resume=True)
    checkpoint.check_folder(directory / "new" / "nested", resume=False)  # made at the first save


def test_a_checkpoint_folder_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    for directory in (tmp_path / "file", tmp_path / "file" / "below"):
        with pytest.raises(ValueError, match=rf"checkpoint folder {re.escape(str(directory))} cannot be used"):
            checkpoint.check_folder(directory, resume=False)


# identity, metrics file, memory ------------------------------------------------------------------------------


def test_a_real_identity_file_passes_and_a_missing_one_may_be_made(tmp_path):
    from hivemind.p2p import P2P

    path = tmp_path / "id.key"
    check_identity_file(path)  # missing, in an existing folder: hivemind will make it
    P2P.generate_identity(str(path))  # what hivemind writes: mode 0400
    check_identity_file(path)


def _key_file(path: Path, data: bytes, mode: int) -> None:
    path.write_bytes(data)
    path.chmod(mode)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: _key_file(p, b"garbage" * 10, 0o600), "does not hold a libp2p private key"),
        (lambda p: _key_file(p, b"", 0o400), "does not hold a libp2p private key"),
        (lambda p: _key_file(p, b"garbage", 0o644), "other users may read it"),
        (lambda p: p.mkdir(), "is not a regular file"),
        (lambda p: os.mkfifo(p), "is not a regular file"),
    ],
)
def test_a_bad_identity_file_is_named(tmp_path, make, expected):
    path = tmp_path / "id.key"
    make(path)
    with pytest.raises(ValueError, match=rf"identity file {re.escape(str(path))} .*{expected}"):
        check_identity_file(path)


def test_an_identity_file_in_a_missing_folder_is_named(tmp_path):
    with pytest.raises(ValueError, match="cannot be created"):
        check_identity_file(tmp_path / "missing" / "id.key")


def test_a_metrics_file_that_is_a_pipe_is_refused(make_config, tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ValueError, match="metrics file .* is not a regular file"):
        check_local_inputs(make_config(run=RunConfig(metrics_file=str(tmp_path / "pipe"))))


def test_a_model_that_cannot_fit_in_memory_is_refused_before_it_is_built():
    with pytest.raises(ValueError, match="needs at least .* GiB to train, more than this machine's"):
        check_memory(ModelConfig(n_layers=100_000, d_model=65_536, n_heads=1), batch_size=16, eval_batches=4)
    check_memory(ModelConfig(), batch_size=16, eval_batches=4)  # the default model fits anywhere
