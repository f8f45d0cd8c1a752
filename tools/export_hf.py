"""The checkout's shim for `megatron-ucp export-hf` (megatron_ucp/cli.py), usable without
installing the package: export a universal checkpoint as a Hugging Face model folder. `python
tools/export_hf.py --help` lists its flags."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout

from megatron_ucp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["export-hf", *sys.argv[1:]]))
