"""`python -m megatron_ucp COMMAND ...`: the `megatron-ucp` command (megatron_ucp/cli.py)."""

import sys

from megatron_ucp.cli import main

sys.exit(main())
