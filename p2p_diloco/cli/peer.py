"""Command line: ``p2p-diloco peer`` (one learner island) and ``p2p-diloco swarm`` (a local swarm).

Precedence: defaults -> ``--config`` TOML file -> flags. Bad input ends with one line on stderr and a
non-zero exit, never a traceback. Everything the peer prints a person reads is printed here.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from p2p_diloco.core.config import (
    COMPRESSIONS,
    ISLAND_SHARDINGS,
    PRECISIONS,
    PROGRESS_TRANSPORTS,
    REACHABILITY,
    PeerConfig,
    build_config,
    load_toml,
)

if TYPE_CHECKING:  # torch-heavy modules load only when a process starts training, not for --help
    from p2p_diloco.observe.metrics import MetricsSink
    from p2p_diloco.train.data import DataSource
    from p2p_diloco.train.island import Island

# flag -> (section, field)
_FLAG_FIELDS = {
    "run_id": ("swarm", "run_id"),
    "initial_peers": ("swarm", "initial_peers"),
    "host_maddrs": ("swarm", "host_maddrs"),
    "announce_maddrs": ("swarm", "announce_maddrs"),
    "identity": ("swarm", "identity_path"),
    "compression": ("swarm", "compression"),
    "matchmaking_time_s": ("swarm", "matchmaking_time_s"),
    "averaging_timeout_s": ("swarm", "averaging_timeout_s"),
    "chunk_timeout_s": ("swarm", "chunk_timeout_s"),
    "state_timeout_s": ("swarm", "state_timeout_s"),
    "inner_steps": ("inner", "inner_steps"),
    "tokens_per_round": ("inner", "tokens_per_round"),
    "round_deadline_s": ("inner", "round_deadline_s"),
    "throttle": ("inner", "throttle"),
    "fragments": ("inner", "fragments"),
    "precision": ("inner", "precision"),
    "device": ("run", "device"),
    "batch_size": ("inner", "batch_size"),
    "inner_lr": ("inner", "lr"),
    "outer_lr": ("outer", "lr"),
    "outer_momentum": ("outer", "momentum"),
    "seq_len": ("model", "seq_len"),
    "n_layers": ("model", "n_layers"),
    "d_model": ("model", "d_model"),
    "n_heads": ("model", "n_heads"),
    "corpus_dir": ("data", "corpus_dir"),
    "dataset": ("data", "dataset"),
    "text_field": ("data", "text_field"),
    "tokenizer": ("data", "tokenizer"),
    "data_cache_dir": ("data", "cache_dir"),
    "model_config": ("model", "hf_config"),
    "init_from": ("model", "init_from"),
    "vocab_size": ("model", "vocab_size"),
    "shard_index": ("data", "shard_index"),
    "num_shards": ("data", "num_shards"),
    "max_outer_steps": ("run", "max_outer_steps"),
    "max_time_s": ("run", "max_time_s"),
    "metrics_file": ("run", "metrics_file"),
    "checkpoint_dir": ("run", "checkpoint_dir"),
    "checkpoint_every": ("run", "checkpoint_every"),
    "resume": ("run", "resume"),
    "eval_every": ("run", "eval_every"),
    "seed": ("run", "seed"),
    "threads": ("run", "threads"),
    "island_sharding": ("run", "island_sharding"),
    "start_at": ("run", "start_at_unix"),
    "wait_for_peers": ("run", "wait_for_peers"),
    "wait_for_peers_s": ("run", "wait_for_peers_s"),
    "ready_file": ("run", "ready_file"),
    "tensorboard": ("run", "tensorboard_dir"),
    "monitor_port": ("run", "monitor_port"),
    "monitor_host": ("run", "monitor_host"),
    "progress_period_s": ("swarm", "progress_period_s"),
    "progress_idle_period_s": ("swarm", "progress_idle_period_s"),
    "progress_transport": ("swarm", "progress_transport"),
    "swarm_key_file": ("swarm", "swarm_key_file"),
    "allow_list": ("swarm", "allow_list_file"),
    "reachability": ("swarm", "reachability"),
    "relay": ("swarm", "relays"),
    "relay_service": ("swarm", "relay_service"),
    "relay_wait_s": ("swarm", "relay_wait_s"),
}


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints the whole usage; a person needs the reason
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def add_peer_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of one learner island (also accepted by the local swarm launcher, passed to every peer)."""
    d = PeerConfig()
    s = argparse.SUPPRESS
    swarm = parser.add_argument_group("swarm")
    swarm.add_argument("--run-id", default=s, help=f"name of the training run; peers with the same id train together (default {d.swarm.run_id})")
    swarm.add_argument("--initial-peers", nargs="+", default=s, metavar="MULTIADDR", help="multiaddrs of peers already in the swarm; omit to start a new swarm and print the address others should use")
    swarm.add_argument("--host-maddrs", nargs="+", default=s, metavar="MULTIADDR", help="where to listen (default /ip4/0.0.0.0/tcp/0: all interfaces, any free port)")
    swarm.add_argument("--announce-maddrs", nargs="+", default=s, metavar="MULTIADDR", help="addresses to advertise to other peers, e.g. your public IP and port")
    swarm.add_argument("--identity", default=s, metavar="PATH", help="private key file that makes the peer id stable across restarts (created if missing)")
    swarm.add_argument("--compression", choices=COMPRESSIONS, default=s, help=f"outer gradient codec on the wire: none (fp32, 4 B/value), fp16 (2 B/value), int8 (blockwise 8-bit, ~1 B/value), int4 (NF4 with error feedback, ~0.56 B/value) (default {d.swarm.compression})")
    swarm.add_argument("--matchmaking-time-s", type=float, default=s, help=f"seconds a ready peer waits for others to join its averaging group (default {d.swarm.matchmaking_time_s})")
    swarm.add_argument("--averaging-timeout-s", type=float, default=s, help=f"seconds after which a round's averaging is abandoned (default {d.swarm.averaging_timeout_s})")
    swarm.add_argument("--chunk-timeout-s", type=float, default=s, help=f"seconds of silence after which a groupmate is dropped from an all-reduce (default {d.swarm.chunk_timeout_s})")
    swarm.add_argument("--state-timeout-s", type=float, default=s, help=f"seconds allowed for downloading the swarm's state (default {d.swarm.state_timeout_s})")
    swarm.add_argument("--progress-period-s", type=float, default=s, help=f"seconds between this peer's progress records in the DHT near a round's end, while averaging, at start and after a peer joined; shorter tracks round ends more closely at more background traffic (default {d.swarm.progress_period_s})")
    swarm.add_argument("--progress-idle-period-s", type=float, default=s, help="the same while the round's end is more than 3 of these away and no peer joined lately; equal to --progress-period-s for a constant period (default: the larger of 5 s and --progress-period-s)")
    swarm.add_argument("--progress-transport", choices=PROGRESS_TRANSPORTS, default=s, help=f"how progress records travel: dht (a DHT store and read every period) or push (opt-in: straight to the peers this one knows, read from what they pushed; a DHT store and read every 10th period find peers not yet known; about a third of the bytes in a swarm of 4); a client-mode peer takes no pushes: it reads from the DHT (default {d.swarm.progress_transport})")
    swarm.add_argument("--swarm-key-file", default=s, metavar="PATH", help="close the run: a file with a secret (>= 16 bytes) that every member holds; only members can store DHT records, average or download state (default: an open run)")
    swarm.add_argument("--allow-list", default=s, metavar="PATH", help="close the run to the public keys listed in this file (one per line, as --show-identity prints them); only listed peers can store DHT records, average or download state; needs --identity")
    swarm.add_argument("--reachability", choices=REACHABILITY, default=s, help="how this peer takes part: direct (others can dial it), relay (behind a NAT or firewall: reachable through a relay peer), client (dial out only: sends its outer gradient and receives the average, reduces no part); auto asks an initial peer to dial back: direct if it gets through, else client (default auto)")
    swarm.add_argument("--relay", nargs="+", default=s, metavar="MULTIADDR", help="relay peers to use when behind a NAT (default: the initial peers)")
    swarm.add_argument("--relay-service", action=argparse.BooleanOptionalAction, default=s, help="relay for peers behind a NAT when this peer is reachable; --no-relay-service refuses (default on)")
    swarm.add_argument("--relay-wait-s", type=float, default=s, help=f"seconds a peer in relay mode waits for its relay to carry a stranger's dial to it before it reports none (default {d.swarm.relay_wait_s})")
    train = parser.add_argument_group("training")
    train.add_argument("--inner-steps", type=int, default=s, metavar="H", help=f"inner AdamW steps per peer per outer round at equal speeds; sets the default round budget (default {d.inner.inner_steps})")
    train.add_argument("--tokens-per-round", type=int, default=s, help="tokens the whole swarm processes per outer round (default 0: H x batch tokens x live peers); a fast peer simply contributes more of them")
    train.add_argument("--round-deadline-s", type=float, default=s, help="a round ends at the latest this many seconds after it began (default 0: none)")
    train.add_argument("--throttle", type=float, default=s, help="slow this peer's inner steps F-fold by sleeping, to emulate older hardware (default 1)")
    train.add_argument("--fragments", type=int, default=s, metavar="P", help="streaming: split the parameters into P fragments averaged at staggered times, one per 1/P of a round, so each burst is ~P times smaller (default 1)")
    train.add_argument("--precision", choices=PRECISIONS, default=s, help="arithmetic of the inner steps: bf16 autocast or fp32; auto is bf16 on a GPU and fp32 on a CPU; params, outer gradients and everything shared stay fp32 (default auto)")
    train.add_argument("--batch-size", type=int, default=s, help=f"sequences per inner step (default {d.inner.batch_size})")
    train.add_argument("--seq-len", type=int, default=s, help=f"tokens (bytes) per sequence (default {d.model.seq_len})")
    train.add_argument("--inner-lr", type=float, default=s, help=f"AdamW learning rate (default {d.inner.lr})")
    train.add_argument("--outer-lr", type=float, default=s, help=f"outer Nesterov SGD learning rate (default {d.outer.lr})")
    train.add_argument("--outer-momentum", type=float, default=s, help=f"outer Nesterov momentum, 0 for plain SGD (default {d.outer.momentum})")
    train.add_argument("--n-layers", type=int, default=s, help=f"transformer blocks of the built-in model (default {d.model.n_layers})")
    train.add_argument("--d-model", type=int, default=s, help=f"width of the built-in model (default {d.model.d_model})")
    train.add_argument("--n-heads", type=int, default=s, help=f"attention heads of the built-in model (default {d.model.n_heads})")
    train.add_argument("--vocab-size", type=int, default=s, help=f"token embeddings of the built-in model; must cover the tokenizer's vocabulary (default {d.model.vocab_size}: bytes)")
    train.add_argument("--model-config", default=s, metavar="CONFIG_JSON", help="train a Hugging Face transformers causal LM described by this local config.json from scratch (seeded init, the same on every peer) instead of the built-in model")
    train.add_argument("--init-from", default=s, metavar="DIR", help="start from the transformers causal LM saved in this local folder (save_pretrained: config.json and weights)")
    train.add_argument("--corpus-dir", default=s, metavar="PATH", help="folder of text files to train on, read as bytes (default: the Python standard library's sources)")
    train.add_argument("--dataset", nargs="+", default=s, metavar="PATH", help="text (.txt .md), JSONL (.jsonl .json) or parquet files, or folders of them, read through Hugging Face datasets: one document per line or row")
    train.add_argument("--text-field", default=s, help=f"the column of JSONL and parquet files that holds the text (default {d.data.text_field})")
    train.add_argument("--tokenizer", default=s, metavar="TOKENIZER_JSON", help="a tokenizers file for --dataset (default: UTF-8 bytes, 256 tokens)")
    train.add_argument("--data-cache-dir", default=s, metavar="PATH", help="where datasets keeps --dataset's memory-mapped Arrow files (default: its own cache, ~/.cache/huggingface/datasets)")
    train.add_argument("--shard-index", type=int, default=s, help="which shard of the training data this peer reads (default 0)")
    train.add_argument("--num-shards", type=int, default=s, help="into how many shards the training data is split (default 1)")
    train.add_argument("--seed", type=int, default=s, help="model init seed, the same on every peer of a run (default 0)")
    run = parser.add_argument_group("run")
    run.add_argument("--max-outer-steps", type=int, default=s, help="stop after this many outer steps (default 0: no limit)")
    run.add_argument("--max-time-s", type=float, default=s, help="stop after this many seconds of wall time (default 0: no limit)")
    run.add_argument("--metrics-file", default=s, metavar="PATH", help="write one JSON record per outer step to this file")
    run.add_argument("--checkpoint-dir", default=s, metavar="PATH", help="write atomic checkpoints to this folder")
    run.add_argument("--checkpoint-every", type=int, default=s, help=f"outer steps between checkpoints (default {d.run.checkpoint_every})")
    run.add_argument("--resume", action="store_true", default=s, help="start from the newest readable checkpoint in --checkpoint-dir (a corrupt one is reported and the one before it used), then catch up with the swarm if it is ahead")
    run.add_argument("--eval-every", type=int, default=s, help=f"outer steps between held-out evaluations (default {d.run.eval_every})")
    run.add_argument("--device", default=s, help="where a single-process peer trains: auto (a GPU if torch sees one, else the CPU), cpu, cuda or cuda:N; a torchrun island takes one GPU per rank (default auto)")
    run.add_argument("--threads", type=int, default=s, help=f"torch CPU threads for this peer (default {d.run.threads})")
    run.add_argument("--island-sharding", choices=ISLAND_SHARDINGS, default=s, help="how the ranks of a torchrun island hold the model: ddp (all of it on every rank) or fsdp (each rank a shard of the params and inner AdamW state; rank 0 gathers the full local params for the outer step and scatters the result back); fsdp needs torchrun with 2 or more ranks (default ddp)")
    run.add_argument("--tensorboard", default=s, metavar="DIR", help="write TensorBoard scalars per outer step (loss, tokens/s, group size, bytes, blocked time) to DIR/<peer id> (needs the tensorboard package)")
    run.add_argument("--monitor-port", type=int, default=s, metavar="PORT", help="serve a live web page of the swarm (peers, outer steps, throughput, bytes, loss chart) on this port (default 0: none)")
    run.add_argument("--monitor-host", default=s, metavar="HOST", help=f"address the monitor page listens on (default {d.run.monitor_host}: this machine only; 0.0.0.0 for every interface)")
    run.add_argument("--start-at", type=float, default=s, metavar="UNIX_TIME", help="join the swarm, then wait until this wall-clock time (Unix seconds) before training, so that peers launched together start together (default: at once)")
    run.add_argument("--wait-for-peers", type=int, default=s, metavar="N", help="join the swarm, then wait until N peers (this one included) are in it before training, so that peers launched together train together from the first round (default 0: at once)")
    run.add_argument("--wait-for-peers-s", type=float, default=s, help=f"stop waiting for --wait-for-peers after this many seconds and start with whoever is there (default {d.run.wait_for_peers_s:g})")
    run.add_argument("--ready-file", default=s, metavar="PATH", help="once in the swarm, write this peer's id and addresses to PATH as JSON (for launchers and scripts)")


def resolve_config(args: argparse.Namespace) -> PeerConfig:
    """defaults -> TOML file -> flags; raises ValueError with a one-line reason."""
    overrides: dict[str, dict[str, Any]] = load_toml(args.config) if getattr(args, "config", None) else {}
    overrides = {section: dict(values) for section, values in overrides.items()}
    for flag, (section, field) in _FLAG_FIELDS.items():
        if flag in vars(args):
            value = getattr(args, flag)
            overrides.setdefault(section, {})[field] = tuple(value) if isinstance(value, list) else value
    config = build_config(overrides)
    # torch and hivemind load only now: a mistyped value is reported at once, not after seconds of imports
    from p2p_diloco.cli.preflight import check_local_inputs
    from p2p_diloco.swarm.swarm_link import check_multiaddr

    for address in config.swarm.initial_peers + config.swarm.relays:
        check_multiaddr(address, need_peer_id=True)
    for address in config.swarm.host_maddrs + config.swarm.announce_maddrs:
        check_multiaddr(address, need_peer_id=False)
    check_local_inputs(config)  # identity file, checkpoint folder, metrics file, memory: before anything starts
    return config


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if level != "DEBUG":
        for handler in logging.getLogger().handlers:
            handler.addFilter(_drop_hivemind_tracebacks)
    from p2p_diloco.swarm.hivemind_api import route_logs

    route_logs(debug=level == "DEBUG")  # hivemind's records through the root handler above


def _drop_hivemind_tracebacks(record: logging.LogRecord) -> bool:
    """hivemind logs a full traceback for every failed round; one line is enough outside DEBUG."""
    if record.name.startswith("hivemind"):
        record.exc_info, record.exc_text = None, None
    return True


def peer_main(argv: list[str] | None = None, prog: str = "p2p-diloco peer", link_class: type | None = None) -> int:
    """One learner island; ``link_class`` replaces the swarm link (a test's misbehaving peer: experiments/)."""
    parser = OneLineParser(prog=prog, description="Run one p2p-diloco learner island.")
    parser.add_argument("--config", metavar="FILE", help="TOML file with [model] [data] [inner] [outer] [swarm] [run] sections; flags override it")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="log verbosity on stderr (default INFO)")
    parser.add_argument("--show-identity", action="store_true", help="print the public key and peer id of --identity PATH (made first if missing), the line to put on a closed run's --allow-list, and exit")
    add_peer_flags(parser)
    args = parser.parse_args(argv)
    if args.show_identity:
        return _show_identity(getattr(args, "identity", None), prog)
    try:
        config = resolve_config(args)
    except ValueError as e:
        return fail(prog, str(e))
    configure_logging(args.log_level)
    # a native crash (torch, gloo, bitsandbytes) prints every thread's Python stack before the process dies:
    # the one clue a volunteer's log or a CI run keeps of where it happened
    try:
        faulthandler.enable(file=sys.__stderr__)
    except (AttributeError, OSError, ValueError):  # no stderr with a file descriptor (a test capturing it)
        pass
    return _run_peer(config, prog, link_class)


def _show_identity(path: str | None, prog: str) -> int:
    """Prints ``<public key>  # peer <peer id>``: one line of an allow-list."""
    if not path:
        return fail(prog, "--show-identity needs --identity PATH (the key file to show, made if missing)")
    from p2p_diloco.cli.preflight import check_identity_file
    from p2p_diloco.swarm.membership import load_identity

    try:
        check_identity_file(Path(path))
        identity = load_identity(path)
    except ValueError as e:
        return fail(prog, str(e))
    print(f"{identity.public_key}  # peer {identity.peer_id}", flush=True)
    return 0


def fail(prog: str, message: str, code: int = 2) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return code


def open_process_inputs(config: PeerConfig, island: Island | None = None) -> tuple[DataSource, MetricsSink]:
    """What every training process of a run opens first, the same way (a peer, and the benchmark's baselines,
    which must read the same shard as a peer would): torch's thread count, the data shard (this rank's part of
    it in a multi-rank island) and the metrics sink (none but on rank 0). Raises ValueError or OSError with a
    one-line reason."""
    import torch

    from p2p_diloco.observe.metrics import NullSink, open_sink
    from p2p_diloco.train.data import open_dataset

    torch.set_num_threads(config.run.threads)
    data = island.shard(config.data) if island else config.data
    dataset = open_dataset(data, config.model.seq_len, config.inner.batch_size, config.run.seed)
    if island and not island.is_leader:
        return dataset, NullSink()
    return dataset, open_sink(config.run.metrics_file, config.run.tensorboard_dir)


def _start_island(config: PeerConfig) -> Island:
    """This process's island: the torchrun ranks of the environment (RANK, WORLD_SIZE), or a single process."""
    from p2p_diloco.train import island

    return island.Island.from_environment(os.environ, island.collective_timeout_s(config), config.run.island_sharding,
                                          device=config.run.device, precision=config.inner.precision)


_FOLLOWER_GRACE_S = 10.0  # beyond rank 0's own shutdown wait; under torchrun's 30 s before it SIGKILLs


def _leave_unless_stopped(rank: int, deadline_s: float) -> None:
    """On SIGTERM or SIGINT a follower waits for rank 0's stop (it comes within one inner step and rank 0's
    settling); past ``deadline_s`` rank 0 is taken for gone and the process leaves. torchrun signals the other
    ranks when rank 0 dies, but rank 0's forked swarm processes keep its sockets open, so a collective would
    otherwise wait for its full timeout."""
    logging.getLogger("p2p_diloco.peer").info("rank %d stops when rank 0 does (at most %.0f s from now)", rank, deadline_s)

    def leave() -> None:
        print(f"island rank {rank}: rank 0 did not stop the island within {deadline_s:.0f} s; leaving", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(deadline_s, leave)
    timer.daemon = True
    timer.start()


def _follow(config: PeerConfig, island: Island, prog: str) -> int:
    """A rank other than 0 of a torchrun island: train in step with rank 0 until it stops; no swarm, no files."""
    from p2p_diloco.train.learner import Learner

    stop = threading.Event()  # ends a wait for the agreed start time; the training stops when rank 0 says so

    def request_stop(*_: object) -> None:
        stop.set()
        _leave_unless_stopped(island.rank, config.run.shutdown_wait_s + _FOLLOWER_GRACE_S)

    for signum in (signal.SIGINT, signal.SIGTERM):  # torchrun and Ctrl-C signal every rank
        signal.signal(signum, request_stop)
    try:
        dataset, metrics = open_process_inputs(config, island)
        Learner(config, dataset, metrics, stop, island).follow()
        code = 0
    except (ValueError, OSError) as e:
        code = fail(prog, f"island rank {island.rank}: {e}")
    except Exception as e:  # rank 0 went away (its socket closed) or a collective timed out: the island is over
        code = fail(prog, f"island rank {island.rank} stopped: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}", code=1)
    finally:
        island.close()
    if code == 0:
        print(f"island rank {island.rank} stopped", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # as rank 0 does: nothing is left to save, and the interpreter's teardown would run torch's C++ destructors
    # (the DDP reducer, the process group's threads) for nothing. Once in CI a rank died of SIGABRT as the island
    # ended, where exactly is not known (the log kept no stack: faulthandler now prints one); this removes the
    # teardown from the places it could have been
    os._exit(code)


def _run_peer(config: PeerConfig, prog: str, link_class: type | None = None) -> int:
    from p2p_diloco.cli.ready import write_ready_file
    from p2p_diloco.observe.display import TerminalProgress
    from p2p_diloco.observe.metrics import FanOutSink
    from p2p_diloco.observe.monitor import MonitorServer
    from p2p_diloco.observe.watch import SwarmWatch
    from p2p_diloco.swarm.joining import SwarmStartError
    from p2p_diloco.swarm.processes import reap_descendants
    from p2p_diloco.swarm.swarm_link import SwarmLink
    from p2p_diloco.train.learner import Learner
    from p2p_diloco.train.model import count_parameters

    log = logging.getLogger("p2p_diloco.peer")
    try:
        island = _start_island(config)
    except ValueError as e:  # --island-sharding fsdp without torchrun, say
        return fail(prog, str(e))
    if not island.is_leader:
        return _follow(config, island, prog)
    try:
        dataset, metrics = open_process_inputs(config, island)
    except (ValueError, OSError) as e:
        return fail(prog, str(e))
    # what people watching see: the swarm as this peer knows it, in the terminal and (optionally) a web page
    watch = SwarmWatch(config.swarm.run_id)
    progress = TerminalProgress(watch)
    metrics = FanOutSink([metrics, watch, progress])
    stop = threading.Event()
    try:
        learner = Learner(config, dataset, metrics, stop, island)
        resumed = learner.resume() if config.run.resume else None
    except ValueError as e:
        metrics.close()
        return fail(prog, str(e))
    if config.run.resume:
        print(f"resumed from {resumed} at outer step {learner.outer_step}" if resumed
              else f"no checkpoint in {config.run.checkpoint_dir} yet: starting fresh", flush=True)
    log.info("resolved config: %s", json.dumps(config.to_dict(), sort_keys=True))
    import torch

    log.info("torch %s on %s, inner steps in %s: CPU kernels %s, %d threads", torch.__version__, island.device,
             island.inner_precision, torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())
    try:
        link = (link_class or SwarmLink)(config.swarm, learner.averaging_template(), learner.state_for_peers,
                                         config.inner.fragments)
    except SwarmStartError as e:
        metrics.close()
        return fail(prog, f"could not join the swarm: {e}", code=1)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    monitor = None
    try:
        if config.run.monitor_port:  # after the link: the forked DHT and averager processes must not inherit the socket
            try:
                monitor = MonitorServer(watch, config.run.monitor_host, config.run.monitor_port)
            except OSError as e:
                host, port = config.run.monitor_host, config.run.monitor_port
                return fail(prog, f"cannot serve the monitor on {host}:{port}: {e.strerror or e}")
        addresses = " ".join(a for a in link.visible_maddrs() if "/127." not in a) or " ".join(link.visible_maddrs())
        print(f"peer {link.peer_id} in run '{config.swarm.run_id}': {count_parameters(learner.model):,} parameters, "
              f"{dataset.total_bytes / 1e6:.1f} MB of data", flush=True)
        print(link.reachability.line, flush=True)
        if link.reachability.mode == "relay":  # dialled through its relay
            addresses = " ".join(a for a in link.visible_maddrs() if "/p2p-circuit" in a) or addresses
        join_address = addresses.split()[0] if addresses and link.reachability.mode != "client" else None
        if join_address is not None:
            print(f"others can join with: --initial-peers {join_address}", flush=True)
        print(f"all addresses: {' '.join(link.visible_maddrs())}", flush=True)
        if config.run.ready_file:
            write_ready_file(config.run.ready_file, link.peer_id, join_address, link.visible_maddrs())
        watch.start(link.progress_records, self_id=link.peer_id)
        if monitor is not None:
            print(f"swarm monitor: {monitor.url}", flush=True)
        progress.start()
        learner.run(link)
    finally:
        metrics.close()  # the watch and the live display too: what follows prints below the table
        if monitor is not None:
            monitor.close()
        link.close()
        island.close()
        # this program owns its children: p2pd and anything else a killed child orphaned go with it
        reap_descendants()
    print(f"peer {link.peer_id} stopped at outer step {learner.outer_step}", flush=True)
    sys.stderr.flush()
    # everything is saved and closed; an abandoned averaging thread stuck in hivemind must not keep the
    # process alive at interpreter exit (it would outlive the launcher's grace period and be SIGKILLed)
    os._exit(0)
