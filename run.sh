#!/usr/bin/env bash
# The two commands of the quick start, each doing all of its own set-up on a fresh machine:
#   ./run.sh swarm [swarm.py flags]   a local swarm of 3 peers on the built-in corpus, live progress, report + plot
#   ./run.sh test  [pytest flags]     the test suite
# Set-up: a virtualenv in .venv with torch==2.13.0 installed first (the CPU wheel), then this package; for the
# tests also Debian's Chromium (as root, when missing), which the monitor's browser test drives through playwright.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"

setup() {
    if [ ! -x .venv/bin/python ]; then
        "$PYTHON" -m venv .venv
    fi
    if ! .venv/bin/python -c "import p2p_diloco, hivemind, bitsandbytes, rich, tensorboard, pytest, pytest_timeout, hypothesis, playwright" 2>/dev/null; then
        .venv/bin/python -m pip install --quiet --upgrade pip
        .venv/bin/python -m pip install --quiet "torch==2.13.0"
        .venv/bin/python -m pip install --quiet -e ".[dev]"
    fi
}

setup_browser() {
    # playwright (a dev dependency above) brings its driver, not a browser: it drives the system's Chromium
    if [ -x /usr/bin/chromium ] || command -v chromium >/dev/null 2>&1; then
        return
    fi
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "run.sh: installing Chromium (apt-get) for the monitor's browser test" >&2
        if DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; then
            return
        fi
    fi
    echo "run.sh: WARNING: no Chromium (apt-get install chromium as root): the browser test will be skipped" >&2
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
        setup_browser
        exec .venv/bin/python -m pytest tests "$@"
        ;;
    *)
        echo "usage: ./run.sh {swarm|test} [extra flags]" >&2
        exit 2
        ;;
esac
