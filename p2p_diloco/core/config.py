"""Configuration: one frozen dataclass per concern, each field documented with its unit.

Precedence is defaults -> TOML config file -> command-line flags (the CLI applies the last two).
Every section validates itself in ``__post_init__`` and raises ``ValueError`` saying how to fix it.
This module knows nothing of torch or hivemind.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

COMPRESSIONS = ("none", "fp16", "int8", "int4")
REACHABILITY = ("auto", "direct", "relay", "client")  # how a peer takes part; see p2p_diloco/reachability.py
PROGRESS_TRANSPORTS = ("push", "dht")  # how progress records travel; see ProgressBeacon in p2p_diloco/swarm.py
ISLAND_SHARDINGS = ("ddp", "fsdp")  # how the ranks of a torchrun island hold the model; see p2p_diloco/island.py
PRECISIONS = ("auto", "fp32", "bf16")  # of the inner steps' forward and backward; see Island.autocast


# Bounds on any value from a file or a flag: larger numbers are typos, and overflow the int64, float timer and
# msgpack fields they end up in (e.g. threading's TIMEOUT_MAX is ~9.2e9 s) somewhere deep inside a running peer.
_MAX_NUMBER = 2**53
_MAX_SECONDS = 1e8  # about 3 years: bound on every *_s duration
_YEAR_2100_UNIX = 4_102_444_800.0
_MAX_CONFIG_BYTES = 1 << 20  # a config file is a few hundred bytes; this bounds what a wrong path (/dev/zero) reads


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _show(value: Any) -> str:
    """A value for an error message: its repr, cut short so that the message stays one readable line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class ModelConfig:
    """The model: the built-in GPT-style decoder (the fields below), or a Hugging Face transformers causal LM."""

    vocab_size: int = 256  # tokens of the built-in model; 256 = raw bytes (>= the tokenizer's vocabulary)
    n_layers: int = 4  # transformer blocks
    d_model: int = 128  # residual stream width
    n_heads: int = 4  # attention heads; must divide d_model
    seq_len: int = 128  # context length in tokens (also for a transformers model)
    hf_config: str | None = None  # a transformers config.json: that causal LM, trained from a seeded init
    init_from: str | None = None  # a folder written by transformers' save_pretrained: that causal LM and its weights

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "seq_len"):
            _require(getattr(self, name) > 0, f"model.{name} must be a positive integer, got {getattr(self, name)}")
        # tokens are raw bytes unless a tokenizer is given (data.py): fewer fail at the first batch with an IndexError
        _require(self.vocab_size >= 256, f"model.vocab_size must be >= 256 (one token per byte), got {self.vocab_size}")
        _require(
            self.d_model % self.n_heads == 0,
            f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})",
        )
        _require(
            not (self.hf_config and self.init_from),
            "model.hf_config (--model-config) and model.init_from (--init-from) exclude each other: "
            "a folder from save_pretrained holds its own config.json",
        )
        defaults = {f.name: f.default for f in fields(self)}
        changed = [name for name in _BUILT_IN_MODEL_FIELDS if getattr(self, name) != defaults[name]]
        if self.transformers_model and changed:  # the built-in model's shape would be silently ignored
            raise ValueError(
                f"model.{changed[0]} describes the built-in model; a transformers model takes its shape and "
                "vocabulary from its config.json"
            )

    @property
    def transformers_model(self) -> str | None:
        """The config.json or checkpoint folder of a transformers model; None for the built-in model."""
        return self.hf_config or self.init_from


_BUILT_IN_MODEL_FIELDS = ("vocab_size", "n_layers", "d_model", "n_heads")  # ignored by a transformers model


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how this peer's shard is chosen."""

    corpus_dir: str | None = None  # folder of text files read as bytes; None = the Python standard library's .py sources
    dataset: tuple[str, ...] = ()  # text, JSONL or parquet files (or folders of them), read through Hugging Face datasets
    text_field: str = "text"  # the column holding each document's text in JSONL and parquet files
    tokenizer: str | None = None  # a tokenizers file (tokenizer.json) for --dataset; None = UTF-8 bytes
    cache_dir: str | None = None  # where datasets keeps a dataset's memory-mapped Arrow files; None = its own cache
    eval_fraction: float = 0.02  # held-out tail used only for evaluation (fraction of bytes, or of documents of a dataset)
    shard_index: int = 0  # which contiguous shard of the training data this peer reads
    num_shards: int = 1  # how many shards the training data is split into

    def __post_init__(self) -> None:
        _require(0.0 < self.eval_fraction < 0.5, f"data.eval_fraction must be in (0, 0.5), got {self.eval_fraction}")
        _require(self.num_shards >= 1, f"data.num_shards must be >= 1, got {self.num_shards}")
        _require(
            0 <= self.shard_index < self.num_shards,
            f"data.shard_index must be in [0, num_shards={self.num_shards}), got {self.shard_index}",
        )
        _require(
            all(isinstance(p, str) and p and "\x00" not in p for p in self.dataset),
            f"data.dataset must be a list of file or folder paths, got {_show(self.dataset)}",
        )
        _require(not (self.dataset and self.corpus_dir), "data.dataset (--dataset) and data.corpus_dir (--corpus-dir) exclude each other")
        _require(
            not self.tokenizer or bool(self.dataset),
            "data.tokenizer (--tokenizer) needs data.dataset (--dataset); the built-in corpus and --corpus-dir are read as bytes",
        )
        _require(not self.cache_dir or bool(self.dataset), "data.cache_dir (--data-cache-dir) needs data.dataset (--dataset)")
        _require(
            isinstance(self.text_field, str) and 0 < len(self.text_field) <= 256 and "\x00" not in self.text_field,
            f"data.text_field must be a column name, got {_show(self.text_field)}",
        )


@dataclass(frozen=True)
class InnerConfig:
    """The inner optimizer: AdamW on this peer's shard for H steps per round (DiLoCo §2)."""

    inner_steps: int = 50  # H: inner steps per outer round
    batch_size: int = 16  # sequences per inner step
    lr: float = 1e-3  # AdamW learning rate
    weight_decay: float = 0.1  # AdamW decoupled weight decay
    grad_clip_norm: float = 1.0  # clip the global grad norm to this; 0 disables clipping
    tokens_per_round: int = 0  # swarm-wide tokens that end a round; 0 = inner_steps x batch tokens x live peers
    round_deadline_s: float = 0.0  # a round ends at the latest this many seconds after it began; 0 = no deadline
    throttle: float = 1.0  # slow each inner step this many times (sleeping), to emulate older hardware
    fragments: int = 1  # streaming: split the params into this many fragments, averaged one per 1/P of a round
    # the inner steps' arithmetic: bf16 autocast or fp32; auto = bf16 on a GPU, fp32 on a CPU. Only local: the
    # params, the outer gradient and everything shared stay fp32
    precision: str = "auto"

    def __post_init__(self) -> None:
        _require(self.inner_steps >= 1, f"inner.inner_steps (H) must be >= 1, got {self.inner_steps}")
        _require(self.batch_size >= 1, f"inner.batch_size must be >= 1, got {self.batch_size}")
        _require(self.lr > 0, f"inner.lr must be > 0, got {self.lr}")
        _require(self.weight_decay >= 0, f"inner.weight_decay must be >= 0, got {self.weight_decay}")
        _require(self.grad_clip_norm >= 0, f"inner.grad_clip_norm must be >= 0, got {self.grad_clip_norm}")
        _require(self.tokens_per_round >= 0, f"inner.tokens_per_round must be >= 0, got {self.tokens_per_round}")
        _require(self.round_deadline_s >= 0, f"inner.round_deadline_s must be >= 0 s, got {self.round_deadline_s}")
        _require(1 <= self.throttle <= 1000, f"inner.throttle must be in [1, 1000] (1 = full speed), got {self.throttle}")
        _require(self.fragments >= 1, f"inner.fragments must be >= 1, got {self.fragments}")
        _require(self.precision in PRECISIONS, f"inner.precision must be one of {', '.join(PRECISIONS)}, got {_show(self.precision)}")


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer: SGD with Nesterov momentum on the global params (DiLoCo §2)."""

    lr: float = 0.7  # outer learning rate
    momentum: float = 0.9  # Nesterov momentum; 0 = plain SGD

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"outer.lr must be > 0, got {self.lr}")
        _require(0 <= self.momentum < 1, f"outer.momentum must be in [0, 1), got {self.momentum}")


@dataclass(frozen=True)
class SwarmConfig:
    """How this peer finds and averages with the others."""

    run_id: str = "p2p-diloco"  # name of the run; peers with the same run id train together
    initial_peers: tuple[str, ...] = ()  # multiaddrs of peers already in the swarm; empty = start a new swarm
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)  # where to listen
    announce_maddrs: tuple[str, ...] = ()  # addresses to advertise to others (e.g. a public IP)
    identity_path: str | None = None  # private key file for a stable peer id; created if missing
    compression: str = "int8"  # outer gradient codec: none, fp16, int8 (blockwise) or int4 (nf4, error feedback)
    matchmaking_time_s: float = 5.0  # how long a ready peer waits for others to join its group (in the background)
    averaging_timeout_s: float = 60.0  # give up on a round's averaging after this long
    chunk_timeout_s: float = 5.0  # a groupmate silent this long in an all-reduce is dropped from it
    state_timeout_s: float = 60.0  # bound on one state download from a peer
    progress_period_s: float = 1.0  # how often this peer publishes its progress and reads the others' (DHT) near
    # a round's end, while averaging, at start and after a peer joined; 5 s throughout sends ~4x less background
    # traffic, but its staler views split groups more often when a peer joins late
    progress_idle_period_s: float = 0.0  # the same while nothing is near (the round's end is over 3 of these away
    # and no peer joined lately); 0 = the larger of 5 s and progress_period_s
    progress_ttl_s: float = 20.0  # a peer whose progress record is older than this counts as gone
    # dht: a DHT store and read each period (a store searches first, and each node asked answers with every record);
    # push (opt-in): each record straight to the peers this one knows, the others' read from what they pushed (a DHT
    # store and read every 10th period, to find peers not yet known): about a third of the bytes in a swarm of 4
    progress_transport: str = "dht"
    startup_timeout_s: float = 60.0  # bound on joining the DHT at start
    swarm_key_file: str | None = None  # secret shared by the members of a closed run; None = an open run
    allow_list_file: str | None = None  # the members' public keys, one per line: closes the run without a shared secret
    reachability: str = "auto"  # auto (ask a peer to dial back), direct, relay (behind NAT) or client (dial out only)
    relays: tuple[str, ...] = ()  # relay peers for a peer behind NAT; empty = the initial peers
    relay_service: bool = True  # relay for peers behind NAT when this peer is reachable (bounded by p2pd's limits)
    relay_wait_s: float = 20.0  # how long a peer in relay mode waits for its relay to carry a stranger's dial

    @property
    def idle_period_s(self) -> float:
        """The progress records' period while nothing is near (``progress_idle_period_s``, or its automatic value)."""
        return self.progress_idle_period_s or max(5.0, self.progress_period_s)

    def __post_init__(self) -> None:
        _require(
            bool(self.run_id) and all(c.isalnum() or c in "-_" for c in self.run_id),
            f"swarm.run_id must be non-empty letters, digits, '-' or '_', got {_show(self.run_id)}",
        )
        _require(
            self.compression in COMPRESSIONS,
            f"swarm.compression must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}",
        )
        for name in (
            "matchmaking_time_s",
            "averaging_timeout_s",
            "chunk_timeout_s",
            "state_timeout_s",
            "progress_period_s",
            "progress_ttl_s",
            "startup_timeout_s",
        ):
            _require(getattr(self, name) > 0, f"swarm.{name} must be > 0 seconds, got {getattr(self, name)}")
        _require(
            self.averaging_timeout_s > self.matchmaking_time_s,
            "swarm.averaging_timeout_s must exceed swarm.matchmaking_time_s",
        )
        _require(
            self.progress_idle_period_s == 0 or self.progress_idle_period_s >= self.progress_period_s,
            "swarm.progress_idle_period_s must be 0 (automatic) or at least swarm.progress_period_s",
        )
        _require(
            self.progress_ttl_s >= 3 * self.progress_period_s,
            "swarm.progress_ttl_s must be at least 3x swarm.progress_period_s",
        )
        _require(
            self.progress_ttl_s >= 3 * self.idle_period_s,
            "swarm.progress_ttl_s must be at least 3x swarm.progress_idle_period_s",
        )
        _require(
            self.progress_transport in PROGRESS_TRANSPORTS,
            f"swarm.progress_transport must be one of {', '.join(PROGRESS_TRANSPORTS)}, got {_show(self.progress_transport)}",
        )
        _require(
            self.reachability in REACHABILITY,
            f"swarm.reachability must be one of {', '.join(REACHABILITY)}, got {_show(self.reachability)}",
        )
        _require(self.relay_wait_s > 0, f"swarm.relay_wait_s must be > 0 seconds, got {self.relay_wait_s}")


@dataclass(frozen=True)
class RunConfig:
    """When to stop, where to write, how to seed."""

    max_outer_steps: int = 0  # stop after this many outer steps; 0 = no limit
    max_time_s: float = 0.0  # stop after this many seconds of wall time; 0 = no limit
    metrics_file: str | None = None  # JSON lines, one record per outer step; None = no file
    checkpoint_dir: str | None = None  # atomic checkpoints land here; None = no checkpoints
    checkpoint_every: int = 10  # outer steps between checkpoints (and one at shutdown)
    resume: bool = False  # start from the newest readable checkpoint in checkpoint_dir (then catch up with the swarm)
    eval_every: int = 1  # evaluate on the held-out tail every this many outer steps
    eval_batches: int = 4  # batches of the held-out tail per evaluation
    seed: int = 0  # model init seed (shared by the swarm) is seed; data order uses seed + shard
    threads: int = 1  # torch intra-op threads for this peer
    device: str = "auto"  # where a single-process peer trains: auto (a GPU if torch sees one, else the CPU), cpu, cuda, cuda:N
    # how the ranks of a torchrun island hold the model: ddp (all of it on every rank) or fsdp (FSDP2: each rank a
    # shard of the params and inner AdamW state; rank 0 gathers them for the outer step). Needs >= 2 ranks
    island_sharding: str = "ddp"
    shutdown_wait_s: float = 10.0  # at the end of a run, wait this long for an averaging in flight to land
    # after max_outer_steps, keep serving state up to this long while a live peer is behind (its last round failed,
    # say), so that it can catch up to the final state instead of stepping alone onto other bytes; 0 = leave at once
    straggler_wait_s: float = 20.0
    start_at_unix: float = 0.0  # wait until this wall-clock time (Unix seconds) before the first inner step; 0 = at once
    # before the first inner step, wait until this many peers (this one included) are in the swarm, so that peers
    # launched together train together from the first round; 0 or 1 = start at once
    wait_for_peers: int = 0
    wait_for_peers_s: float = 120.0  # give up waiting for them after this long and start with whoever is there
    ready_file: str | None = None  # once in the swarm, write this peer's id and addresses here as JSON (ready.py)
    tensorboard_dir: str | None = None  # TensorBoard scalars per outer step land in DIR/<peer id>; None = none
    monitor_port: int = 0  # serve the swarm monitor web page on this TCP port; 0 = no monitor
    monitor_host: str = "127.0.0.1"  # address the monitor listens on (0.0.0.0: every interface; the page is read-only)

    def __post_init__(self) -> None:
        _require(self.max_outer_steps >= 0, f"run.max_outer_steps must be >= 0, got {self.max_outer_steps}")
        _require(self.max_time_s >= 0, f"run.max_time_s must be >= 0 seconds, got {self.max_time_s}")
        _require(self.checkpoint_every >= 1, f"run.checkpoint_every must be >= 1, got {self.checkpoint_every}")
        _require(not self.resume or bool(self.checkpoint_dir), "run.resume needs run.checkpoint_dir (--checkpoint-dir)")
        _require(self.eval_every >= 1, f"run.eval_every must be >= 1, got {self.eval_every}")
        _require(self.eval_batches >= 1, f"run.eval_batches must be >= 1, got {self.eval_batches}")
        # data order seeds torch generators with seed * 1_000_003 + batch index, which must fit in 64 bits
        _require(0 <= self.seed < 2**32, f"run.seed must be in [0, 2**32), got {self.seed}")
        _require(1 <= self.threads <= 1024, f"run.threads must be in [1, 1024], got {self.threads}")
        _require(
            self.device in ("auto", "cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit()),
            f"run.device must be auto, cpu, cuda or cuda:N, got {_show(self.device)}",
        )
        _require(
            self.island_sharding in ISLAND_SHARDINGS,
            f"run.island_sharding must be one of {', '.join(ISLAND_SHARDINGS)}, got {_show(self.island_sharding)}",
        )
        _require(self.shutdown_wait_s >= 0, f"run.shutdown_wait_s must be >= 0 s, got {self.shutdown_wait_s}")
        _require(self.straggler_wait_s >= 0, f"run.straggler_wait_s must be >= 0 s, got {self.straggler_wait_s}")
        _require(0 <= self.monitor_port <= 65535, f"run.monitor_port must be a TCP port in [1, 65535] (0: no monitor), got {self.monitor_port}")
        _require(
            bool(self.monitor_host) and len(self.monitor_host) <= 255 and not any(c.isspace() for c in self.monitor_host),
            f"run.monitor_host must be a host name or IP address, got {_show(self.monitor_host)}",
        )
        _require(self.wait_for_peers >= 0, f"run.wait_for_peers must be >= 0, got {self.wait_for_peers}")
        _require(self.wait_for_peers_s > 0, f"run.wait_for_peers_s must be > 0 seconds, got {self.wait_for_peers_s}")
        _require(
            0 <= self.start_at_unix < _YEAR_2100_UNIX,
            f"run.start_at_unix must be a Unix time in seconds (or 0), got {self.start_at_unix}",
        )


@dataclass(frozen=True)
class PeerConfig:
    """Everything one learner island needs; each component receives only its own section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in fields(PeerConfig)}
_SECTION_CLASSES = {
    "model": ModelConfig,
    "data": DataConfig,
    "inner": InnerConfig,
    "outer": OuterConfig,
    "swarm": SwarmConfig,
    "run": RunConfig,
}


def build_config(overrides: dict[str, dict[str, Any]]) -> PeerConfig:
    """Build a PeerConfig from ``{section: {field: value}}``; unknown names raise ValueError."""
    sections = {}
    for name, cls in _SECTION_CLASSES.items():
        section = overrides.get(name, {})
        _require(isinstance(section, dict), f"config section [{name}] must be a table, got {type(section).__name__}")
        values = dict(section)
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(str(key) for key in set(values) - set(known))
        _require(not unknown, f"unknown key(s) in [{name}]: {', '.join(unknown)}")
        for key, value in values.items():
            if isinstance(value, list):
                values[key] = tuple(value)
            _check_type(name, key, known[key], values[key])
        sections[name] = cls(**values)
    unknown_sections = sorted(str(key) for key in set(overrides) - set(_SECTION_CLASSES))
    _require(not unknown_sections, f"unknown config section(s): {', '.join(unknown_sections)}")
    return PeerConfig(**sections)


def _check_type(section: str, key: str, spec: dataclasses.Field, value: Any) -> None:
    default = spec.default if spec.default is not dataclasses.MISSING else None
    if default is None:  # optional fields (paths) take None or a string
        _require(
            value is None or (isinstance(value, str) and "\x00" not in value),
            f"{section}.{key} must be a path (a string), got {_show(value)}",
        )
        return
    _require(value is not None, f"{section}.{key} must be set (got no value)")
    expected: tuple[type, ...] = (type(default),)
    if isinstance(default, float):
        expected = (float, int)
    if isinstance(default, bool) or isinstance(value, bool):
        expected = (bool,) if isinstance(default, bool) else expected
        _require(isinstance(value, bool) == isinstance(default, bool), f"{section}.{key} has the wrong type")
    _require(
        isinstance(value, expected),
        f"{section}.{key} must be of type {type(default).__name__}, got {type(value).__name__} ({_show(value)})",
    )
    if isinstance(value, tuple):
        _require(all(isinstance(v, str) for v in value), f"{section}.{key} must be a list of strings, got {_show(value)}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        # NaN fails the sections' range checks anyway, but inf passes "> 0" and then sleeps, times out or trains forever
        _require(
            _is_finite(value) and abs(value) <= _MAX_NUMBER,
            f"{section}.{key} must be a finite number within +-2**53, got {_show(value)}",
        )
        _require(not key.endswith("_s") or value <= _MAX_SECONDS, f"{section}.{key} must be <= {_MAX_SECONDS:.0e} s, got {value}")


def _is_finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a TOML config file into ``{section: {field: value}}``; raises ValueError with the reason."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(_MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror or e}") from None
    _require(len(raw) <= _MAX_CONFIG_BYTES, f"config file {path} is larger than {_MAX_CONFIG_BYTES >> 20} MiB: not a config file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"config file {path} is not UTF-8 text") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise ValueError(f"config file {path} nests arrays or tables too deeply") from None
    for section, values in data.items():
        _require(isinstance(values, dict), f"config file {path}: '{section}' must be a [table]")
    return data
