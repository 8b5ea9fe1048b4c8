"""Which history the swarm holds: the rule by which a peer, reading the others' progress records, decides whether
to take another state and which (docs/design.md §4, "Which history wins"). Pure functions of records: no DHT,
no torch.

Every progress record carries its peer's *chain*: the (outer step, state sha256) of its last few heads, the
current one last (``recent``, and ``outer_step``/``global_sha256``). A peer *vouches* for every node of its chain.
The *electorate* is every live, unbanned peer, this one included, whatever its history; the quiet and the unseen
count in it and vouch for nothing. A node is *backed* when more than half of the electorate vouches for it, and
two peers at least: two backed nodes share a voucher, so they lie on one history, and while adversaries are fewer
than half of the live peers every backed node has an honest voucher. The rules, in order (``Target.how``):

- ``majority`` (catching up): the furthest backed node past this peer's head, on its own history.
- ``fresh``: a peer that has not averaged in a group since it started (a late joiner, a peer resumed from an old
  checkpoint) takes the furthest head backed by more than half of the electorate, itself left out unless a peer
  is at its head (a joiner vouches for nothing); in a swarm of two, the other's head if it is further. When the
  others split in two equal halves, the half of a peer it was told to join through (``--initial-peers``);
  otherwise it waits: beside two honest peers, two colluders must not win it.
- ``majority`` (another history): for a peer that has averaged, the furthest backed node off its chain vouched for
  by more than its head: a partition's smaller side takes the larger side's history, even at a lower step.
- ``next``: the one head one step past ours whose chain holds our head, held by half the electorate at least (the
  other of a swarm of two, one of whose rounds failed); the learner takes it only if it recomputes that step from
  its own state and the average the donor serves, and that average passes the checks of a reducer's result
  against what this peer sent (docs/design.md §7).
- ``fork``: a backed head at our step on other bytes.
- ``tie``: the two sides of a fork at our step (or, ``_split_tie``, at the step where two sides differ) are the
  whole electorate in two equal halves: the side with the smaller sha256, so both sides pick the same. A hostile
  side can grind its sha256, so the learner takes it only if its state lies within what an honest group could
  have made from the parent both sides share (verify.tie_problem).

A read of the records may miss some (a joiner's first pushes, a DHT answer from part of the swarm): live peers
seen a moment ago that a read lacks count as peers at our head that vouch for nothing past it (``unseen``), so that
a read showing only a liar, or two colluders, is not taken for the whole swarm.

A peer whose head no majority vouches for and that lies three or more steps past the highest node a majority
vouches for makes an *unbacked claim* (``unbacked_claims``): it moves nobody, is said once, and a peer that keeps
making them is banned (swarm/swarm_link.py). Nor
does it make an honest peer's search for a group stale (``moved_past``). Known limit: a swarm cut into two equal
halves that lie more than one honest round apart (a partition that lasted) stays cut until one side has a majority
(a peer joins or leaves): the tie between them is offered, and refused by the learner's check; a fresh peer
between them waits.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

CHAIN = 8  # heads a record lists, its own current one included
MADE = 4  # steps a record lists as computed by its peer (``made``): a fork is found within a round or two
Node = tuple[int, str]  # (outer step, state sha256)


@dataclass(frozen=True)
class Target:
    """A state to take: ``step`` and ``sha256``, and which rule chose it (see the module docstring)."""

    step: int
    sha256: str
    how: str  # "majority", "fresh", "next", "fork" or "tie" (a fork whose sides are vouched for alike)

    @property
    def node(self) -> Node:
        return self.step, self.sha256


def _valid_node(step: object, sha: object) -> bool:
    return (isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**53 and isinstance(sha, str)
            and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha))


def chain_of(record: Mapping) -> tuple[Node, ...]:
    """A record's chain, oldest first, its head last: only well-formed nodes at steps below the head, at most
    ``CHAIN`` of them. () for a record without a well-formed head."""
    head = (record.get("outer_step"), record.get("global_sha256"))
    if not _valid_node(*head):
        return ()
    recent = record.get("recent")
    earlier: dict[int, str] = {}
    if isinstance(recent, list | tuple):
        for entry in recent[-4 * CHAIN :]:
            if isinstance(entry, list | tuple) and len(entry) == 2 and _valid_node(*entry) and entry[0] < head[0]:
                earlier[entry[0]] = entry[1]
    nodes = [*sorted(earlier.items()), head]
    return tuple(nodes[-CHAIN:])


def _support(chains: Mapping[str, Sequence[Node]]) -> dict[Node, int]:
    """How many of ``chains`` hold each node."""
    support: dict[Node, int] = {}
    for chain in chains.values():
        for node in set(chain):
            support[node] = support.get(node, 0) + 1
    return support


def _others(records: Mapping[str, Mapping], own_id: str) -> dict[str, tuple[Node, ...]]:
    chains = {peer: chain_of(record) for peer, record in records.items() if peer != own_id}
    return {peer: chain for peer, chain in chains.items() if chain}


def _after(head: Node, chains: Iterable[Sequence[Node]]) -> set[Node]:
    """The nodes that some chain holds after ``head``: on ``head``'s history, past it."""
    found: set[Node] = set()
    for chain in chains:
        if head in chain:
            found.update(chain[chain.index(head) + 1 :])
    return found


def _before(own: Sequence[Node], chains: Iterable[Sequence[Node]]) -> set[Node]:
    """The nodes that some chain holds before a node of ``own``: on our history, older than our chain goes back."""
    found: set[Node] = set()
    ours = set(own)
    for chain in chains:
        joined = next((index for index, node in enumerate(chain) if node in ours), None)
        if joined is not None:
            found.update(chain[:joined])
    return found


def choose_target(
    records: Mapping[str, Mapping], own: Sequence[Node], fresh: bool, own_id: str = "", anchors: Iterable[str] = (),
    unseen: int = 0, settled: bool = True, abstaining: int = 0,
) -> Target | None:
    """The state this peer should take, or None to keep its own. ``records``: the voters' progress records by peer
    id (the live, unbanned peers less the quiet ones); ``own``: this peer's chain, head last; ``fresh``: whether its
    history is its own word only; ``anchors``: the peers it was told to join through (``--initial-peers``);
    ``unseen``: live peers this peer saw a moment ago whose records this read lacks (a partial read); ``abstaining``:
    live peers whose records are there but whose word does not count (quiet: killed or frozen). Unseen and abstaining
    peers belong to the electorate and vouch for nothing, so a read that shows only a liar is no swarm of one and
    two colluders of five are no majority, whoever else is quiet, fresh, behind or elsewhere. ``settled``: whether
    this peer has read the swarm for long enough (two idle periods, SwarmView) to call a lone peer a swarm of one:
    before, only an anchor's lone word is. See the module docstring."""
    others = _others(records, own_id)
    if not own or not others:
        return None
    unseen, abstaining = max(0, unseen), max(0, abstaining)
    head = own[-1]
    electorate = 1 + len(others) + unseen + abstaining  # this peer, and every live peer, whatever its history
    support = _support(others)  # vouchers among the others

    def backed(node: Node) -> bool:  # more than half of the electorate, two peers at least
        return support.get(node, 0) >= 2 and 2 * support[node] > electorate

    ahead = [node for node in _after(head, others.values()) if backed(node)]
    if ahead:
        return Target(*max(ahead), "majority")
    heads = {chain[-1] for chain in others.values()}
    behind = set(own) | _before(own, others.values())  # our history, up to our head
    ours = 1 + unseen + support.get(head, 0)  # peers whose chains hold our head, this one included
    if fresh:
        return _fresh_target(own, others, support, heads - behind, unseen, electorate, set(anchors), settled)
    elsewhere = [node for node, vouchers in support.items()
                 if node not in behind | _after(head, others.values()) and backed(node) and vouchers > ours]
    if elsewhere:
        return Target(*max(elsewhere), "majority")
    # one candidate only (two next steps on our history are a choice for a majority), held by half the electorate
    # at least: the other of a swarm of two, never a minority's claim
    following = {chain[-1] for chain in others.values() if head in chain and chain[-1][0] == head[0] + 1}
    if len(following) == 1 and 2 * support[next(iter(following))] >= electorate:
        return Target(*following.pop(), "next")
    rivals = [node for node in heads if node[0] == head[0] and node[1] != head[1] and support[node] >= ours]
    if rivals:
        best = max([*rivals, head], key=lambda node: (support.get(node, 0) + (node == head) * (1 + unseen),
                                                      _smaller(node[1])))
        if best == head:
            return None  # heads at our step decide, on both sides alike: the rule below must not contradict them
        if backed(best):
            return Target(*best, "fork")
        # as many vouching for both, and the two sides the whole electorate: the smaller sha256 decided, which a
        # hostile side can grind for (the learner checks it). Two colluders beside two honest sides are a third side
        if support[best] == ours and 2 * ours == electorate:
            return Target(*best, "tie")
        return None
    split = _split_tie(own, others, support, unseen, electorate)
    return Target(*split, "tie") if split is not None else None


def _fresh_target(own: Sequence[Node], others: Mapping[str, Sequence[Node]], support: Mapping[Node, int],
                  heads: set[Node], unseen: int, electorate: int, anchors: set[str], settled: bool) -> Target | None:
    """A fresh peer's choice among the others' ``heads`` off its own history (never back along it). A fresh peer
    alone at its head vouches for nothing (a joiner), so the others decide, by more than half of them; beside peers
    at its head (the unseen count as such) it is one of their side: two colluders against two peers at the start
    are no majority. In a swarm of two, the other's head if it is further (a second peer joining a swarm of one,
    or one whose first round failed on our side only), once this peer has read the swarm a while or if the other
    is an anchor: a joiner's first reads may show only whoever reached it first. Backed heads lie on one history:
    the furthest is taken."""
    head = own[-1]

    def anchored(node: Node) -> bool:
        return any(node in others[peer] for peer in anchors if peer in others)

    voters = electorate - (0 if unseen or any(chain[-1] == head for chain in others.values()) else 1)
    better = {node for node in heads if (support[node] >= 2 and 2 * support[node] > voters)
              or (voters == 1 and node[0] > head[0] and (settled or anchored(node)))}
    if not better:  # the others split in halves (two honest peers, two colluders): an anchor's side, if one only
        halves = {node for node in heads if 2 * support[node] == voters and anchored(node)}
        better = halves if len(halves) == 1 else set()
    return Target(*max(better), "fresh") if better else None


def _split_tie(own: Sequence[Node], others: Mapping[str, Sequence[Node]], support: Mapping[Node, int],
               unseen: int, electorate: int) -> Node | None:
    """The head to take when the swarm split into two sides vouched for alike and one side already carried on past
    the step where they differ (a round that split into two groups of two, one of which averaged again before the
    tie was seen): the rule of a same-step fork applied at that step, so both sides pick the same. The side whose
    bytes at the first step they differ have the smaller sha256 wins, if as many peers vouch for each side's node
    there (this one, and the unseen, on our side); its best-vouched, then furthest head is taken, as a tie (the
    learner checks it: verify.tie_problem). Only sides with a common parent in both chains; None otherwise."""
    mine = dict(own)
    best: tuple[tuple[int, int, int], Node] | None = None
    for chain in others.values():
        split_at = next((node for node in chain if node[0] in mine and mine[node[0]] != node[1]), None)
        if split_at is None or (split_at[0] - 1, mine.get(split_at[0] - 1)) not in chain:
            continue
        ours = (split_at[0], mine[split_at[0]])
        if (support.get(split_at, 0) != 1 + unseen + support.get(ours, 0) or 2 * support.get(split_at, 0) != electorate
                or int(split_at[1], 16) >= int(ours[1], 16)):
            continue
        head = chain[-1]
        key = (support.get(head, 0), head[0], _smaller(head[1]))
        if best is None or key > best[0]:
            best = (key, head)
    return best[1] if best is not None else None


def _smaller(sha: str) -> int:
    """A key under which a smaller sha256 compares greater (for ``max``)."""
    return -int(sha, 16)


def moved_past(records: Mapping[str, Mapping], own: Sequence[Node], own_id: str = "") -> bool:
    """Whether a search for a group at our head's step can no longer succeed: a majority took a later step on our
    history, or every other peer is past our step and one of them on our history (the other of a swarm of two
    moved on). An unbacked claim of a step far ahead does not count: the honest peers at our step are still there
    to group with."""
    others = _others(records, own_id)
    if not own or not others:
        return False
    head = own[-1]
    target = choose_target(records, own, fresh=False, own_id=own_id)
    if target is not None and target.how == "majority" and target.step > head[0]:
        return True
    return all(chain[-1][0] > head[0] for chain in others.values()) and any(head in chain for chain in others.values())


def unbacked_claims(records: Mapping[str, Mapping], own: Sequence[Node], own_id: str = "", lead: int = 3) -> dict[str, Node]:
    """Peers whose head lies past ours, no majority of the electorate (this peer included) vouches for it, and it
    lies ``lead`` or more steps past the highest node a majority does vouch for, by peer id: a claim to be ahead
    that the swarm does not back. A head at our step or behind it claims nothing we could follow (several peers
    resumed or joined at an old step can make it the majority's: honest peers at our head are no claimants). {}
    when no node is backed (a swarm split, or a late joiner that shares no history yet). The caller asks only when
    the swarm gives it nothing to follow (a peer catching up is behind, not lied to)."""
    if not own:
        return {}
    everyone = {**_others(records, own_id), own_id: tuple(own)}
    support = _support(everyone)
    backed = max((node for node, count in support.items() if 2 * count > len(everyone)), default=None)
    if backed is None:
        return {}
    return {
        peer: chain[-1] for peer, chain in everyone.items()
        if peer != own_id and chain[-1][0] > own[-1][0] and 2 * support[chain[-1]] <= len(everyone)
        and chain[-1][0] >= backed[0] + lead
    }


def reported_sha256(records: Mapping[str, Mapping], outer_step: int) -> dict[str, str]:
    """The state sha256 each peer reports for ``outer_step``, by peer id (peers at other steps left out)."""
    return {peer: str(r.get("global_sha256")) for peer, r in records.items() if r.get("outer_step") == outer_step}


def donor_ranks(records: Mapping[str, Mapping], target: Target) -> dict[str, tuple[int, int]]:
    """The order in which to ask peers for ``target``'s state, by peer id, highest first: those whose head is the
    target, then the furthest heads (a donor serves its head). Peers without a well-formed head are left out."""
    ranks = {}
    for peer, record in records.items():
        chain = chain_of(record)
        if chain:
            ranks[peer] = (int(chain[-1] == target.node), chain[-1][0])
    return ranks


def made_sha256(records: Mapping[str, Mapping], outer_step: int) -> dict[str, str]:
    """The state sha256 each peer says it computed itself for ``outer_step``, averaging in its group, by peer id:
    a record's ``made`` lists the last ``MADE`` steps its peer averaged and the bytes they came out as, which a
    download later does not change (its chain it does). Peers that did not average that step, or whose list no
    longer reaches back to it, are left out; malformed entries are ignored. A peer's word on its own arithmetic
    only: a liar moves nothing by it but the line that says whose arithmetic differs (train/catch_up.py)."""
    made: dict[str, str] = {}
    for peer, record in records.items():
        entries = record.get("made")
        if isinstance(entries, list | tuple):
            for entry in entries[-MADE:]:
                if isinstance(entry, list | tuple) and len(entry) == 2 and _valid_node(*entry) and entry[0] == outer_step:
                    made[peer] = entry[1]
    return made
