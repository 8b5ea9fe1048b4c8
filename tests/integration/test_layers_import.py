"""core, train and observe import and work with hivemind made unimportable: only swarm/ needs it (and cli/, which
wires the swarm in)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import importlib, pkgutil, sys
sys.modules["hivemind"] = None  # any import of hivemind now fails ("import of hivemind halted")
import p2p_diloco
names = [m.name for m in pkgutil.walk_packages(p2p_diloco.__path__, "p2p_diloco.")
         if m.name.split(".")[1] in ("core", "train", "observe")]
for name in names:
    importlib.import_module(name)
from p2p_diloco.core.config import PeerConfig
from p2p_diloco.core.link import LocalLink
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.train.data import open_dataset
from p2p_diloco.train.learner import Learner
config = PeerConfig()
dataset = open_dataset(config.data, 32, 2, 0)
learner = Learner(config, dataset, NullSink())
learner.inner_step(LocalLink())
assert "hivemind" not in [n for n in sys.modules if sys.modules[n] is not None]
print(len(names), "modules")
"""


def test_core_train_and_observe_import_and_train_without_hivemind():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[0]) >= 20


def test_the_block_is_real():
    blocked = "import sys; sys.modules['hivemind'] = None; import p2p_diloco.swarm.joining"
    result = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "import of hivemind halted" in result.stderr


COMPILER_SCRIPT = """
import sys, torch
from p2p_diloco.core.compression import make_codec
from p2p_diloco.core.config import PeerConfig
from p2p_diloco.core.link import LocalLink
from p2p_diloco.observe.metrics import NullSink
from p2p_diloco.train.data import open_dataset
from p2p_diloco.train.learner import Learner
import p2p_diloco.swarm.swarm_link
for name in ("int8", "int4"):
    codec = make_codec(name)
    assert codec.decode(codec.encode(torch.ones(300)), 300).allclose(torch.ones(300))
config = PeerConfig()
Learner(config, open_dataset(config.data, 32, 2, 0), NullSink()).inner_step(LocalLink())
print(sorted(name for name in ("torch._inductor.compile_fx", "torch._inductor.lowering") if name in sys.modules))
"""


def test_a_peer_codec_and_inner_step_do_not_load_torch_compiler():
    """docs/benchmarks.md, "Start-up": bitsandbytes' import no longer loads torch's compiler (its code
    generation: a quarter of a peer's start-up CPU), and the codecs still encode and decode."""
    result = subprocess.run([sys.executable, "-c", COMPILER_SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


FLAG_CHECKS = """
import sys
from p2p_diloco.cli.peer import peer_main
address = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
assert peer_main(["--initial-peers", "not-an-address"]) == 2
assert peer_main(["--initial-peers", address, "--corpus-dir", "/nonexistent/corpus"]) == 2
loaded = [n for n in sys.modules if n.split(".")[0] in ("torch", "hivemind")]
assert not loaded, loaded[:5]
assert "_p2p_diloco_vendored_multiaddr" in sys.modules  # the addresses were parsed, by hivemind's vendored parser
"""


def test_a_peer_s_flags_are_checked_without_loading_torch_or_hivemind():
    """A mistyped address or a missing corpus is reported at once, not after seconds of imports (swarm/addresses.py)."""
    result = subprocess.run([sys.executable, "-c", FLAG_CHECKS], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if ": error:" in line]
    assert len(errors) == 2 and "bad multiaddr 'not-an-address'" in errors[0] and "corpus folder" in errors[1], errors


DEFERRED = """
import sys
from p2p_diloco.swarm.hivemind_api import UNUSED_IMPORTS, load_on_first_use
for name in UNUSED_IMPORTS:  # as peer_main does
    load_on_first_use(name)
import torch
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # torch._dynamo, as a peer's first optimizer
from p2p_diloco.core.compression import make_codec
make_codec("int8")  # bitsandbytes, whose operators torch registers scanning sys.modules (inspect.getmodule)
import p2p_diloco.swarm.swarm_link, p2p_diloco.train.learner, p2p_diloco.cli.peer  # hivemind, its averager
print(sorted(m for m in sys.modules if m.startswith("scipy.optimize")) == ["scipy.optimize"])
from hivemind.averaging.load_balancing import load_balance_peers
print(load_balance_peers(1000, [1.0, 3.0, 2.0]))  # declared bandwidths: hivemind's balancer runs scipy's linprog
print("scipy.optimize._linprog" in sys.modules)
"""


def test_scipy_optimize_loads_only_when_hivemind_s_balancer_runs():
    """A peer's imports leave hivemind's scipy.optimize unloaded (~0.45 CPU s: hivemind_api.UNUSED_IMPORTS), and
    hivemind's bandwidth balancer still gets it when it runs."""
    result = subprocess.run([sys.executable, "-c", DEFERRED], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    unloaded, parts, loaded = result.stdout.strip().splitlines()[-3:]
    assert unloaded == "True" and loaded == "True", result.stdout
    sizes = ast.literal_eval(parts)
    assert sum(sizes) == 1000 and sizes[1] > sizes[2] > sizes[0], parts  # the faster the peer, the larger its part
