"""``hivemind_api.load_on_first_use``: a module hivemind imports and a peer never uses loads only when it is used,
and is then the module itself, wherever it is reached from."""

from __future__ import annotations

import inspect
import sys

import pytest

from p2p_diloco.swarm.hivemind_api import load_on_first_use


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``lazy_pkg`` whose module ``heavy`` counts its own executions in ``lazy_pkg.RUNS``."""
    (tmp_path / "lazy_pkg").mkdir()
    (tmp_path / "lazy_pkg" / "__init__.py").write_text("RUNS = []\n")
    (tmp_path / "lazy_pkg" / "heavy.py").write_text("import lazy_pkg\nlazy_pkg.RUNS.append(1)\nVALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import lazy_pkg

    yield lazy_pkg
    for name in [n for n in sys.modules if n == "lazy_pkg" or n.startswith("lazy_pkg.")]:
        del sys.modules[name]


def test_the_module_runs_at_its_first_use_and_is_then_itself(package):
    load_on_first_use("lazy_pkg.heavy")
    stand_in = sys.modules["lazy_pkg.heavy"]
    import lazy_pkg.heavy  # an import statement, as hivemind's, finds the stand-in

    assert package.RUNS == [] and lazy_pkg.heavy is stand_in
    # what a scan of every module reads (inspect.getmodule, which torch runs as it registers operators) loads nothing
    assert inspect.getmodule(test_the_module_runs_at_its_first_use_and_is_then_itself) is sys.modules[__name__]
    assert stand_in.__file__.endswith("heavy.py") and stand_in.__name__ == "lazy_pkg.heavy"
    assert package.RUNS == []
    assert stand_in.VALUE == 42 and package.RUNS == [1]  # first use: it ran, once
    real = sys.modules["lazy_pkg.heavy"]
    assert real is not stand_in and real.VALUE == 42 and package.heavy is real
    assert stand_in.VALUE == 42 and package.RUNS == [1]  # who kept the stand-in reaches the module, not a second run


def test_nothing_changes_for_a_module_imported_already_or_not_installed(package):
    import lazy_pkg.heavy

    load_on_first_use("lazy_pkg.heavy")
    assert sys.modules["lazy_pkg.heavy"] is lazy_pkg.heavy and package.RUNS == [1]
    load_on_first_use("lazy_pkg.absent")
    load_on_first_use("no_such_package_anywhere.module")
    assert "lazy_pkg.absent" not in sys.modules and "no_such_package_anywhere.module" not in sys.modules
