"""The checkout's shim for `megatron-ucp convert` (megatron_ucp/cli.py), usable without installing
the package: convert a Megatron checkpoint (torch_dist, or legacy per-rank torch) into a
universal one. `python tools/convert_to_universal.py --help` lists its flags."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout

from megatron_ucp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
