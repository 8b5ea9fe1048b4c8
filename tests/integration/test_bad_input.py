"""Bad input to peer.py ends within seconds with one clear error line and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

PEER = Path(__file__).resolve().parents[2] / "peers" / "peer.py"
SWARM = Path(__file__).resolve().parents[2] / "scripts" / "swarm.py"
UNREACHABLE = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"

CASES = {
    "unknown flag": (["--no-such-flag"], "unrecognized arguments"),
    "bad multiaddr": (["--initial-peers", "not-an-address"], "bad multiaddr"),
    "multiaddr without peer id": (["--initial-peers", "/ip4/127.0.0.1/tcp/9"], "/p2p/"),
    "negative steps": (["--inner-steps", "-5"], "inner_steps"),
    "negative max outer steps": (["--max-outer-steps", "-1"], "max_outer_steps"),
    "bad compression": (["--compression", "zip"], "invalid choice"),
    "unreadable config": (["--config", "/nonexistent/peer.toml"], "cannot read config file"),
    "unreachable initial peer": (["--initial-peers", UNREACHABLE, "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], "could not join"),
    "missing corpus": (["--corpus-dir", "/nonexistent/corpus"], "corpus folder"),
    "bad relay address": (["--relay", "relay.example:4001"], "bad multiaddr"),
    "unknown reachability": (["--reachability", "sometimes"], "invalid choice"),
    "monitor port out of range": (["--monitor-port", "70000"], "run.monitor_port"),
    "tensorboard folder is a file": (["--tensorboard", "/etc/hostname"], "TensorBoard folder"),
    "missing model config": (["--model-config", "/nonexistent/config.json"], "model config /nonexistent/config.json does not exist"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gives_one_line_and_nonzero_exit(case, reaper, tmp_path):
    argv, expected = CASES[case]
    process = subprocess.Popen(
        [sys.executable, str(PEER), *argv, "--metrics-file", str(tmp_path / "m.jsonl")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    reaper.append(process.pid)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "Traceback" not in stderr + stdout
    errors = [line for line in stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and expected in errors[0], stderr


def test_bad_toml_and_unknown_key_are_named(tmp_path, reaper):
    broken = tmp_path / "broken.toml"
    broken.write_text("[inner\nlr = 1")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[inner]\nlearning_rate = 0.1\n")
    for path, expected in ((broken, "not valid TOML"), (unknown, "unknown key(s) in [inner]: learning_rate")):
        result = subprocess.run([sys.executable, str(PEER), "--config", str(path)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and expected in result.stderr and "Traceback" not in result.stderr


def _file(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def _pipes_only(folder: Path) -> Path:
    folder.mkdir()
    os.mkfifo(folder / "pipe")  # reading it would block forever
    return folder


def _foreign_checkpoints(folder: Path) -> Path:
    """A folder whose only checkpoint is a valid torch file with hostile contents (params that are not tensors)."""
    import torch

    folder.mkdir()
    torch.save({"outer_step": 3, "global_params": [1, 2], "momentum": [], "global_sha256": "0" * 64}, folder / "outer_step_00000003.pt")
    return folder


def _tokenizer_larger_than_the_model(folder: Path) -> list[str]:
    """A transformers config.json of 256 tokens, and a tokenizer of 300 for the dataset (ids 256-299 would index
    past the model's embedding)."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0")).save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text('{"model_type": "llama", "vocab_size": 256, "hidden_size": 32, '
                                        '"intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}')
    (folder / "train.jsonl").write_text('{"text": "hello"}\n')
    return ["--model-config", str(folder / "config.json"), "--dataset", str(folder / "train.jsonl"),
            "--tokenizer", str(folder / "tokenizer.json")]


# each case: tmp_path -> (extra argv, what the one error line must say); every one once ended in a traceback, a
# hang, an OOM kill, or a run that went on over what was saved. One per kind of input (each costs a process
# start); the variants of each are unit tests (test_config_validation.py, test_local_inputs.py, test_fuzz.py)
HOSTILE: dict[str, Callable[[Path], tuple[list[str], str]]] = {
    "config path of the wrong type": lambda d: (["--config", str(_file(d / "c.toml", b"[data]\ncorpus_dir = 5\n"))], "data.corpus_dir must be a path"),
    "model larger than memory": lambda d: (["--n-layers", "100000", "--d-model", "65536", "--n-heads", "1"], "more than this machine's"),
    "corpus of named pipes": lambda d: (["--corpus-dir", str(_pipes_only(d / "corpus"))], "holds only 0 bytes of text"),
    "identity file of garbage": lambda d: (["--identity", str(_file(d / "id.key", b"garbage"))], "does not hold a libp2p private key"),
    "hostile checkpoint": lambda d: (["--checkpoint-dir", str(_foreign_checkpoints(d / "ckpt")), "--resume"], "no usable checkpoint"),
    "checkpoints of another run": lambda d: (["--checkpoint-dir", str(_foreign_checkpoints(d / "ckpt"))], "already holds checkpoints"),
    "tokenizer larger than the model": lambda d: (_tokenizer_larger_than_the_model(d), "vocabulary (256 tokens) does not cover the 300 token ids"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_local_input_gives_one_line_and_keeps_what_was_saved(case, reaper, tmp_path):
    argv, expected = HOSTILE[case](tmp_path)
    saved = {p: p.read_bytes() for p in tmp_path.rglob("*.pt")}
    process = subprocess.Popen(
        [sys.executable, str(PEER), *argv, "--metrics-file", str(tmp_path / "m.jsonl")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    reaper.append(process.pid)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 2 and "Traceback" not in stderr + stdout, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if ": error:" in line]
    assert len(errors) == 1 and expected in errors[0], stderr[-2000:]
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.pt")} == saved  # nothing saved was deleted or rewritten


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--outer-lr", "nan"], "swarm.py: error: outer.lr must be a finite number within +-2**53, got nan"),
        (["--out", "/dev/null"], "swarm.py: error: cannot use --out /dev/null: File exists"),  # was a traceback
    ],
)
def test_the_local_swarm_launcher_refuses_bad_input_before_starting_peers(tmp_path, reaper, argv, expected):
    process = subprocess.Popen(
        [sys.executable, str(SWARM), "--peers", "2", "--out", str(tmp_path / "out"), *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    reaper.append(process.pid)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 2 and "Traceback" not in stderr + stdout
    assert stderr.strip().splitlines() == [expected]
