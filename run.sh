#!/usr/bin/env bash
# The two commands of the quick start, each doing all of its own set-up on a fresh machine:
#   ./run.sh swarm [swarm.py flags]   a local swarm of 3 peers on the built-in corpus, live progress, report + plot
#   ./run.sh test  [pytest flags]     the test suite
# Set-up: a virtualenv in .venv with torch==2.13.0 installed first (the CPU wheel), then this package; for the
# tests also Debian's Chromium and iptables (as root, when missing): see setup_system.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"

setup() {
    if [ ! -x .venv/bin/python ]; then
        "$PYTHON" -m venv .venv
    fi
    # the Hugging Face packages are only looked for, not imported: importing them takes seconds
    if ! .venv/bin/python -c "import p2p_diloco, hivemind, bitsandbytes, rich, pytest, pytest_timeout, hypothesis, playwright
import sys; from importlib.util import find_spec
sys.exit(not all(find_spec(name) for name in ('transformers', 'datasets', 'tokenizers', 'pyarrow', 'tensorboard', 'matplotlib')))" 2>/dev/null; then
        .venv/bin/python -m pip install --quiet --upgrade pip
        .venv/bin/python -m pip install --quiet "torch==2.13.0"
        .venv/bin/python -m pip install --quiet -e ".[dev,all]"  # every optional extra: the tests use them all
    fi
}

setup_system() {
    # Debian packages some tests need, as root, when missing: Chromium (playwright, a dev dependency above,
    # brings its driver, not a browser: the monitor's browser test drives the system's Chromium) and iptables
    # (the home routers of the NAT test). Without them those tests are skipped with the reason.
    local missing=()
    [ -x /usr/bin/chromium ] || command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || missing+=(iptables)
    [ ${#missing[@]} -eq 0 ] && return
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "run.sh: installing ${missing[*]} (apt-get) for the browser and NAT tests" >&2
        if DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; then
            return
        fi
    fi
    echo "run.sh: WARNING: ${missing[*]} missing (apt-get install ${missing[*]} as root): tests that need them will be skipped" >&2
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
        setup_system
        exec .venv/bin/python -m pytest tests "$@"
        ;;
    *)
        echo "usage: ./run.sh {swarm|test} [extra flags]" >&2
        exit 2
        ;;
esac
