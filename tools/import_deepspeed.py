"""Import a DeepSpeed universal checkpoint of a Megatron-DeepSpeed GPT (the folder
`python -m deepspeed.checkpoint.ds_to_universal` wrote) as a universal checkpoint: the checkout's
shim for `megatron-ucp import-deepspeed` (megatron_ucp/convert/deepspeed.py).

    python tools/import_deepspeed.py DS_UNIVERSAL_DIR OUT [--workers N] [--no-progress]
        [--qkv-layout thirds|grouped] [--no-proof]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout

from megatron_ucp.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["import-deepspeed", *sys.argv[1:]]))
