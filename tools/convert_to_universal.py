"""Convert a megatron-core torch_dist checkpoint into a universal one (CPU only).

    python tools/convert_to_universal.py --input SAVE_DIR --output OUT [--iteration N] [--nproc P] \
        [-- MODEL AND LAYOUT FLAGS]

The checkpoint's stored training arguments rebuild the model and layout; flags after `--`
override or supply them. See megatron_ucp/convert.py.
"""

import os
import sys

try:
    import megatron_ucp  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ucp.convert import main  # noqa: E402
from megatron_ucp.errors import UCPError  # noqa: E402

if __name__ == "__main__":
    try:
        sys.exit(main())
    except UCPError as e:
        print(f"convert_to_universal: error: {e}", file=sys.stderr)
        sys.exit(2)
