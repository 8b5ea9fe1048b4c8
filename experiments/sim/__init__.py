"""Internet-scale planning by simulation (issue 9): goodput under interruptions, bandwidth per island.

Pure Python and numpy/matplotlib only: nothing here imports hivemind or torch, opens a socket or starts a
process. Modules, from the bottom up:

- ``goodput``: a discrete-event simulator of synchronous data parallel, elastic data parallel and
  decoupled islands under per-chip interruptions;
- ``bandwidth``: bits per second each island sends, data parallel against (streaming) DiLoCo rounds;
- ``calibrate``: the inputs of our own protocol read from a real run's metrics (a chaos or swarm folder);
- ``scenarios``: the sweeps and the Decoupled-DiLoCo-report scenario built from the three above;
- ``report``: JSON, markdown and PNG output; ``cli``: the ``scripts/simulate.py`` entry point.
"""
