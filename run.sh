#!/usr/bin/env bash
# Set up a virtual environment (pinned torch, megatron-core, this package) and run:
#   bash run.sh demo    # CPU demo: train, save universally, resume on another layout
#   bash run.sh test    # the default test suite (what CI runs)
#   bash run.sh setup   # only make (or update) the virtual environment
#   bash run.sh gpu-check   # on a GPU machine: TE spec, FusedAdam, bf16/fp16, NCCL (megatron-ucp gpu-check)
#   bash run.sh setup-bridge   # the 0.19 venv, then Megatron-Bridge into .bridge-libs (README, "Megatron-Bridge")
# The megatron-core release is chosen by UCP_CORE:
#   0.16 (default): Python 3.11 (python3), torch 2.13.0 CPU, megatron-core 0.16.1, venv .venv
#   0.19:           Python 3.12, torch 2.14.1, megatron-core 0.19.2, venv .venv-core019
#                   e.g. `UCP_CORE=0.19 bash run.sh test`
# When the other release's venv exists, its interpreter is passed to the tests as
# UCP_OTHER_PYTHON (tests/test_cross_version.py: checkpoints saved under one, resumed under the
# other); UCP_REQUIRE_OTHER=1 (CI) makes a missing one a test failure instead of a skip.
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = gpu-check ]; then
    # The GPU machine's own CUDA torch, transformer-engine and megatron-core: the CPU venv below
    # would install a CPU torch.
    shift; PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m megatron_ucp gpu-check "$@"
fi

# An interpreter of Python $1 (e.g. 3.12) that really runs: $UCP_PYTHON, pythonX.Y on PATH
# (a pyenv shim that refuses counts as absent), else the newest of pyenv's versions/X.Y.*.
find_python() {
    local want="$1" candidate
    for candidate in ${UCP_PYTHON:-} "python$want" \
            $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want".*/bin/python"$want" 2>/dev/null | sort -rV); do
        if "$candidate" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$want'" 2>/dev/null; then
            echo "$candidate"; return 0
        fi
    done
    echo "run.sh: UCP_CORE=$core needs Python $want: no working python$want on PATH, none in" \
         "${PYENV_ROOT:-$HOME/.pyenv}/versions/$want.*/bin/ (install one, or name it with UCP_PYTHON=...)" >&2
    return 1
}

if [ "${1:-}" = setup-bridge ]; then
    export UCP_CORE=0.19  # megatron-bridge 0.6.2 pairs with megatron-core 0.19.x
fi
core="${UCP_CORE:-0.16}"
case "$core" in
    0.16) venv="${UCP_VENV:-.venv}"; want=3.11; other=.venv-core019
          # torch is pinned: a bare `torch` requirement pulls a multi-GB CUDA build.
          pins=("torch==2.13.0" "megatron-core==0.16.1") ;;
    0.19) venv="${UCP_VENV:-.venv-core019}"; want=3.12; other=.venv
          # megatron-core 0.19 needs Python >= 3.12, for which the registry's torch is its CUDA
          # build (about 5 GB installed; it runs on CPU). README: "megatron-core 0.19".
          pins=("torch==2.14.1" "megatron-core==0.19.2") ;;
    *) echo "run.sh: UCP_CORE=$core: expected 0.16 or 0.19" >&2; exit 2 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
    if [ "$core" = 0.16 ] && [ -z "${UCP_PYTHON:-}" ]; then
        python=python3  # as before: the machine's python3 (3.11 or newer)
    else
        python="$(find_python "$want")"
    fi
    "$python" -m venv "$venv"
fi
# The hf extra (transformers, matplotlib) is for tests/test_hf.py; it does not touch the pinned torch.
# The deepspeed extra (0.16 only, whose suite runs tests/test_deepspeed.py) without its CUDA ops
# (DS_BUILD_OPS=0); the fsdp extra (0.19: einops, which Megatron-FSDP imports); its CPU communication op is JIT-built on first use into $venv/torch_extensions.
# The s3-tests extra: boto3 and moto[server] (tests/test_object_store.py's loopback S3 endpoint);
# the msc extra (multi-storage-client) on 0.19 only: megatron-core 0.16 turns its MSC path on by
# itself wherever the package is importable, and its torch_dist writer processes then failed late
# in a long process (tests/test_resume_matrix.py); 0.19 uses it only with --enable-msc.
extras=dev,hf,fsdp,s3-tests,msc
if [ "$core" = 0.16 ]; then extras=dev,hf,deepspeed,s3-tests; fi
DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}" -e ".[$extras]"
if [ -z "${UCP_OTHER_PYTHON:-}" ] && [ -x "$other/bin/python" ]; then
    export UCP_OTHER_PYTHON="$PWD/$other/bin/python"
fi
# Megatron-Bridge beside the 0.19 venv, not in it: `pip install megatron-bridge` fails from the
# registry (fast-hadamard-transform is source-only, megatron-core[dev] pins an absent
# nvidia-resiliency-ext), so its import-time dependencies are resolved against the venv (torch
# and megatron-core pinned: nothing replaces them) and installed with megatron-bridge, without
# dependencies, into .bridge-libs, which only Bridge runs put on PYTHONPATH
# (megatron_ucp/bridge/env.py; transformer-engine and nvidia-resiliency-ext are stubbed there).
setup_bridge() {
    local target="${UCP_BRIDGE_LIBS:-$PWD/.bridge-libs}" report
    [ "$core" = 0.19 ] || { echo "run.sh: Megatron-Bridge needs UCP_CORE=0.19" >&2; return 2; }
    report="$(mktemp)"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --dry-run --ignore-installed \
        --no-deps --report "$report" "megatron-bridge==0.6.2" >/dev/null
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --dry-run --report "$report.deps" \
        "${pins[@]}" "omegaconf>=2.3" "hydra-core>=1.3.4,<1.4" datasets megatron-energon nvidia-modelopt \
        requests >/dev/null
    "$venv/bin/python" - "$report" "$report.deps" > "$report.txt" <<'PY'
import json, sys
for path in sys.argv[1:]:
    for item in json.load(open(path))["install"]:
        meta = item["metadata"]
        if meta["name"].lower() not in ("torch", "megatron-core"):
            print(f"{meta['name']}=={meta['version']}")
PY
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --upgrade \
        --target "$target" -r "$report.txt"
    rm -f "$report" "$report.deps" "$report.txt"
    echo "Megatron-Bridge installed into $target"
}
case "${1:-}" in
    setup) ;;
    setup-bridge) setup_bridge ;;
    demo) shift; exec "$venv/bin/python" examples/cpu_demo.py "$@" ;;
    test) shift; exec "$venv/bin/python" -m pytest -q "$@" ;;
    *) echo "usage: [UCP_CORE=0.16|0.19] bash run.sh setup|setup-bridge|demo|test|gpu-check [args...]" >&2; exit 2 ;;
esac
