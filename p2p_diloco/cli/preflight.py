"""Checks of a peer's local inputs that need the file system or the machine, run once at start-up before
anything is loaded or started: the identity key file (and, in a run closed by an allow-list, that its key is
listed), the checkpoint folder, the metrics file, the dataset files,
tokenizer and transformers model config (readable; the model's vocabulary covers the tokens), and whether the
model fits in memory at all. Each failure is a ValueError with a one-line reason that says how to fix it.

The config's values are checked by config.py, the corpus by data.py (which reads it anyway), checkpoint files
by checkpoint.py when they are loaded. This module reads but never changes anything on disk.
"""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path

from p2p_diloco.core import extras
from p2p_diloco.core.config import ModelConfig, PeerConfig

_MAX_IDENTITY_BYTES = 1 << 16  # a libp2p RSA private key is about 1.2 KB
_BYTES_PER_PARAM = 24  # at least: fp32 param, grad, AdamW m and v (Muon: one buffer, so less), global params and outer momentum


def check_local_inputs(config: PeerConfig) -> None:
    """All the checks below that apply to ``config``; raises ValueError at the first problem."""
    if config.swarm.identity_path:
        check_identity_file(Path(config.swarm.identity_path))
    if config.swarm.allow_list_file:
        if not config.swarm.identity_path:
            raise ValueError("--allow-list needs --identity PATH: the key this peer runs and signs as")
        check_on_allow_list(Path(config.swarm.identity_path), Path(config.swarm.allow_list_file))
    if config.run.checkpoint_dir:
        from p2p_diloco.core import checkpoint  # torch: loaded only for a run that names a checkpoint folder

        checkpoint.check_folder(config.run.checkpoint_dir, config.run.resume)
    if config.run.metrics_file:
        _check_output_file(Path(config.run.metrics_file), "metrics file")
    if config.run.ready_file:
        _check_output_file(Path(config.run.ready_file), "ready file")
        if not Path(config.run.ready_file).parent.is_dir():
            raise ValueError(f"ready file {config.run.ready_file} cannot be written: its folder does not exist")
    if config.swarm.join_ready_file and not Path(config.swarm.join_ready_file).parent.is_dir():
        raise ValueError(f"--join-ready-file {config.swarm.join_ready_file}: its folder does not exist")
    if config.run.tensorboard_dir:
        extras.require("tensorboard", "--tensorboard")
        check_tensorboard_dir(Path(config.run.tensorboard_dir))
    if config.model.transformers_model:
        extras.require("hf", "--model-config" if config.model.hf_config else "--init-from")
    if config.data.dataset:
        extras.require("hf", "--dataset")
    check_model_and_data(config)


def check_model_and_data(config: PeerConfig) -> None:
    """The dataset's files exist, the tokenizer and a transformers model's config.json can be read (imported only
    for runs that name them), the model's vocabulary covers every token id the data can hold, its positions
    cover seq_len, and it fits in memory."""
    model, data = config.model, config.data
    token_ids, source = 256, "UTF-8 bytes"
    if data.corpus_dir and not data.dataset and not Path(data.corpus_dir).is_dir():  # data.py reads it, later
        raise ValueError(f"corpus folder {data.corpus_dir} does not exist or is not a folder")
    if data.dataset:
        from p2p_diloco.train.text_data import find_files, load_tokenizer, vocab_size

        find_files(data.dataset)
        if data.tokenizer:
            token_ids, source = vocab_size(load_tokenizer(data.tokenizer)), f"tokenizer {data.tokenizer}"
    if model.transformers_model:
        from p2p_diloco.train.hf_model import config_json_path, describe

        shape = describe(model)
        model_vocab, fix = shape.vocab_size, f"use a model config.json with vocab_size >= {token_ids} (not {config_json_path(model)})"
        if shape.max_positions and shape.max_positions < model.seq_len:
            raise ValueError(f"the model covers {shape.max_positions} positions ({config_json_path(model)}), fewer "
                             f"than --seq-len {model.seq_len}: choose a shorter --seq-len")
        needed = _bytes_needed(shape.parameters, shape.width, shape.layers, shape.vocab_size, model.seq_len,
                               config.inner.batch_size, config.run.eval_batches)
        _check_fits(needed, f"the model of {config_json_path(model)} ({shape.parameters:,} parameters)", config.inner.batch_size)
    else:
        model_vocab, fix = model.vocab_size, f"pass --vocab-size {token_ids} (or more)"
        check_memory(model, config.inner.batch_size, config.run.eval_batches)
    if model_vocab < token_ids:
        raise ValueError(f"the model's vocabulary ({model_vocab} tokens) does not cover the {token_ids} token ids of "
                         f"{source}: {fix}")


def check_identity_file(path: Path) -> None:
    """An identity file that exists must be a regular file that only its owner can read, holding a libp2p
    private key (what hivemind writes, mode 0400); a missing one is created by hivemind, so its folder must exist.
    Otherwise p2pd fails after the model is built, with a message about protobuf wire formats."""
    if not path.exists() and not path.is_symlink():
        if not path.parent.is_dir():
            raise ValueError(f"identity file {path} cannot be created: {path.parent} is not a folder")
        return
    if not path.is_file():
        raise ValueError(f"identity file {path} is not a regular file")
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"identity file {path} holds this peer's private key but other users may read it "
                         f"(mode {stat.S_IMODE(mode):o}): run chmod 600 {path}")
    try:
        with path.open("rb") as handle:
            data = handle.read(_MAX_IDENTITY_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read identity file {path}: {e.strerror or e}") from None
    from p2p_diloco.swarm.hivemind_api import is_libp2p_key

    if not is_libp2p_key(data):
        raise ValueError(f"identity file {path} does not hold a libp2p private key "
                         "(remove it, or pass another --identity, to have a new one made)")


def check_on_allow_list(identity_path: Path, allow_list_path: Path) -> None:
    """The allow-list can be read and lists this peer's public key, so that the others will take it in."""
    from p2p_diloco.swarm.membership import AllowList, load_identity

    allow_list = AllowList(allow_list_path)
    if not identity_path.exists():
        raise ValueError(f"identity file {identity_path} does not exist yet, so it cannot be on the allow-list "
                         f"{allow_list_path}: make it with --identity {identity_path} --show-identity and have "
                         "the public key it prints added to the list")
    allow_list.check_member(load_identity(identity_path, create=False), identity_path)


def check_tensorboard_dir(path: Path) -> None:
    """A TensorBoard folder must be a folder if it exists, and the tensorboard package must be installed (it is
    imported only when a peer writes TensorBoard scalars)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"TensorBoard folder {path} exists and is not a folder")
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard")


def _check_output_file(path: Path, what: str) -> None:
    """An output file appended to must be a regular file if it exists: a named pipe would block the open."""
    if path.exists() and not path.is_file():
        raise ValueError(f"{what} {path} exists and is not a regular file")


def training_bytes(model: ModelConfig, batch_size: int, eval_batches: int) -> int:
    """A lower estimate of the memory one peer needs to train ``model`` (bytes): what it cannot do without, so
    that only a config that surely cannot fit is refused. Parameters of the GPT in model.py: embeddings
    (vocab + positions) x width, and per block 12 d^2 + 13 d."""
    d, layers, seq, vocab = model.d_model, model.n_layers, model.seq_len, model.vocab_size
    params = (vocab + seq) * d + layers * (12 * d * d + 13 * d) + 2 * d
    return _bytes_needed(params, d, layers, vocab, seq, batch_size, eval_batches)


def _bytes_needed(params: int, width: int, layers: int, vocab: int, seq: int, batch_size: int, eval_batches: int) -> int:
    # saved for backward, fp32: at least 8 activations of width d per token and block, and the logits twice
    activations = 4 * batch_size * seq * (8 * width * layers + 2 * vocab)
    eval_data = 16 * eval_batches * batch_size * seq  # held-out batches kept as int64 inputs and targets
    return _BYTES_PER_PARAM * params + activations + eval_data


def check_memory(model: ModelConfig, batch_size: int, eval_batches: int) -> None:
    """Refuse a built-in model that cannot fit in this machine's physical memory, before it is built: building it
    would otherwise end in the kernel's OOM killer (no message at all) or minutes of swapping."""
    what = (f"the model (n_layers={model.n_layers}, d_model={model.d_model}, seq_len={model.seq_len}, "
            f"vocab_size={model.vocab_size})")
    _check_fits(training_bytes(model, batch_size, eval_batches), what, batch_size)


def _check_fits(needed: int, what: str, batch_size: int) -> None:
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says: no check
        return
    if needed > physical:
        raise ValueError(
            f"{what} at batch size {batch_size} needs at least {needed / 2**30:,.0f} GiB "
            f"to train, more than this machine's {physical / 2**30:,.0f} GiB: choose a smaller model or batch"
        )
