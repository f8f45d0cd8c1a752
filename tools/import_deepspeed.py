"""Import a DeepSpeed universal checkpoint of a Megatron-DeepSpeed GPT (the folder
`python -m deepspeed.checkpoint.ds_to_universal` wrote) as a universal checkpoint at the same
iteration: fp32 master weights, Adam's moments and step, the scheduler, the consumed samples
(CPU only, DeepSpeed not needed).

    python tools/import_deepspeed.py DS_UNIVERSAL_DIR OUT [--workers N] [--no-progress]

It prints the pretrain_gpt_ucp.py flags to continue with (model, AdamW and schedule; add the
layout's) and stores them in the manifest, so `--use-checkpoint-args` finds the model's. Resume
with `--load OUT --load-universal`. See megatron_ucp/convert/deepspeed.py and deepspeed_map.py.
"""

import os
import sys

try:
    import megatron_ucp  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ucp.convert.deepspeed import main  # noqa: E402
from megatron_ucp.errors import run_command  # noqa: E402

if __name__ == "__main__":
    run_command(main, "import_deepspeed")
