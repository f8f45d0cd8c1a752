"""The checkout's shim for `megatron-ucp gpu-check` (megatron_ucp/cli.py), usable without
installing the package: the GPU path checked on one GPU (`bash run.sh gpu-check`). `python
tools/gpu_check.py --help` lists its flags."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout

from megatron_ucp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["gpu-check", *sys.argv[1:]]))
