"""p2p-diloco: DiLoCo training across far-apart, unreliable, unequal machines with no central server.

Each machine is a *learner island*: it runs inner AdamW (or Muon) steps on its own data shard, then averages a
compressed outer gradient with its peers through hivemind's DHT and butterfly all-reduce, and applies
an outer Nesterov step to the shared global parameters. See docs/design.md for the algorithm and invariants.

Importing this package has no side effects: no logging set-up, no environment reads, no device probing.
"""

__version__ = "0.1.0"
