"""The checkout's shim for `megatron-ucp import-hf` (megatron_ucp/cli.py), usable without
installing the package: import a Hugging Face model folder as a universal checkpoint. `python
tools/import_hf.py --help` lists its flags."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout

from megatron_ucp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["import-hf", *sys.argv[1:]]))
