"""The inner learning rate's schedule (docs/design.md §2): a linear warm-up, then a cosine decay to a floor.

It is indexed by the swarm's *nominal inner step*: H inner steps per round times the rounds the swarm has made,
plus the steps this peer took in the current round. Every peer reads the same outer step from the shared state,
so a late joiner or a peer that just caught up uses the lr the others use, not one of its own restart. The
schedule changes only the inner steps on this peer's island; what is shared (global params, momentum, the outer
step) does not depend on it, so invariant 1 is untouched.
"""

from __future__ import annotations

import math


def lr_factor(step: int, warmup_steps: int, decay_steps: int, floor: float) -> float:
    """The inner lr at nominal inner step ``step`` (0-based) as a fraction of the configured peak.

    ``warmup_steps``: steps of linear warm-up from 1/warmup_steps to 1 (0: none). ``decay_steps``: the step at which
    the cosine decay reaches ``floor`` (0: no decay, the peak from the end of the warm-up on); after it, ``floor``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if not decay_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps - warmup_steps))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
