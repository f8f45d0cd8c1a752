"""The checkout's shim for `megatron-ucp inspect` (megatron_ucp/cli.py), usable without installing
the package: summarize (and optionally verify) a universal checkpoint. `python
tools/inspect_checkpoint.py --help` lists its flags."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout

from megatron_ucp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["inspect", *sys.argv[1:]]))
