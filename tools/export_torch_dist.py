"""Export a universal checkpoint as megatron-core's torch_dist checkpoint for a chosen layout (CPU only).

    python tools/export_torch_dist.py CKPT OUT [--iteration N] [--nproc P] \
        [--dist-ckpt-optim-format dp_reshardable|fully_reshardable] -- LAYOUT AND MODEL FLAGS

e.g. `-- --tensor-model-parallel-size 4 --use-distributed-optimizer`, then
`pretrain_gpt_ucp.py --ckpt-format torch_dist --load OUT` (same flags) continues. The model's
arguments come from the checkpoint; flags after `--` give the layout and override the rest.
See megatron_ucp/convert/export_torch_dist.py.
"""

import os
import sys

try:
    import megatron_ucp  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ucp.errors import run_command  # noqa: E402
from megatron_ucp.convert.export_torch_dist import main  # noqa: E402

if __name__ == "__main__":
    run_command(main, "export_torch_dist")
