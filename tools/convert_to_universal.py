"""Convert a Megatron checkpoint (megatron-core torch_dist, or Megatron-LM's legacy per-rank
torch format) into a universal one (CPU only).

    python tools/convert_to_universal.py --input SAVE_DIR --output OUT [--iteration N] [--nproc P] \
        [--workers N] [--via-megatron] [--no-progress] [-- MODEL AND LAYOUT FLAGS]

The checkpoint's stored training arguments describe the model and layout; flags after `--`
override or supply them. Both formats are streamed one atomic tensor at a time in this process
(`--workers` in parallel); `--via-megatron` loads a torch_dist checkpoint with megatron's own
loader in CPU processes of its layout instead. See megatron_ucp/convert/to_universal.py, legacy.py
and torch_dist.py.
"""

import os
import sys

try:
    import megatron_ucp  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ucp.convert.to_universal import main  # noqa: E402
from megatron_ucp.errors import run_command  # noqa: E402

if __name__ == "__main__":
    run_command(main, "convert_to_universal")
