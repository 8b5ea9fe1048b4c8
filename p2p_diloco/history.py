"""Which history the swarm holds: the rule by which every peer, reading the same progress records, picks the same
outer step and the same bytes for it (docs/design.md §4, "Forks and which history wins").

The highest outer step any live peer reports wins; at the same step, the state sha256 that most live peers
report wins; a tie goes to the smallest sha256. Two parts of a run that trained apart (a late start, a partition,
a machine whose arithmetic differs) thereby merge onto one history: the losing side downloads the winner's state
and rebases its local progress onto it. Pure functions of records (peer id -> progress record): no DHT, no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping


def swarm_outer_step(records: Mapping[str, dict]) -> int:
    """The highest outer step that any live peer reports (-1 when there is none)."""
    steps = [int(record.get("outer_step", -1)) for record in records.values()]
    return max(steps, default=-1)


def reported_sha256(records: Mapping[str, dict], outer_step: int) -> dict[str, str]:
    """The state sha256 each peer reports for ``outer_step``, by peer id (peers at other steps left out)."""
    return {peer: str(r.get("global_sha256")) for peer, r in records.items() if r.get("outer_step") == outer_step}


def canonical_sha(records: Mapping[str, dict], outer_step: int, own_sha: str | None = None) -> str | None:
    """The state sha256 that the swarm holds for ``outer_step``: the one most peers report, this one's own
    (``own_sha``) counted too; a tie goes to the smallest hash. Every peer with the same view picks the same one,
    so a fork heals one way."""
    votes = Counter(reported_sha256(records, outer_step).values())
    if own_sha:
        votes[own_sha] += 1
    if not votes:
        return None
    return min(votes, key=lambda sha: (-votes[sha], sha))


def agreed_sha(records: Mapping[str, dict], outer_step: int) -> str | None:
    """The sha256 that at least half of the peers reporting ``outer_step`` published for it (the canonical one on
    a tie), or None: a minority, a lone donor among others say, is never believed."""
    votes = Counter(reported_sha256(records, outer_step).values())
    canonical = min(votes, key=lambda sha: (-votes[sha], sha)) if votes else None
    return canonical if canonical is not None and 2 * votes[canonical] >= sum(votes.values()) else None
