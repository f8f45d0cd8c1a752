#!/usr/bin/env bash
# Set up a virtual environment (pinned CPU torch, megatron-core, this package) and run:
#   bash run.sh demo    # CPU demo: train, save universally, resume on another layout
#   bash run.sh test    # the default test suite (what CI runs)
#   bash run.sh gpu-check   # on a GPU machine: TE spec, FusedAdam, bf16/fp16, NCCL (tools/gpu_check.py)
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = gpu-check ]; then
    # The GPU machine's own CUDA torch, transformer-engine and megatron-core: the CPU venv below
    # would install a CPU torch.
    shift; PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" tools/gpu_check.py "$@"
fi
venv="${UCP_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
# torch is pinned: a bare `torch` requirement pulls a multi-GB CUDA build. The hf extra
# (transformers, matplotlib) is for tests/test_hf.py; it does not touch the pinned torch.
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
    "torch==2.13.0" "megatron-core==0.16.1" -e ".[dev,hf]"
case "${1:-}" in
    demo) shift; exec "$venv/bin/python" examples/cpu_demo.py "$@" ;;
    test) shift; exec "$venv/bin/python" -m pytest -q "$@" ;;
    *) echo "usage: bash run.sh demo|test|gpu-check [args...]" >&2; exit 2 ;;
esac
