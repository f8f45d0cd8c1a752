#!/usr/bin/env bash
# Set up a virtual environment (pinned CPU torch, megatron-core, this package) and run:
#   bash run.sh demo    # CPU demo: train, save universally, resume on another layout
#   bash run.sh test    # the default test suite (what CI runs)
set -euo pipefail
cd "$(dirname "$0")"
venv="${UCP_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
# torch is pinned: a bare `torch` requirement pulls a multi-GB CUDA build.
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
    "torch==2.13.0" "megatron-core==0.16.1" -e ".[dev]"
case "${1:-}" in
    demo) shift; exec "$venv/bin/python" examples/cpu_demo.py "$@" ;;
    test) shift; exec "$venv/bin/python" -m pytest -q "$@" ;;
    *) echo "usage: bash run.sh demo|test [args...]" >&2; exit 2 ;;
esac
