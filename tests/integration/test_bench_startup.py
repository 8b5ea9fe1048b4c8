"""scripts/bench_startup.py (docs/benchmarks.md, "Start-up"): import CPU and one peer's start, timed and saved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .harness import FAST_MODEL_FLAGS

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_startup.py"


@pytest.mark.timeout(240)
def test_bench_startup_times_the_imports_and_a_peer_start_and_saves_them(tmp_path):
    command = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), "--runs", "1", "--",
               *FAST_MODEL_FLAGS, "--seq-len", "64", "--batch-size", "8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    saved = json.loads((tmp_path / "out" / "startup.json").read_text())
    assert set(saved["import_cpu_s"]) == {"torch", "first optimizer (torch._dynamo)", "int8 codec (bitsandbytes)",
                                          "hivemind"}
    assert all(cpu > 0 for cpu in saved["import_cpu_s"].values()), saved
    (run,) = saved["runs"]
    assert 0 < run["first_record_s"] < run["exit_s"] and saved["median_first_record_s"] == run["first_record_s"]
    assert f"first record after {run['first_record_s']:.2f} s" in done.stdout


def test_bench_startup_refuses_zero_runs_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--runs", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "bench_startup.py: error: --runs must be at least 1"
