#!/usr/bin/env bash
# The two commands of the quick start, each doing all of its own set-up on a fresh machine:
#   ./run.sh swarm [swarm.py flags]   a local swarm of 3 peers on the built-in corpus, live progress, report + plot
#   ./run.sh test  [pytest flags]     the test suite
# Set-up: a virtualenv in .venv with torch==2.13.0 installed first (the CPU wheel), then this package.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"

setup() {
    if [ ! -x .venv/bin/python ]; then
        "$PYTHON" -m venv .venv
    fi
    # the Hugging Face packages are only looked for, not imported: importing them takes seconds
    if ! .venv/bin/python -c "import p2p_diloco, hivemind, bitsandbytes, pytest, pytest_timeout, hypothesis
import sys; from importlib.util import find_spec
sys.exit(not all(find_spec(name) for name in ('transformers', 'datasets', 'tokenizers', 'pyarrow')))" 2>/dev/null; then
        .venv/bin/python -m pip install --quiet --upgrade pip
        .venv/bin/python -m pip install --quiet "torch==2.13.0"
        .venv/bin/python -m pip install --quiet -e ".[dev]"
    fi
}

command="${1:-}"
shift || true
case "$command" in
    swarm)
        setup
        exec .venv/bin/python scripts/swarm.py --peers 3 --out runs/quickstart --max-time-s 180 "$@"
        ;;
    test)
        setup
        exec .venv/bin/python -m pytest tests "$@"
        ;;
    *)
        echo "usage: ./run.sh {swarm|test} [extra flags]" >&2
        exit 2
        ;;
esac
