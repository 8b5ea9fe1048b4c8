"""What one peer knows of the others and decides from their progress records: pure policies, records in and
decisions out, with no DHT and no averager (swarm/swarm_link.py feeds them and carries them out).

- ``SwarmView``: whom this peer counts (live, unbanned, unshunned), the weight limits their published progress
  supports, the round as the records show it (``round_view``), the state to take (``target``: history.py) and the
  claims and donors it bans for (docs/design.md §4, §7).
- ``OuterNorms``: the norms of this peer's recent outer gradients, what it publishes of them, and the swarm's
  reference norm a group's average is held to (docs/design.md §7).
- ``ProgressPace``: how often this peer publishes and reads records: fast near a round's end, while averaging, at
  start and after a peer joined; idle otherwise.

A record is anyone's word: every number is checked (``well_formed``) and every decision bounded.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from p2p_diloco.core import history
from p2p_diloco.core.bans import TokenLedger, banned_by_majority
from p2p_diloco.core.link import AveragingOutcome, RoundView
from p2p_diloco.core.robust import (
    RobustPolicy,
    own_reference,
    swarm_problem,
    swarm_reference,
    total_norm,
)

logger = logging.getLogger(__name__)
NEAR_PERIODS = 3  # within this many idle periods of a round's end (or of a change), progress records go fast
CLAIMS_TO_BAN = 3  # checks at which a peer may be found making an unbacked claim before it is banned (history.py)
MEMORY_PERIODS = 2  # idle periods for which a peer a read showed live counts as unseen, not gone, when a read lacks it
QUIET_SLACK_S = 2.0  # beyond its horizon, how long a peer's record may go unrenewed before a group stops waiting for it
BAD_STATES_TO_BAN = 2  # states a donor may serve that do not verify before it is banned
PLAN_FIELDS = frozenset({"round_budget", "round_deadline"})  # what ends a peer's round; read by the others' pace
# a peer publishes the largest norm of its last this many outer gradients per fragment: a round that began just after
# a catch-up holds a step or two (honest weights in one group differed 30x, their norms as much), and a reference
# taken from such rounds refused honest averages 7-9x its size
NORM_WINDOW = 8
NORM_MIN_ROUNDS = 3  # ... and says nothing before it sent that many: a run's first rounds are the most uneven
_NUMERIC_FIELDS = ("round", "outer_step", "round_tokens", "round_budget", "rate", "time", "period", "round_deadline")


def well_formed(record: object) -> bool:
    """A progress record whose numeric fields, where present, are finite numbers: anyone can write one, and an
    infinite ``round`` or ``rate`` (msgpack carries them) raised OverflowError in the training loop's arithmetic."""
    if not isinstance(record, dict):
        return False
    for name in _NUMERIC_FIELDS:
        value = record.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)):
            return False
    return True


def tokens_now(record: Mapping, now: float, horizon_s: float) -> int:
    """A peer's round tokens now: what it published, plus its rate times the record's age (at most ``horizon_s``).
    Records are a period or two old; without this, short rounds overshoot their budget."""
    try:
        tokens, rate, age = int(record.get("round_tokens", 0)), float(record.get("rate", 0.0)), now - float(record.get("time", now))
    except (TypeError, ValueError, OverflowError):
        return 0
    tokens = max(0, tokens)
    extra = max(0.0, rate) * min(max(0.0, age), horizon_s)
    if not math.isfinite(extra):
        return tokens  # a hostile or broken record (rate inf or 1e308: int() of it raised in the learner's loop)
    return tokens + int(extra)


def _whole(value: object) -> int | None:
    """A record's round or outer step as an int, or None where it is missing or not a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value)


def horizon_s(record: Mapping, fast_s: float, idle_s: float, period_now_s: float) -> float:
    """How far ahead a peer's record is extrapolated: two periods, of the longer of the one it says it was published
    under and the one we read at now (a record read every 5 s may be 6 s old though published every second), within
    our own two idle periods (a record can't stretch its tokens further by claiming a long one)."""
    period = record.get("period", fast_s)
    if isinstance(period, bool) or not isinstance(period, int | float) or not math.isfinite(period):
        period = fast_s
    return 2 * min(max(period, period_now_s, fast_s), idle_s)


class SwarmView:
    """This peer's knowledge of the others (see the module docstring). ``anchors``: the peers it was told to join
    through; ``fast_s``/``idle_s``: the progress records' periods, which bound how far a record is extrapolated;
    ``share_cap``: the most one peer's tokens count towards a round's end, in medians (0: no cap; round_view)."""

    def __init__(self, own_id: str, anchors: Iterable[str] = (), fast_s: float = 1.0, idle_s: float = 5.0,
                 share_cap: float = 0.0):
        self.own_id, self.anchors, self.share_cap = own_id, frozenset(anchors), share_cap
        self.fast_s, self.idle_s, self.period_now_s = fast_s, idle_s, fast_s
        self.ledger = TokenLedger()
        # every set below is replaced whole, never changed in place: two threads read them
        self.banned: frozenset[str] = frozenset()  # reducers our averager banned (bad averages)
        self.shunned: frozenset[str] = frozenset()  # peers most of the swarm banned (bans.banned_by_majority)
        self.history_banned: frozenset[str] = frozenset()  # unbacked claims, states that did not verify
        # peers proven to have averaged: our groups' members, and those a verified state's history names. Only they
        # vote on bans (anyone can write a progress record under any subkey)
        self.participants: frozenset[str] = frozenset()
        # senders our reducer left out of our latest averaging: they add nothing to the outer step, so they don't
        # count in our round's budget, nor end it
        self.left_out: frozenset[str] = frozenset()
        self._claims: dict[str, tuple[frozenset[history.Node], int]] = {}  # peer -> (heads said, checks it claimed at)
        # peer -> when (monotonic) a read last showed it live: one that a later read lacks counts as unseen, not gone,
        # for ``MEMORY_PERIODS`` idle periods (history.choose_target's ``unseen``)
        self._last_seen: dict[str, float] = {}
        self._first_target_at: float | None = None  # when (monotonic) this peer first chose a state to take
        self._bad_states: dict[str, int] = {}

    def excluded(self) -> frozenset[str]:
        return self.banned | self.shunned | self.history_banned

    def bans(self) -> list[str]:
        """What this peer publishes as its bans (the others take its word once most of them agree)."""
        return sorted(self.banned | self.history_banned)

    def live(self, records: Mapping[str, dict]) -> dict[str, dict]:
        """The records of peers we count: not banned by us, not shunned by most of the swarm."""
        excluded = self.excluded()
        return {peer: record for peer, record in records.items() if peer not in excluded}

    def behind(self, records: Mapping[str, dict], outer_step: int) -> int:
        """How many of the peers we count are at an earlier outer step than ``outer_step``: the ones worth waiting
        for as a state donor at the planned end. A banned or shunned peer is not (it may claim any step)."""
        return sum(int(r.get("outer_step", -1)) < outer_step for r in self.live(records).values())

    def observe(self, records: Mapping[str, dict], now: float) -> dict[str, dict]:
        """Note the tokens each peer published per round (its weight limit; banned peers' too: a groupmate that has
        not banned one can still let it into a group with us) and who most of the swarm banned; the live records."""
        for peer, record in records.items():
            self.ledger.observe(peer, record.get("round"), tokens_now(record, now, self.horizon(record)))
        shunned = banned_by_majority(dict(records), self.own_id, self.banned, self.participants)
        for peer in sorted(shunned - self.shunned):
            logger.warning("%s was banned by most peers of the swarm: not grouping with it either", peer)
        self.shunned = shunned
        return self.live(records)

    def horizon(self, record: Mapping) -> float:
        return horizon_s(record, self.fast_s, self.idle_s, self.period_now_s)

    def group_target(self, live: Mapping[str, dict], silent_s: Callable[[str], float]) -> tuple[int, list[str]]:
        """How many peers a group of ours waits for, ourselves included, and the live peers it does not wait for:
        those whose record no read of ours found renewed for longer than its horizon plus ``QUIET_SLACK_S`` (a
        peer killed or frozen; its record lives until it expires, ttl 20 s by default). Waiting for one costs every
        round the whole matchmaking time (docs/design.md §4, Groups). Never fewer than 2 while anyone is live: a
        target of 1 would step alone at once (a fork, were the others only slow) and turn every joiner away. The
        target holds for the round's whole search; a quiet peer that comes back counts again from the next round,
        and can still join a group that is not yet full."""
        quiet = sorted(self.quiet(live, silent_s))
        return (max(2, 1 + len(live) - len(quiet)) if live else 1), quiet

    def quiet(self, live: Mapping[str, dict], silent_s: Callable[[str], float] | None) -> frozenset[str]:
        """The peers of ``live`` whose record no read of ours found renewed for longer than its horizon plus
        ``QUIET_SLACK_S``: killed or frozen, their records living on until they expire."""
        if silent_s is None:
            return frozenset()
        return frozenset(peer for peer, record in live.items() if silent_s(peer) > self.horizon(record) + QUIET_SLACK_S)

    def voters(self, live: Mapping[str, dict], silent_s: Callable[[str], float] | None) -> dict[str, dict]:
        """The peers of ``live`` whose word on the swarm's history counts: less the quiet ones. A killed peer's record
        votes for the step it died at until it expires (20 s): beside the same peer restarted at that step, it made
        a majority of four for an old step, under which two honest survivors one step apart took each other's heads
        for unbacked claims and banned each other (a CI run), and the banned pair's halves forked."""
        quiet = self.quiet(live, silent_s)
        return {peer: record for peer, record in live.items() if peer not in quiet}

    def round_view(self, records: Mapping[str, dict], round_index: int, now: float,
                   own: Mapping | None = None) -> RoundView:
        """The others' progress in ``round_index`` as it decides the round's end (docs/design.md §4, End of a round),
        the senders our reducer left out excepted (their tokens add nothing to the outer step: they neither count
        towards the round's budget nor end it). A peer already past the round counts for the tokens it last published
        in it (the ledger). With ``share_cap``, each peer counts for at most that many times the median of the
        round's tokens, ours (``own``: our published record) included, so that nobody shortens the rounds by
        publishing more than it trains. Peers past the round end it only as most of those in it or past it, or as
        one already at a later outer step than the round (we are behind): one peer's word does not."""
        peers = {peer: record for peer, record in records.items() if peer not in self.left_out}
        known = self.ledger.allowed(round_index)  # the most each peer published for this round
        counted, past, behind = [], 0, False
        for peer, record in peers.items():
            their_round = _whole(record.get("round"))
            if their_round == round_index:
                counted.append(tokens_now(record, now, self.horizon(record)))
            elif their_round is not None and their_round > round_index and well_formed(record):
                past += 1
                counted.append(int(known.get(peer, 0)))
                step = _whole(record.get("outer_step"))
                behind = behind or (step is not None and step > round_index)
        mine = tokens_now(own, now, self.horizon(own)) if own and _whole(own.get("round")) == round_index else 0
        cap = self._share_cap([*counted, mine])
        return RoundView(
            live_peers=len(peers),
            tokens_by_others=sum(counted) if cap is None else sum(min(tokens, cap) for tokens in counted),
            peers_ahead=past if behind or 2 * past > len(counted) else 0,
            share_cap=cap,
        )

    def _share_cap(self, tokens: list[int]) -> int | None:
        """The most tokens one peer counts for in a round: ``share_cap`` times the upper median of the round's tokens
        per peer, with 3 peers or more (as the reducer clamps weights, design.md §7); None: no cap."""
        if self.share_cap <= 0 or len(tokens) < 3:
            return None
        return int(self.share_cap * sorted(tokens)[len(tokens) // 2])

    def target(self, records: Mapping[str, dict], chain: Sequence[history.Node], fresh: bool,
               now: float | None = None, silent_s: Callable[[str], float] | None = None,
               gone: Callable[[str], bool] | None = None) -> history.Target | None:
        """The state to take (history.choose_target among the voters: the live peers less the quiet ones, which count
        in the electorate as abstaining, those seen a moment ago that this read lacks counted as unseen); with nothing
        to follow, the heads far ahead are claims the swarm does not back: said once each, and a peer found claiming
        at ``CLAIMS_TO_BAN`` checks is banned. ``silent_s``: how long each peer's record has gone unrenewed
        (ProgressReader.silent_s); ``gone``: whether a peer's latest record expired (ProgressReader.expired), so that
        its absence is no partial read."""
        live = self.live(records)
        voters = self.voters(live, silent_s)
        now = time.monotonic() if now is None else now
        unseen = self._note_unseen(live, now, live.keys() - voters.keys(), gone)
        if self._first_target_at is None:
            self._first_target_at = now
        settled = now - self._first_target_at >= MEMORY_PERIODS * self.idle_s  # a lone word: a swarm of one, or a liar
        abstaining = len(live.keys() - voters.keys() - {self.own_id})  # quiet: in the electorate, vouching for nothing
        target = history.choose_target(voters, chain, fresh, self.own_id, self.anchors, unseen, settled, abstaining)
        if target is None and not fresh:
            for peer, node in history.unbacked_claims(voters, chain, self.own_id).items():
                said, checks = self._claims.get(peer, (frozenset(), 0))
                if node not in said:
                    logger.warning("ignoring outer step %d claimed by %s: no majority of the swarm vouches for it",
                                   node[0], peer)
                self._claims[peer] = (said | {node}, checks + 1)
                if checks + 1 >= CLAIMS_TO_BAN:
                    self._ban(peer, f"it claimed outer steps that no majority of the swarm vouches for, at {checks + 1} "
                                    "of our checks")
        return target

    def _note_unseen(self, live: Mapping[str, dict], now: float, quiet: Iterable[str] = (),
                     gone: Callable[[str], bool] | None = None) -> int:
        """Note who ``live`` shows at ``now``, and return how many peers a read within the last ``MEMORY_PERIODS`` idle
        periods showed live that ``live`` lacks (banned ones aside). A peer that said it left stops counting after
        that memory; a ``quiet`` one, or one whose record expired (``gone``), at once: a killed peer's record, when
        it expires, is no partial read (counted unseen, it kept a restarted peer's first catch-up waiting 10 s)."""
        memory_s = MEMORY_PERIODS * self.idle_s
        excluded = self.excluded() | frozenset(quiet)
        seen = {peer: at for peer, at in self._last_seen.items() if now - at <= memory_s and peer not in excluded
                and (peer in live or gone is None or not gone(peer))}
        seen.update(dict.fromkeys((peer for peer in live if peer != self.own_id and peer not in excluded), now))
        self._last_seen = seen
        return len(seen.keys() - live.keys())

    def moved_past(self, records: Mapping[str, dict], own_record: Mapping, outer_step: int,
                   silent_s: Callable[[str], float] | None = None) -> bool:
        """Whether a search for a group at ``outer_step`` can no longer succeed (history.moved_past, among the
        voters: a killed peer's record at an old step kept a search alive that nobody could join)."""
        chain = history.chain_of(own_record)
        if not chain or chain[-1][0] != outer_step:
            return False
        return history.moved_past(self.voters(self.live(records), silent_s), chain, self.own_id)

    def refuse_donor(self, donor: str, reason: str) -> None:
        """A state we could not verify: a donor that serves ``BAD_STATES_TO_BAN`` of them is banned."""
        self._bad_states[donor] = self._bad_states.get(donor, 0) + 1
        if self._bad_states[donor] >= BAD_STATES_TO_BAN:
            self._ban(donor, f"it served states that did not verify ({reason})")

    def _ban(self, peer: str, why: str) -> None:
        if peer not in self.history_banned:
            logger.warning("banning %s: %s", peer, why)
            self.history_banned = self.history_banned | {peer}


def typical_tokens(own_record: Mapping, fragments: int, others: int) -> float:
    """A round's tokens per peer by our own config: the round's budget we published (``round_budget``, per fragment;
    train/rounds.py) over all fragments, shared among us and the ``others`` live peers; 0 while none is published.
    What an outer gradient weighs when every peer trains at the same speed (robust.own_reference)."""
    budget = own_record.get("round_budget")
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not math.isfinite(budget) or budget < 0:
        return 0.0
    return float(budget) * fragments / (1 + others)


class OuterNorms:
    """This peer's recent outer-gradient norms per fragment (``outer_norms`` in its progress record: the largest of
    the last ``NORM_WINDOW``, once it sent ``NORM_MIN_ROUNDS``), and the check of a group's whole average against the
    swarm's reference norm (robust.swarm_reference): the bound that holds when adversaries are a majority of the
    group but not of the swarm (docs/design.md §7). Before the swarm published norms (a run's first rounds), the
    reference is our own norm scaled to the tokens the swarm published for the round (robust.own_reference)."""

    def __init__(self, fragments: int = 1):
        self.fragments = fragments
        self._sent = [deque(maxlen=NORM_WINDOW) for _ in range(fragments)]

    def sent(self, fragment: int, norm: float) -> None:
        if math.isfinite(norm):
            self._sent[fragment].append(float(norm))

    def published(self) -> list[float | None]:
        """What this peer says of its norms, one entry per fragment (None: not yet)."""
        return [max(sent) if len(sent) >= NORM_MIN_ROUNDS else None for sent in self._sent]

    def reference(self, live: Mapping[str, dict], fragment: int, own_norm: float, own_tokens: float = 0.0,
                  tokens: Mapping[str, float] | None = None, typical_tokens: float = 0.0) -> float | None:
        """The reference norm for ``fragment``: the swarm's, from the live peers' records, ours (this round's, or our
        recent largest) among them; or, while fewer than half of them published one, ``own_norm`` scaled from
        ``own_tokens`` to a round's typical tokens (robust.own_reference; ``tokens``: per peer, what it published for
        the rounds our outer gradient stands for; ``typical_tokens``: our config's share of the round's budget)."""
        return self._reference(live, fragment, own_norm, own_tokens, tokens, typical_tokens)[0]

    def _reference(self, live: Mapping[str, dict], fragment: int, own_norm: float, own_tokens: float,
                   tokens: Mapping[str, float] | None, typical_tokens: float) -> tuple[float | None, str]:
        published = []
        for record in live.values():
            norms = record.get("outer_norms")
            if isinstance(norms, list) and len(norms) == self.fragments:
                published.append(norms[fragment])
        reference = swarm_reference(max([own_norm, *self._sent[fragment]]), published, len(live))
        if reference is not None:
            return reference, "the swarm's reference norm"
        theirs = [tokens[peer] for peer in live if peer in tokens] if tokens else []
        return own_reference(own_norm, own_tokens, theirs, typical_tokens), "our own norm scaled to a round's typical tokens"

    def checked(self, outcome: AveragingOutcome, live: Mapping[str, dict], fragment: int, own_norm: float,
                policy: RobustPolicy, own_tokens: float = 0.0, tokens: Mapping[str, float] | None = None,
                typical_tokens: float = 0.0) -> AveragingOutcome:
        """``outcome`` with the ratio of its average to the reference noted, or, over the limit, a failed round:
        our tensors keep their values, as for a bad part."""
        assert outcome.averaged is not None
        reference, what = self._reference(live, fragment, own_norm, own_tokens, tokens, typical_tokens)
        result_norm = total_norm(outcome.averaged)
        ratio = round(result_norm / reference, 4) if reference else None
        problem = swarm_problem(result_norm, reference, policy, what)
        if problem is None:
            return dataclasses.replace(outcome, norm_ratio=ratio)
        logger.warning("refused the average of group %s: %s", ", ".join(outcome.peers), problem)
        return AveragingOutcome(None, outcome.peers, 0.0, "error", problem, outcome.rejected, ratio)


class ProgressPace:
    """The progress records' next period: ``fast_s`` while anything is near or changing, ``idle_s`` otherwise.
    Near: the round's end is less than ``NEAR_PERIODS`` idle periods away by the records at hand. Changing: the
    first ``NEAR_PERIODS`` idle periods after start, or after a peer joined (it must be seen by all alike before the
    round ends), and while an averaging is in flight (its group forms, and a step others take must be seen at once).
    Published records carry the period (``horizon_s``)."""

    def __init__(self, fast_s: float, idle_s: float, ttl_s: float, now: float | None = None):
        self.fast_s, self.idle_s, self.ttl_s = fast_s, idle_s, ttl_s
        self.fast_until = (time.monotonic() if now is None else now) + NEAR_PERIODS * idle_s
        self._seen: dict[str, float] = {}  # peer id -> when (monotonic) its record was last seen

    def next_period(self, own: Mapping, peers: Mapping[str, dict], averaging: bool, now: float, dht_now: float) -> float:
        """The period to publish under next, from our record and the others' (``now``: monotonic; ``dht_now``: the
        DHT's clock, which records' times are in)."""
        if self.idle_s <= self.fast_s:
            return self.fast_s
        # a joiner: a peer not seen within a record's lifetime. A known peer missing from one read (a partial DHT
        # answer) is no change; a peer that left or died shrinks the round's budget, which brings its end nearer
        joined = [peer for peer in peers if now - self._seen.get(peer, -math.inf) > self.ttl_s]
        self._seen.update((peer, now) for peer in peers)
        if joined:
            self.fast_until = max(self.fast_until, now + NEAR_PERIODS * self.idle_s)
        if now < self.fast_until or averaging:
            return self.fast_s
        far = self.seconds_to_round_end(own, peers, dht_now, self.fast_s) > NEAR_PERIODS * self.idle_s
        return self.idle_s if far else self.fast_s

    def seconds_to_round_end(self, own: Mapping, peers: Mapping[str, dict], now: float, period_now_s: float) -> float:
        """When this peer's round ends, by the records: the soonest of the budgets (ours and those the others in our
        round published, which may be smaller) less the round's tokens over the round's rate, and of the round
        deadlines published. 0 when unknown (no budget published yet, nobody training) or when a peer is already
        past our round. A hostile budget or deadline can only make this peer publish more often."""
        try:
            round_index, budget = int(own["round"]), int(own["round_budget"])
        except (KeyError, TypeError, ValueError, OverflowError):
            return 0.0
        tokens, rate, deadline = 0, 0.0, float("inf")
        for record in [own, *peers.values()]:
            if not well_formed(record):
                continue
            their_round, their_rate = int(record.get("round", -1)), float(record.get("rate", 0.0))
            if their_round > round_index:
                return 0.0
            if their_round == round_index:
                tokens += tokens_now(record, now, horizon_s(record, self.fast_s, self.idle_s, period_now_s))
                rate += max(0.0, their_rate)
                if record.get("round_budget"):
                    budget = min(budget, int(record["round_budget"]))
                if record.get("round_deadline"):
                    deadline = min(deadline, float(record["round_deadline"]))
        by_tokens = max(0, budget - tokens) / rate if rate > 0 else 0.0
        return max(0.0, min(by_tokens, deadline - now))
