"""This peer's part in the swarm's rounds (docs/design.md §4): the tokens it trained in the current round, when the
round is over, and what its outer gradient weighs. A round ends when the tokens every live peer reports for it reach
the round's budget, when a peer already moved past it, or at its deadline; a fast peer simply contributes more of
the budget, and its outer gradient weighs as many tokens as it trained."""

from __future__ import annotations

import time
from collections import deque

from p2p_diloco.core.config import InnerConfig
from p2p_diloco.core.link import Link


class Rounds:
    def __init__(self, inner: InnerConfig, tokens_per_batch: int, fragments: int):
        self.inner, self.tokens_per_batch, self.fragments = inner, tokens_per_batch, fragments
        self.tokens = 0  # tokens this peer trained in the swarm's current round
        self.steps = 0  # inner steps this peer ran in it
        self.started = time.monotonic()
        self._published: tuple = ()  # (round, budget, its start) last published: what ends this peer's round
        # [outer step, tokens this peer trained in its rounds at that step] for its last outer steps, as many as there
        # are fragments: a fragment's outer gradient stands for that many rounds, and its weight is their tokens
        self.recent: deque[list[int]] = deque(maxlen=fragments)

    def trained(self, tokens: int) -> None:
        self.tokens += tokens
        self.steps += 1

    @property
    def rate(self) -> float:
        """Tokens per second in this round so far: the others extrapolate our tokens between records with it."""
        return self.tokens / max(1e-3, time.monotonic() - self.started)

    def restart(self) -> None:
        """A new round begins for this peer (it started averaging, or took the swarm's state)."""
        self.tokens = self.steps = 0
        self.started = time.monotonic()

    def budget(self, live_peers: int) -> int:
        """The swarm-wide tokens of one outer step: the round's budget (configured, or H steps of this peer's
        batch per live peer) divided among the fragments, which are averaged one after the other."""
        per_peer = self.inner.inner_steps * self.tokens_per_batch
        return (self.inner.tokens_per_round or per_peer * (1 + live_peers)) // self.fragments

    def is_over(self, link: Link, round_index: int) -> bool:
        """The swarm's round ends when its tokens reach the budget, someone already moved on, or at the deadline."""
        view = link.round_view(round_index)
        if view.peers_ahead:
            return True
        budget = self.budget(view.live_peers)
        deadline_s = self.inner.round_deadline_s
        plan = (round_index, budget, self.started)
        if plan != self._published:  # the beacons pace their records by how near the round's end is
            self._published = plan
            ends = dict(round_deadline=round(time.time() + deadline_s - (time.monotonic() - self.started), 3))
            link.publish(round_budget=budget, **(ends if deadline_s else {}))
        own = self.tokens if view.share_cap is None else min(self.tokens, view.share_cap)
        if view.tokens_by_others + own >= budget:
            return True
        return bool(deadline_s) and time.monotonic() - self.started >= deadline_s

    def weight(self, outer_step: int, unsynced: int) -> float:
        """What the outer gradient of ``outer_step``, carrying ``unsynced`` tokens of progress, weighs in the average.

        The tokens of the rounds it stands for (docs/design.md §2: w_i = tokens this round), not all the progress it
        carries. After failed rounds the carried progress is k rounds' worth; weighted by all of it, a mean of deltas
        counts it k times over: a peer that had chased the swarm for 6 rounds declared 296k tokens against the others'
        36k and 45k, weighed 66-78% in that outer step even after clamping, and the held-out loss rose 2.219 -> 2.283.
        Weighted by its round, its carried progress adds what it would have added in each of those rounds. A retry of
        the same outer step (our last averaging failed and nobody moved on) is the same round: a retry that peers
        still averaging that step end at once would otherwise weigh a full round by a few steps."""
        if self.recent and self.recent[-1][0] == outer_step:
            self.recent[-1][1] += self.tokens
        else:
            self.recent.append([outer_step, self.tokens])
        return float(min(unsynced, sum(count for _, count in self.recent)))
