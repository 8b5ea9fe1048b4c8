"""Bandwidth calculator: the bits per second each island sends, data parallel against (streaming) DiLoCo.

Data parallel exchanges the whole gradient every inner step; DiLoCo exchanges an outer gradient once per
round of H inner steps; streaming DiLoCo sends it as P fragments, one every H/P inner steps, each allowed to
take ``overlap_steps`` inner steps before the training loop has to wait for it.

The accounting, stated because published figures rarely state theirs:

- *all-reduce* (ring, or hivemind's butterfly) among g islands: each sends 2 (g - 1) / g times the data and
  receives as much; *syncer* (a central merge point, the Decoupled DiLoCo report's design): each island sends
  its data once and receives the result once (the syncer's own links are not counted).
- *sustained*: the bits of one round / the wall time of that round;
- *required*: the rate at which one exchange finishes in the time it may take before compute waits: for data
  parallel a share ``dp_overlap_fraction`` of the step (hidden behind the backward pass), for DiLoCo
  ``overlap_steps`` inner steps, and never less than the sustained rate.
- Not counted: latency, protocol headers, progress records, and the state downloads of joining islands.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

TOPOLOGIES = ("allreduce", "syncer")


def send_factor(topology: str, islands: int) -> float:
    """Times its own data each island sends in one exchange among ``islands``."""
    if topology == "allreduce":
        return 2.0 * (islands - 1) / islands
    if topology == "syncer":
        return 1.0 if islands > 1 else 0.0
    raise ValueError(f"topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")


def allreduce_time_s(payload_bits: float, islands: int, link_bits_per_s: float, latency_s: float = 0.0) -> float:
    """Wall time of one all-reduce of ``payload_bits`` per island over links of ``link_bits_per_s`` each way.

    Butterfly (hivemind): every island exchanges with all others at once, two phases (reduce-scatter, then
    all-gather), so two latencies rather than the 2 (g - 1) of a ring."""
    if link_bits_per_s <= 0:
        raise ValueError(f"link_bits_per_s must be > 0, got {link_bits_per_s}")
    if islands <= 1:
        return 0.0
    return send_factor("allreduce", islands) * payload_bits / link_bits_per_s + 2 * latency_s


@dataclass(frozen=True)
class BandwidthConfig:
    params: float  # model parameters (count)
    islands: int  # M: islands (data centres, peers) exchanging over the slow links
    tokens_per_s: float  # tokens per second one island trains at
    tokens_per_step: float  # tokens of one island's inner step (its share of the global batch)
    inner_steps: float  # H: inner steps per outer round (streaming: between two syncs of one fragment)
    outer_bits: float = 4.0  # bits per value of an outer gradient on the wire (32, 16, 8, 4, ...)
    dp_bits: float = 16.0  # bits per value of a data-parallel gradient on the wire (bf16 = 16)
    fragments: int = 1  # P: each round's outer gradient travels as P fragments, one every H/P steps
    overlap_steps: float = 1.0  # tau: inner steps one exchange may take before the loop waits for it
    dp_overlap_fraction: float = 1.0  # share of a step a data-parallel all-reduce may take, hidden by backward
    topology: str = "allreduce"  # DiLoCo exchange: "allreduce" among islands, or "syncer"
    dp_topology: str = "allreduce"  # data-parallel exchange between islands

    def __post_init__(self) -> None:
        positive = ("params", "tokens_per_s", "tokens_per_step", "inner_steps", "outer_bits", "dp_bits", "overlap_steps")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.islands < 2:
            raise ValueError(f"islands must be >= 2 (one island exchanges nothing), got {self.islands}")
        if self.fragments < 1 or self.fragments > self.inner_steps:
            raise ValueError(f"fragments must be in [1, H = {self.inner_steps}] (one fragment per inner step at most), "
                             f"got {self.fragments}")
        if not 0 < self.dp_overlap_fraction <= 1:
            raise ValueError(f"dp_overlap_fraction must be in (0, 1], got {self.dp_overlap_fraction}")
        for name in ("topology", "dp_topology"):
            send_factor(getattr(self, name), self.islands)  # raises on an unknown topology

    @property
    def step_s(self) -> float:
        return self.tokens_per_step / self.tokens_per_s


@dataclass(frozen=True)
class BandwidthResult:
    step_s: float  # one inner step (s)
    dp_bits_per_step: float  # bits one island sends per data-parallel step
    dp_sustained_bits_per_s: float
    dp_required_bits_per_s: float
    outer_bits_per_exchange: float  # bits one island sends per outer exchange (one fragment)
    exchange_period_steps: float  # H / P
    diloco_sustained_bits_per_s: float
    diloco_required_bits_per_s: float
    sustained_reduction: float  # data parallel / DiLoCo
    required_reduction: float

    def to_dict(self) -> dict:
        return asdict(self)


def island_bandwidth(config: BandwidthConfig) -> BandwidthResult:
    """Sustained and required bits per second one island sends, data parallel and DiLoCo, side by side."""
    step_s = config.step_s
    dp_bits = send_factor(config.dp_topology, config.islands) * config.params * config.dp_bits
    dp_sustained = dp_bits / step_s
    dp_required = dp_bits / (step_s * config.dp_overlap_fraction)
    exchange_bits = send_factor(config.topology, config.islands) * config.params / config.fragments * config.outer_bits
    period_steps = config.inner_steps / config.fragments
    sustained = exchange_bits / (period_steps * step_s)
    # an exchange may take overlap_steps; if those are longer than the period, exchanges overlap and the
    # link only has to keep up with the sustained rate
    required = exchange_bits / (min(config.overlap_steps, period_steps) * step_s)
    return BandwidthResult(
        step_s=step_s,
        dp_bits_per_step=dp_bits,
        dp_sustained_bits_per_s=dp_sustained,
        dp_required_bits_per_s=dp_required,
        outer_bits_per_exchange=exchange_bits,
        exchange_period_steps=period_steps,
        diloco_sustained_bits_per_s=sustained,
        diloco_required_bits_per_s=required,
        sustained_reduction=dp_sustained / sustained,
        required_reduction=dp_required / required,
    )


def inner_steps_for_round(tokens_per_round: float, islands: int, tokens_per_step: float) -> float:
    """H implied by a swarm-wide token budget per round shared by ``islands`` equal islands."""
    if min(tokens_per_round, islands, tokens_per_step) <= 0:
        raise ValueError("tokens_per_round, islands and tokens_per_step must be > 0")
    return tokens_per_round / (islands * tokens_per_step)
