"""A wide-area network on one machine: one network namespace per peer, capped links, kernel byte counts.

As root, ``Wan(peers=4, bandwidth_mbit=[20, 20, 5, 5])`` makes, for peer i:

    namespace PREFIX-i   eth side PREFIX-pi (address 10.77.SUBNET.(i+1)/24, tbf cap = the peer's upload)
         |  veth pair
    root namespace       host side PREFIX-hi (tbf cap = the peer's download), a port of bridge PREFIX-br

so every byte a peer sends or receives crosses its own capped link, and the host side's counters
(``/sys/class/net/PREFIX-hi/statistics``) give the bytes really put on the wire, headers and DHT traffic
included. Peers are started inside their namespace with ``ip netns exec`` (``command_prefix``) and listen
on the namespace's address (``host``).

``nat=[i, ...]`` puts those peers behind a home router of their own:

    namespace PREFIX-i   PREFIX-pi, private address 192.168.(i+1).2/24, default route via the router
         |  veth pair
    namespace PREFIX-ri  router: PREFIX-li 192.168.(i+1).1 on the LAN side, PREFIX-wi 10.77.SUBNET.(i+1) on the
         |  veth pair    internet side (tbf cap = the peer's upload); iptables MASQUERADE out, and inbound
    root namespace       PREFIX-hi on the bridge (tbf cap = download); connections not started from inside dropped

so the peer can dial anyone but nobody can dial it, like a volunteer's PC behind a home router. The rules
live inside the router's namespace and vanish with it: nothing is added to the root namespace's tables.

What it does not emulate: propagation delay and loss (``netem`` is not available on our machines; ``tbf``'s
``latency`` is only its queue limit). Everything it makes is named with its prefix; a set-up left by a
crashed run (same prefix) is removed, with any process still inside its namespaces, before a new one is made,
and ``down()`` checks that nothing is left. This module starts no peer and holds no training logic.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from p2p_diloco.cli.flags import OneLineParser, add_peer_flags, resolve_config
from p2p_diloco.cli.launch import SWARM_FLAGS, peer_args_without, run_swarm

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "p2pwan"
_COMMAND_TIMEOUT_S = 20.0


class WanError(RuntimeError):
    """The emulated network could not be made (not root, no ``ip``/``tc``, a kernel without namespaces...)."""


@dataclass(frozen=True)
class Link:
    """One peer's place in the emulated network."""

    index: int
    namespace: str
    host_interface: str  # in the root namespace, a port of the bridge
    peer_interface: str  # inside the peer's namespace
    address: str  # where the peer listens: its public address, or its private one behind a router
    bandwidth_mbit: float | None  # None: uncapped
    public_address: str = ""  # the address the rest of the network sees (the router's, behind a NAT)
    router: str | None = None  # the router's namespace, for a peer behind a NAT


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise WanError(f"{' '.join(command)}: {e}") from None
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise WanError(f"{' '.join(command)}: {detail[-1] if detail else f'exit code {done.returncode}'}")
    return done


def unavailable_reason(nat: bool = False) -> str | None:
    """Why network namespaces (and, with ``nat``, home routers) can't be made here (None if they can): tests
    skip with this reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command (iproute2) is not installed"
    if nat and shutil.which("iptables") is None:
        return "the 'iptables' command is not installed (Debian: apt-get install iptables)"
    probe = f"{DEFAULT_PREFIX}-probe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except WanError as e:
        return f"cannot create a network namespace: {e}"
    try:
        if nat:  # iptables' NAT table inside a namespace needs the kernel's nf_tables/NAT support
            _run("ip", "netns", "exec", probe, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "lo", "-j", "MASQUERADE")
    except WanError as e:
        return f"cannot add a NAT rule inside a network namespace: {e}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def install_iptables() -> str | None:
    """Install Debian's iptables package if it is missing (root, apt-get): the home routers need it. Returns
    what was done, for a person, or None if nothing was needed or possible (unavailable_reason says why)."""
    if shutil.which("iptables") or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return None
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "iptables"]):
        try:
            subprocess.run(command, capture_output=True, timeout=600, env=env, check=True)
        except (OSError, subprocess.SubprocessError) as e:
            return f"could not install iptables: {' '.join(command)}: {e}"
    return "installed Debian's iptables package (needed by the emulated home routers)"


def leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Namespaces and links in the root namespace whose names start with ``prefix-``."""
    names = []
    namespaces = _run("ip", "netns", "list", check=False).stdout.split("\n")
    names += [f"netns {line.split()[0]}" for line in namespaces if line.startswith(f"{prefix}-")]
    links = Path("/sys/class/net")
    names += [f"link {p.name}" for p in sorted(links.iterdir()) if p.name.startswith(f"{prefix}-")] if links.exists() else []
    return names


def clean(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove every namespace and link named ``prefix-*`` (SIGKILLing any process still inside those
    namespaces); returns what was removed. Used before a set-up (stale state of a crashed run) and by down()."""
    removed = leftovers(prefix)
    for name in removed:
        kind, value = name.split(" ", 1)
        if kind == "netns":
            pids = _run("ip", "netns", "pids", value, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run("ip", "netns", "del", value, check=False)
    for name in removed:  # host sides of veths go with their namespace's end; the bridge stays until deleted
        kind, value = name.split(" ", 1)
        if kind == "link" and Path(f"/sys/class/net/{value}").exists():
            _run("ip", "link", "del", value, check=False)
    return removed


class Wan:
    """The emulated network of one run; a context manager (``with Wan(...) as wan:``) that always tears down."""

    def __init__(
        self,
        peers: int,
        bandwidth_mbit: float | list[float | None] | None,
        prefix: str = DEFAULT_PREFIX,
        subnet: int = 77,
        burst_kbit: int = 512,
        queue_latency_ms: int = 100,
        nat: list[int] | tuple[int, ...] = (),
    ):
        caps = bandwidth_mbit if isinstance(bandwidth_mbit, list) else [bandwidth_mbit] * peers
        if len(caps) != peers:
            raise ValueError(f"{len(caps)} bandwidth caps given for {peers} peers: give one, or one per peer")
        if any(cap is not None and cap <= 0 for cap in caps):
            raise ValueError(f"bandwidth caps must be > 0 Mbit/s, got {caps}")
        if not 1 <= peers <= 250:
            raise ValueError(f"the emulated network holds 1 to 250 peers, got {peers}")
        if len(prefix) > 8 or not prefix.replace("-", "").isalnum():
            raise ValueError(f"prefix must be up to 8 letters or digits (interface names are short), got {prefix!r}")
        self.prefix, self.bridge = prefix, f"{prefix}-br"
        self.network = f"10.{subnet}.0"  # the emulated internet, a /24
        self.burst_kbit, self.queue_latency_ms = burst_kbit, queue_latency_ms
        bad = sorted(set(i for i in nat if not 0 <= i < peers))
        if bad:
            raise ValueError(f"--nat names peers {bad}, but peers are numbered 0 to {peers - 1}")
        if peers and len(set(nat)) == peers and peers > 1:
            logger.warning("every peer is behind a NAT: none can be dialled, so they can only meet through relays")
        self.links = [
            Link(i, f"{prefix}-{i}", f"{prefix}-h{i}", f"{prefix}-p{i}",
                 f"192.168.{i + 1}.2" if i in nat else f"{self.network}.{i + 1}", cap,
                 public_address=f"{self.network}.{i + 1}", router=f"{prefix}-r{i}" if i in nat else None)
            for i, cap in enumerate(caps)
        ]

    def __enter__(self) -> Wan:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Make the bridge, namespaces, veth pairs, addresses and caps; on any failure, remove what was made."""
        stale = clean(self.prefix)
        if stale:
            logger.warning("removed a stale emulated network left by an earlier run: %s", ", ".join(stale))
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "link", "set", self.bridge, "up")
            for link in self.links:
                if link.router:
                    self._add_behind_nat(link)
                else:
                    self._add(link)
        except BaseException:
            clean(self.prefix)
            raise

    def _add(self, link: Link) -> None:
        ns = ("ip", "-n", link.namespace)
        _run("ip", "netns", "add", link.namespace)
        _run("ip", "link", "add", link.host_interface, "type", "veth", "peer", "name", link.peer_interface)
        _run("ip", "link", "set", link.peer_interface, "netns", link.namespace)
        _run("ip", "link", "set", link.host_interface, "master", self.bridge, "up")
        _run(*ns, "addr", "add", f"{link.address}/24", "dev", link.peer_interface)
        _run(*ns, "link", "set", link.peer_interface, "up")
        _run(*ns, "link", "set", "lo", "up")
        if link.bandwidth_mbit is not None:
            tbf = ("root", "tbf", "rate", f"{link.bandwidth_mbit}mbit", "burst", f"{self.burst_kbit}kbit",
                   "latency", f"{self.queue_latency_ms}ms")
            _run("tc", "-n", link.namespace, "qdisc", "add", "dev", link.peer_interface, *tbf)  # upload
            _run("tc", "qdisc", "add", "dev", link.host_interface, *tbf)  # download

    def _add_behind_nat(self, link: Link) -> None:
        router, lan, wan_side = link.router, f"{self.prefix}-l{link.index}", f"{self.prefix}-w{link.index}"
        gateway = link.address.rsplit(".", 1)[0] + ".1"
        in_router = ("ip", "netns", "exec", router)
        _run("ip", "netns", "add", router)
        _run("ip", "netns", "add", link.namespace)
        # the router's internet side: a port of the bridge, like a public peer's link
        _run("ip", "link", "add", link.host_interface, "type", "veth", "peer", "name", wan_side)
        _run("ip", "link", "set", wan_side, "netns", router)
        _run("ip", "link", "set", link.host_interface, "master", self.bridge, "up")
        _run("ip", "-n", router, "addr", "add", f"{link.public_address}/24", "dev", wan_side)
        _run("ip", "-n", router, "link", "set", wan_side, "up")
        # the home network: router <-> the peer's machine
        _run("ip", "-n", router, "link", "add", lan, "type", "veth", "peer", "name", link.peer_interface)
        _run("ip", "-n", router, "link", "set", link.peer_interface, "netns", link.namespace)
        _run("ip", "-n", router, "addr", "add", f"{gateway}/24", "dev", lan)
        _run("ip", "-n", router, "link", "set", lan, "up")
        _run("ip", "-n", router, "link", "set", "lo", "up")
        _run("ip", "-n", link.namespace, "addr", "add", f"{link.address}/24", "dev", link.peer_interface)
        _run("ip", "-n", link.namespace, "link", "set", link.peer_interface, "up")
        _run("ip", "-n", link.namespace, "link", "set", "lo", "up")
        _run("ip", "-n", link.namespace, "route", "add", "default", "via", gateway)
        # forward, rewrite outgoing connections to the router's address, let only their replies back in
        _run(*in_router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _run(*in_router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", wan_side, "-j", "MASQUERADE")
        _run(*in_router, "iptables", "-A", "FORWARD", "-i", wan_side, "-o", lan, "-m", "conntrack",
             "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _run(*in_router, "iptables", "-A", "FORWARD", "-i", wan_side, "-j", "DROP")
        _run(*in_router, "iptables", "-A", "INPUT", "-i", wan_side, "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP")
        if link.bandwidth_mbit is not None:
            tbf = ("root", "tbf", "rate", f"{link.bandwidth_mbit}mbit", "burst", f"{self.burst_kbit}kbit",
                   "latency", f"{self.queue_latency_ms}ms")
            _run("tc", "-n", router, "qdisc", "add", "dev", wan_side, *tbf)  # upload, to the internet
            _run("tc", "qdisc", "add", "dev", link.host_interface, *tbf)  # download

    def down(self) -> None:
        """Remove everything this network made; raise WanError if something could not be removed."""
        clean(self.prefix)
        left = leftovers(self.prefix)
        if left:
            raise WanError(f"could not remove: {', '.join(left)}")

    def command_prefix(self, index: int) -> list[str]:
        """What to put before a command to run it inside peer ``index``'s namespace."""
        return ["ip", "netns", "exec", self.links[index].namespace]

    def host(self, index: int) -> str:
        return self.links[index].address

    def wire_bytes(self, index: int) -> tuple[int, int]:
        """(bytes sent, bytes received) by peer ``index`` on its link, from the kernel's counters; the host
        side receives what the peer sends. Counters start at 0 when the link is made."""
        stats = Path(f"/sys/class/net/{self.links[index].host_interface}/statistics")
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def describe(self) -> list[dict]:
        return [dict(peer=link.index, namespace=link.namespace, address=link.address,
                     bandwidth_mbit=link.bandwidth_mbit, behind_nat=link.router is not None,
                     public_address=link.public_address) for link in self.links]


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return 2


def wan_main(argv: list[str] | None = None, prog: str = "wan.py") -> int:
    """``swarm.py`` with each peer in its own network namespace behind a capped link (needs root)."""
    parser = OneLineParser(prog=prog, description="Run a local p2p-diloco swarm over an emulated wide-area network: "
                            "one network namespace per peer, a bandwidth cap per peer, bytes counted by the kernel.")
    parser.add_argument("--peers", type=int, default=4, help="number of peer processes (default 4)")
    parser.add_argument("--out", default="runs/wan", help="folder for metrics, logs, report.json and report.png")
    parser.add_argument("--bandwidth-mbit", type=float, nargs="+", default=[20.0], metavar="MBIT",
                        help="cap of each peer's link, each way: one value for all peers, or one per peer (default 20)")
    parser.add_argument("--nat", type=int, nargs="+", default=[], metavar="PEER",
                        help="put these peers (numbered from 0) each behind its own home router: private address, "
                        "outgoing connections masqueraded, incoming ones dropped")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"name prefix of the namespaces and links (default {DEFAULT_PREFIX})")
    parser.add_argument("--cleanup", action="store_true", help="only remove an emulated network a crashed run left behind, then exit")
    parser.add_argument("--config", metavar="FILE", help="TOML config passed to every peer")
    add_peer_flags(parser)
    args = parser.parse_args(argv)
    if args.cleanup:
        removed = clean(args.prefix)
        print(f"removed: {', '.join(removed)}" if removed else "nothing to remove", flush=True)
        return 0
    caps = args.bandwidth_mbit if len(args.bandwidth_mbit) > 1 else args.bandwidth_mbit[0]
    try:
        resolve_config(args)
        wan = Wan(args.peers, caps, prefix=args.prefix, nat=args.nat)
    except ValueError as e:
        return _fail(prog, str(e))
    installed = install_iptables() if args.nat else None
    if installed:
        print(installed, flush=True)
    reason = unavailable_reason(nat=bool(args.nat))
    if reason:
        return _fail(prog, reason)
    peer_args = peer_args_without(argv or [], SWARM_FLAGS | {"--bandwidth-mbit", "--prefix", "--cleanup", "--nat"})
    if not any(a.startswith("--max-time-s") or a.startswith("--max-outer-steps") for a in peer_args):
        peer_args += ["--max-time-s", "180"]
    args.late_peers = 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with wan:
            behind = f", peers {args.nat} behind their own NAT" if args.nat else ""
            print(f"emulated network up: {args.peers} namespaces, caps {caps} Mbit/s each way{behind}", flush=True)
            return run_swarm(args, peer_args, out_dir, prog, wan=wan)
    except WanError as e:
        return _fail(prog, str(e))
