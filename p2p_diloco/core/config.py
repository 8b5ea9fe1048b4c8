"""Configuration: one frozen dataclass per concern; each field is declared once, with its help text.

``knob`` puts a field's help (and, where the flag is not ``--field-name``, its flag) in the field's metadata; the
command line (cli/flags.py), the TOML file (core/config_load.py) and ``--help`` are all generated from here. The
examples in ``peers/*.toml`` show the file form. Precedence is defaults -> TOML config file -> command-line flags.
Every section validates itself in ``__post_init__`` and raises ``ValueError`` saying how to fix it. This module knows
nothing of torch or hivemind.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

COMPRESSIONS = ("none", "fp16", "int8", "int4", "int2", "topk")
REACHABILITY = ("auto", "direct", "relay", "client")  # how a peer takes part; see swarm/reachability.py
PROGRESS_TRANSPORTS = ("push", "dht")  # how progress records travel; see swarm/progress.py
ISLAND_SHARDINGS = ("ddp", "fsdp")  # how the ranks of a torchrun island hold the model; see train/island.py
INNER_OPTIMIZERS = ("adamw", "muon")  # see train/inner_optimizer.py
PRECISIONS = ("auto", "fp32", "bf16")  # of the inner steps' forward and backward; see Island.autocast
_YEAR_2100_UNIX = 4_102_444_800.0


def knob(default: Any, help: str, *, flag: str | None = None, metavar: str | None = None,
         choices: tuple[str, ...] | None = None) -> Any:
    """A config field: its default and its one description, from which its flag and ``--help`` line are made."""
    return field(default=default, metadata={"help": help, "flag": flag, "metavar": metavar, "choices": choices})


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def show(value: Any) -> str:
    """A value for an error message: its repr, cut short so that the message stays one readable line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _one_of(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"{section}.{name} must be one of {', '.join(allowed)}, got {show(value)}")


@dataclass(frozen=True)
class ModelConfig:
    """The model: the built-in GPT-style decoder, or a Hugging Face transformers causal LM."""

    vocab_size: int = knob(256, "token embeddings of the built-in model; must cover the tokenizer's vocabulary (256: bytes)")
    n_layers: int = knob(4, "transformer blocks of the built-in model")
    d_model: int = knob(128, "residual stream width of the built-in model")
    n_heads: int = knob(4, "attention heads of the built-in model; must divide d_model")
    seq_len: int = knob(128, "context length in tokens (also of a transformers model)")
    hf_config: str | None = knob(None, "train the transformers causal LM this local config.json describes, from a seeded "
                                 "init that is the same on every peer, instead of the built-in model",
                                 flag="--model-config", metavar="CONFIG_JSON")
    init_from: str | None = knob(None, "start from the transformers causal LM saved in this local folder "
                                 "(save_pretrained: config.json and weights)", metavar="DIR")

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

    corpus_dir: str | None = knob(None, "folder of text files to train on, read as bytes (none: the Python standard "
                                  "library's .py sources)", metavar="PATH")
    dataset: tuple[str, ...] = knob((), "text (.txt .md), JSONL (.jsonl .json) or parquet files, or folders of them, "
                                    "read through Hugging Face datasets: one document per line or row", metavar="PATH")
    text_field: str = knob("text", "the column of JSONL and parquet files that holds each document's text")
    tokenizer: str | None = knob(None, "a tokenizers file (tokenizer.json) for --dataset (none: UTF-8 bytes, 256 tokens)",
                                 metavar="TOKENIZER_JSON")
    cache_dir: str | None = knob(None, "where datasets keeps --dataset's memory-mapped Arrow files (none: its own cache)",
                                 flag="--data-cache-dir", metavar="PATH")
    eval_fraction: float = knob(0.02, "held-out tail used only for evaluation: a fraction of the bytes, or of a "
                                "dataset's documents")
    shard_index: int = knob(0, "which contiguous shard of the training data this peer reads")
    num_shards: int = knob(1, "into how many shards the training data is split")

    def __post_init__(self) -> None:
        _require(0.0 < self.eval_fraction < 0.5, f"data.eval_fraction must be in (0, 0.5), got {self.eval_fraction}")
        _require(self.num_shards >= 1, f"data.num_shards must be >= 1, got {self.num_shards}")
        _require(
            0 <= self.shard_index < self.num_shards,
            f"data.shard_index must be in [0, num_shards={self.num_shards}), got {self.shard_index}",
        )
        _require(
            all(isinstance(p, str) and p and "\x00" not in p for p in self.dataset),
            f"data.dataset must be a list of file or folder paths, got {show(self.dataset)}",
        )
        _require(not (self.dataset and self.corpus_dir), "data.dataset (--dataset) and data.corpus_dir (--corpus-dir) exclude each other")
        _require(
            not self.tokenizer or bool(self.dataset),
            "data.tokenizer (--tokenizer) needs data.dataset (--dataset); the built-in corpus and --corpus-dir are read as bytes",
        )
        _require(not self.cache_dir or bool(self.dataset), "data.cache_dir (--data-cache-dir) needs data.dataset (--dataset)")
        _require(
            isinstance(self.text_field, str) and 0 < len(self.text_field) <= 256 and "\x00" not in self.text_field,
            f"data.text_field must be a column name, got {show(self.text_field)}",
        )


@dataclass(frozen=True)
class InnerConfig:
    """The inner optimizer: AdamW (or Muon) on this peer's shard for H steps per round (docs/design.md §2)."""

    inner_steps: int = knob(50, "H: inner steps per peer per round at equal speeds; sets the default round budget",
                            metavar="H")
    batch_size: int = knob(16, "sequences per inner step")
    lr: float = knob(1e-3, "inner learning rate (the peak, with a schedule; Muon's too)", flag="--inner-lr")
    optimizer: str = knob("adamw", "inner optimizer: adamw, or muon (Muon on the transformer blocks' weight matrices, its "
                          "update scaled to AdamW's, AdamW on the rest: the same --inner-lr; not with --island-sharding "
                          "fsdp)", flag="--inner-optimizer", choices=INNER_OPTIMIZERS)
    warmup_steps: int = knob(0, "inner steps of linear lr warm-up at the start of the run (counted on the swarm's "
                             "outer step, so a late joiner does not warm up again)", flag="--inner-warmup-steps")
    lr_decay_steps: int = knob(0, "cosine decay of the inner lr to lr x lr_floor at this inner step of the run (outer "
                               "steps x H); 0: a constant lr after the warm-up", flag="--inner-lr-decay-steps")
    lr_floor: float = knob(0.1, "the fraction of the peak lr the decay ends at", flag="--inner-lr-floor")
    weight_decay: float = knob(0.1, "decoupled weight decay of the inner optimizer")
    grad_clip_norm: float = knob(1.0, "clip the global grad norm to this; 0 disables clipping")
    tokens_per_round: int = knob(0, "tokens the whole swarm processes per round (0: H x batch tokens x live peers); a "
                                 "fast peer simply contributes more of them")
    round_deadline_s: float = knob(0.0, "a round ends at the latest this many seconds after it began (0: no deadline)")
    throttle: float = knob(1.0, "slow this peer's inner steps this many times by sleeping, to emulate older hardware")
    fragments: int = knob(1, "streaming: split the params into P fragments averaged at staggered times, one per 1/P of "
                          "a round, so that each burst is about P times smaller", metavar="P")
    precision: str = knob("auto", "arithmetic of the inner steps: bf16 autocast or fp32; auto is bf16 on a GPU and fp32 "
                          "on a CPU; the params, outer gradients and everything shared stay fp32", choices=PRECISIONS)

    def __post_init__(self) -> None:
        _require(self.inner_steps >= 1, f"inner.inner_steps (H) must be >= 1, got {self.inner_steps}")
        _require(self.batch_size >= 1, f"inner.batch_size must be >= 1, got {self.batch_size}")
        _require(self.lr > 0, f"inner.lr must be > 0, got {self.lr}")
        _require(self.weight_decay >= 0, f"inner.weight_decay must be >= 0, got {self.weight_decay}")
        _require(self.warmup_steps >= 0, f"inner.warmup_steps must be >= 0, got {self.warmup_steps}")
        _require(self.lr_decay_steps == 0 or self.lr_decay_steps > self.warmup_steps,
                 f"inner.lr_decay_steps ({self.lr_decay_steps}) must be 0 (no decay) or more than inner.warmup_steps "
                 f"({self.warmup_steps})")
        _require(0 < self.lr_floor <= 1, f"inner.lr_floor must be in (0, 1], got {self.lr_floor}")
        _require(self.grad_clip_norm >= 0, f"inner.grad_clip_norm must be >= 0, got {self.grad_clip_norm}")
        _require(self.tokens_per_round >= 0, f"inner.tokens_per_round must be >= 0, got {self.tokens_per_round}")
        _require(self.round_deadline_s >= 0, f"inner.round_deadline_s must be >= 0 s, got {self.round_deadline_s}")
        _require(1 <= self.throttle <= 1000, f"inner.throttle must be in [1, 1000] (1 = full speed), got {self.throttle}")
        _require(self.fragments >= 1, f"inner.fragments must be >= 1, got {self.fragments}")
        _one_of("inner", "precision", self.precision, PRECISIONS)
        _one_of("inner", "optimizer", self.optimizer, INNER_OPTIMIZERS)


@dataclass(frozen=True)
class OuterConfig:
    """The outer optimizer: SGD with Nesterov momentum on the global params (docs/design.md §2)."""

    lr: float = knob(0.7, "outer Nesterov SGD learning rate", flag="--outer-lr")
    momentum: float = knob(0.9, "outer Nesterov momentum; 0 = plain SGD", flag="--outer-momentum")
    warmup_steps: int = knob(0, "the outer lr rises linearly over this many outer updates, 1/W, 2/W, ... of --outer-lr "
                             "(with --fragments, each fragment's update counts); 0 = none. Every peer must use the same",
                             flag="--outer-warmup-steps")

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"outer.lr must be > 0, got {self.lr}")
        _require(0 <= self.momentum < 1, f"outer.momentum must be in [0, 1), got {self.momentum}")
        _require(self.warmup_steps >= 0, f"outer.warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass(frozen=True)
class SwarmConfig:
    """How this peer finds and averages with the others (docs/networking.md, docs/security.md)."""

    run_id: str = knob("p2p-diloco", "name of the training run; peers with the same run id train together")
    initial_peers: tuple[str, ...] = knob((), "multiaddrs of peers already in the swarm; none: start a new swarm and "
                                          "print the address others join with", metavar="MULTIADDR")
    join_ready_file: str | None = knob(None, "join the peer whose --ready-file this is, once it is written (waiting at "
                                       "most startup_timeout_s): peers started together need no address first",
                                       metavar="PATH")
    host_maddrs: tuple[str, ...] = knob(("/ip4/0.0.0.0/tcp/0",), "where to listen (all interfaces, any free port)",
                                        metavar="MULTIADDR")
    announce_maddrs: tuple[str, ...] = knob((), "addresses to advertise to other peers, e.g. a public IP and port",
                                            metavar="MULTIADDR")
    identity_path: str | None = knob(None, "private key file that keeps the peer id across restarts (made if missing)",
                                     flag="--identity", metavar="PATH")
    compression: str = knob("int8", "outer gradient codec on the wire: none (fp32, 4 B/value), fp16 (2 B/value), int8 "
                            "(blockwise 8-bit, ~1 B/value), int4 (NF4 with error feedback, ~0.56 B/value), int2 (dense 2-bit with error "
                            "feedback, ~0.31 B/value), topk (3% of the values at 2 bits with error feedback, ~0.094 B/value)",
                            choices=COMPRESSIONS)
    reducer_feedback: bool = knob(True, "with int4, int2 or topk, each reducer also keeps what its re-encode of a "
                                  "part's average dropped and adds it to that part's average in the next round (only "
                                  "with --no-cross-check: under a cross-check the two reducers of a share must agree)")
    matchmaking_time_s: float = knob(5.0, "seconds a ready peer waits for others to join its averaging group")
    averaging_timeout_s: float = knob(60.0, "seconds after which a round's averaging is abandoned")
    chunk_timeout_s: float = knob(5.0, "seconds of silence after which a groupmate is dropped from an all-reduce")
    state_timeout_s: float = knob(60.0, "seconds allowed for one download of the swarm's state from a peer")
    progress_period_s: float = knob(2.0, "seconds between this peer's progress records near a round's end, while "
                                    "averaging, at start and after a peer joined (the others extrapolate a record's "
                                    "tokens at its rate in between); 1 s costs each peer ~15% more background CPU, "
                                    "5 s throughout split groups more often when a peer joined late")
    progress_idle_period_s: float = knob(0.0, "the same while the round's end is over 3 of these away and no peer "
                                         "joined lately (0: the larger of 5 s and progress_period_s)")
    progress_ttl_s: float = knob(20.0, "a peer whose progress record is older than this many seconds counts as gone")
    progress_transport: str = knob("push", "how progress records travel: push (straight to the peers this one knows; "
                                   "a DHT store and read every 10th period find peers not yet known; about a third of "
                                   "the bytes of dht in a swarm of 4) or dht (a DHT store and read every period)",
                                   choices=PROGRESS_TRANSPORTS)
    round_share_cap: float = knob(2.0, "a peer's tokens count towards a round's end at most this many times the "
                                  "median peer's (3 peers or more): publishing more than it trains shortens no round; "
                                  "0: no cap", metavar="X")
    startup_timeout_s: float = knob(60.0, "seconds allowed for joining the DHT at start")
    swarm_key_file: str | None = knob(None, "close the run: a file with a secret (>= 16 bytes) every member holds; only "
                                      "members store DHT records, average or download state (none: an open run)",
                                      metavar="PATH")
    allow_list_file: str | None = knob(None, "close the run to the public keys in this file, one per line as "
                                       "--show-identity prints them; needs --identity", flag="--allow-list",
                                       metavar="PATH")
    reachability: str = knob("auto", "how this peer takes part: direct (others dial it), relay (behind a NAT: reached "
                             "through a relay peer), client (dials out only: sends its outer gradient, reduces no "
                             "part); auto asks an initial peer to dial back", choices=REACHABILITY)
    relays: tuple[str, ...] = knob((), "relay peers for a peer behind a NAT (none: the initial peers)", flag="--relay",
                                   metavar="MULTIADDR")
    relay_service: bool = knob(True, "relay for peers behind a NAT when this peer is reachable (bounded by p2pd's limits)")
    relay_wait_s: float = knob(20.0, "seconds a peer in relay mode waits for its relay to carry a stranger's dial")
    cross_check: bool = knob(True, "average every share of each round twice, by two different reducers, and apply "
                             "it only where both agree: a lying reducer then fails rounds instead of steering them, "
                             "and is banned; --no-cross-check halves the averaging bytes and trusts every reducer "
                             "(every member of a group must set it alike)")
    p2pd_threads: int = knob(1, "threads p2pd runs Go code on (GOMAXPROCS): one carries a peer's traffic and costs a "
                             "busy machine less CPU than one per core (docs/benchmarks.md); 0: Go's default, or the "
                             "environment's GOMAXPROCS", metavar="N")
    background_nice: int = knob(5, "raise the nice value of this peer's background work (its DHT, averager and p2pd "
                                "processes, its progress and averaging threads) by this much, so that on a busy "
                                "machine the training goes first (0: leave it)", metavar="N")

    @property
    def idle_period_s(self) -> float:
        """The progress records' period while nothing is near (``progress_idle_period_s``, or its automatic value)."""
        return self.progress_idle_period_s or max(5.0, self.progress_period_s)

    def __post_init__(self) -> None:
        _require(
            bool(self.run_id) and all(c.isalnum() or c in "-_" for c in self.run_id),
            f"swarm.run_id must be non-empty letters, digits, '-' or '_', got {show(self.run_id)}",
        )
        _one_of("swarm", "compression", self.compression, COMPRESSIONS)
        _require(self.p2pd_threads >= 0, f"swarm.p2pd_threads must be >= 0, got {self.p2pd_threads}")
        _require(self.round_share_cap == 0 or 1 <= self.round_share_cap <= 1e6,
                 f"swarm.round_share_cap must be 0 (no cap) or in [1, 1e6], got {self.round_share_cap}")
        _require(0 <= self.background_nice <= 19, f"swarm.background_nice must be 0..19, got {self.background_nice}")
        for name in ("matchmaking_time_s", "averaging_timeout_s", "chunk_timeout_s", "state_timeout_s",
                     "progress_period_s", "progress_ttl_s", "startup_timeout_s", "relay_wait_s"):
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
        _one_of("swarm", "progress_transport", self.progress_transport, PROGRESS_TRANSPORTS)
        _one_of("swarm", "reachability", self.reachability, REACHABILITY)


@dataclass(frozen=True)
class RunConfig:
    """When to stop, where to write, how to seed, what to show."""

    max_outer_steps: int = knob(0, "stop after this many outer steps (0: no limit)")
    max_time_s: float = knob(0.0, "stop after this many seconds of wall time (0: no limit)")
    metrics_file: str | None = knob(None, "write one JSON record per outer step to this file", metavar="PATH")
    checkpoint_dir: str | None = knob(None, "write atomic checkpoints to this folder", metavar="PATH")
    checkpoint_every: int = knob(10, "outer steps between checkpoints (and one at shutdown)")
    resume: bool = knob(False, "start from the newest readable checkpoint in --checkpoint-dir (a corrupt one is "
                        "reported and the one before it used), then catch up with the swarm if it is ahead")
    eval_every: int = knob(0, "outer steps between held-out evaluations (0: as often as keeps them within 1% of the "
                           "training compute, and at the last outer step of a run with a step limit)")
    eval_batches: int = knob(4, "batches of the held-out tail per evaluation")
    eval_shared: bool = knob(True, "with --eval-every 0, take turns with the round's group at held-out evaluations: its "
                             "members hold the same global params, so one evaluates them for all, as often as one "
                             "peer alone would; off: every peer evaluates on its own")
    seed: int = knob(0, "model init seed, the same on every peer of a run; data order uses seed + shard")
    threads: int = knob(1, "torch CPU threads for this peer")
    device: str = knob("auto", "where a single-process peer trains: auto (a GPU if torch sees one, else the CPU), cpu, "
                       "cuda or cuda:N; a torchrun island takes one GPU per rank")
    island_sharding: str = knob("ddp", "how the ranks of a torchrun island hold the model: ddp (all of it on every "
                                "rank) or fsdp (each rank a shard of the params and inner AdamW state; rank 0 gathers "
                                "them for the outer step); fsdp needs 2 or more ranks", choices=ISLAND_SHARDINGS)
    shutdown_wait_s: float = knob(10.0, "at the end of a run, wait this long for an averaging in flight to land")
    straggler_wait_s: float = knob(20.0, "after max_outer_steps, keep serving state this long while a live peer is "
                                   "behind, so that it can catch up to the final state (0: leave at once)")
    start_at_unix: float = knob(0.0, "join the swarm, then wait until this wall-clock time (Unix seconds) before "
                                "training (0: at once)", flag="--start-at", metavar="UNIX_TIME")
    wait_for_peers: int = knob(0, "join the swarm, then wait until N peers (this one included) are in it before "
                               "training, so that peers launched together train together from the first round "
                               "(0: at once)", metavar="N")
    wait_for_peers_s: float = knob(120.0, "stop waiting for --wait-for-peers after this many seconds and start with "
                                   "whoever is there")
    ready_file: str | None = knob(None, "once in the swarm, write this peer's id and addresses here as JSON (for "
                                  "launchers and scripts)", metavar="PATH")
    tensorboard_dir: str | None = knob(None, "write TensorBoard scalars per outer step to DIR/<peer id> (needs the "
                                       "tensorboard extra)", flag="--tensorboard", metavar="DIR")
    monitor_port: int = knob(0, "serve a live web page of the swarm on this TCP port (0: none)", metavar="PORT")
    monitor_host: str = knob("127.0.0.1", "address the monitor page listens on (0.0.0.0: every interface; the page is "
                             "read-only)", metavar="HOST")

    def __post_init__(self) -> None:
        _require(self.max_outer_steps >= 0, f"run.max_outer_steps must be >= 0, got {self.max_outer_steps}")
        _require(self.max_time_s >= 0, f"run.max_time_s must be >= 0 seconds, got {self.max_time_s}")
        _require(self.checkpoint_every >= 1, f"run.checkpoint_every must be >= 1, got {self.checkpoint_every}")
        _require(not self.resume or bool(self.checkpoint_dir), "run.resume needs run.checkpoint_dir (--checkpoint-dir)")
        _require(self.eval_every >= 0, f"run.eval_every must be >= 0, got {self.eval_every}")
        _require(self.eval_batches >= 1, f"run.eval_batches must be >= 1, got {self.eval_batches}")
        # data order seeds torch generators with seed * 1_000_003 + batch index, which must fit in 64 bits
        _require(0 <= self.seed < 2**32, f"run.seed must be in [0, 2**32), got {self.seed}")
        _require(1 <= self.threads <= 1024, f"run.threads must be in [1, 1024], got {self.threads}")
        _require(
            self.device in ("auto", "cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit()),
            f"run.device must be auto, cpu, cuda or cuda:N, got {show(self.device)}",
        )
        _one_of("run", "island_sharding", self.island_sharding, ISLAND_SHARDINGS)
        _require(self.shutdown_wait_s >= 0, f"run.shutdown_wait_s must be >= 0 s, got {self.shutdown_wait_s}")
        _require(self.straggler_wait_s >= 0, f"run.straggler_wait_s must be >= 0 s, got {self.straggler_wait_s}")
        _require(0 <= self.monitor_port <= 65535, f"run.monitor_port must be a TCP port in [1, 65535] (0: no monitor), got {self.monitor_port}")
        _require(
            bool(self.monitor_host) and len(self.monitor_host) <= 255 and not any(c.isspace() for c in self.monitor_host),
            f"run.monitor_host must be a host name or IP address, got {show(self.monitor_host)}",
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

    def __post_init__(self) -> None:
        # Muon orthogonalizes whole matrices; an FSDP rank holds a shard of each
        _require(not (self.inner.optimizer == "muon" and self.run.island_sharding == "fsdp"),
                 "inner.optimizer muon needs whole matrices on every rank: use --island-sharding ddp")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTION_CLASSES: dict[str, type] = {f.name: f.default_factory for f in fields(PeerConfig)}  # type: ignore[misc]


def flag_of(spec: dataclasses.Field) -> str:
    """The command-line flag of a config field: its own, or ``--field-name``."""
    return spec.metadata.get("flag") or "--" + spec.name.replace("_", "-")
