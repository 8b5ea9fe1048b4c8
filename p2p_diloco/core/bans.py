"""Whom a peer trusts with what, from what the others published (docs/design.md §7): which groupmates reduce nothing
in a group (``demote_reducers``, from the bans each member sends with its group request), which peers most of the
swarm banned (``banned_by_majority``, from progress records), and how many tokens each peer may declare for a round
(``TokenLedger``, from the tokens it published). Pure bookkeeping of peer ids and numbers: robust.py checks the
tensors themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


def demote_reducers(
    peer_ids: Sequence[str], fractions: Sequence[float], bans: Sequence[object]
) -> tuple[tuple[float, ...], dict[str, str]]:
    """Reducer shares with every peer that a groupmate banned given none (it sends, but reduces nothing).

    ``bans[i]``: what peer i published with its group request, the peers it banned (anything else counts as
    none). Every member computes this from the same gathered data, so all agree on who reduces what (invariant 1).
    A peer's ban of itself is ignored, and so are the bans of a peer that names more than half of its groupmates
    (a banned peer naming the others back would otherwise cancel every demotion). When the bans would leave no
    reducer at all, nobody is demoted (a banned reducer then fails the round, as before). Returns the new
    fractions (unchanged if nobody is demoted) and, per demoted peer, who banned it.
    """
    named: dict[str, list[str]] = {}
    for accuser, banned in zip(peer_ids, bans, strict=True):
        if not isinstance(banned, (list, tuple)):
            continue
        groupmates = {peer for peer in banned if isinstance(peer, str) and peer != accuser and peer in peer_ids}
        if 2 * len(groupmates) > len(peer_ids) - 1:  # an honest peer bans the odd bad reducer, not most of a group
            continue
        for peer in sorted(groupmates):
            named.setdefault(peer, []).append(accuser)
    kept = [0.0 if peer in named else float(fraction) for peer, fraction in zip(peer_ids, fractions, strict=True)]
    total = sum(kept)
    demoted = {peer: ", ".join(accusers) for peer, accusers in named.items() if fractions[peer_ids.index(peer)] > 0}
    if not demoted or total <= 0:
        return tuple(fractions), {}
    return tuple(fraction / total for fraction in kept), demoted


def banned_by_majority(
    records: dict[str, dict], own_id: str, own_bans: frozenset[str] | set[str], participants: frozenset[str] | set[str]
) -> frozenset[str]:
    """The peers that more than half of the swarm's voters banned, per their progress records (``banned``).

    The voters are this peer and every other peer in ``records`` that took part in an averaging this peer knows
    of (``participants``: its own groups' members and the round history of a verified state it downloaded; a
    group's members are proven by libp2p, while anyone can write a record under any subkey, so one process could
    otherwise publish many records and get honest peers shunned. The history is the donor's word: the sha256
    check covers the params it serves, not its metadata, so a donor with the swarm's params could name
    made-up voters) and that this peer has not banned itself (a
    banned garbage reducer gets no say); an accused peer is not a voter about itself. A peer that joins late has
    never seen a bad reducer misbehave, and follows it as a leader into a failed round (or several: its first
    bad result may be a timed-out all-reduce, not a bad average) unless it takes the others' word for it. A
    strict majority is needed: one voter's accusations ban nobody, and a tie bans nobody.
    """
    voters = {
        peer: record for peer, record in records.items()
        if peer != own_id and peer not in own_bans and peer in participants
    }
    accused: dict[str, int] = {}
    for voter, record in voters.items():
        banned = record.get("banned") if isinstance(record, dict) else None
        if isinstance(banned, (list, tuple)):
            for peer in {p for p in banned if isinstance(p, str) and p not in (voter, own_id)}:
                accused[peer] = accused.get(peer, 0) + 1
    return frozenset(
        peer for peer, votes in accused.items()
        if peer not in own_bans and 2 * votes > 1 + sum(voter != peer for voter in voters)  # +1: this peer
    )


MAX_ROUND_TOKENS = 2**53  # more tokens than any round holds, and exact as a float


class TokenLedger:
    """The most tokens each peer has published for each round (from its progress records), to bound the weight it
    may declare in that round's averaging. Round r's tokens are those behind the averaging of outer step r."""

    def __init__(self, keep_rounds: int = 64):
        self._seen: dict[str, dict[int, int]] = {}
        self._keep_rounds = keep_rounds
        self._lock = threading.Lock()  # observed from the progress thread, read from the averaging thread

    def observe(self, peer: str, round_index: object, tokens: int) -> None:
        if not (isinstance(round_index, int) and round_index >= 0):
            return
        tokens = min(int(tokens), MAX_ROUND_TOKENS)  # a hostile 1e308 must not overflow a float in allowed()
        with self._lock:
            rounds = self._seen.setdefault(peer, {})
            rounds[round_index] = max(rounds.get(round_index, 0), tokens)
            for old in sorted(rounds)[: -self._keep_rounds]:
                del rounds[old]

    def allowed(self, outer_step: int, rounds: int = 1) -> dict[str, float]:
        """Per peer seen in rounds ``outer_step - rounds + 1 .. outer_step``: the tokens it published for them
        (with streaming fragments a fragment's outer gradient holds ``rounds`` rounds of progress)."""
        window = range(outer_step - rounds + 1, outer_step + 1)
        with self._lock:
            return {
                peer: float(sum(seen.get(r, 0) for r in window))
                for peer, seen in self._seen.items()
                if any(r in seen for r in window)
            }
