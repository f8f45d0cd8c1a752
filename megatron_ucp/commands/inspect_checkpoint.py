"""Summarize (and optionally verify) a megatron-ucp universal checkpoint.

    megatron-ucp inspect CKPT [--verify] [--json]

CKPT is a save folder (its latest_checkpointed_iteration.txt picks the iteration) or an
iter_XXXXXXX folder. Exit status: 0 OK, 1 verification found problems, 2 unreadable checkpoint.
Needs numpy only: neither torch nor megatron is imported.
"""

import argparse
import json
import os
import sys
import time

from megatron_ucp.errors import UCPError, report
from megatron_ucp.format.inspection import describe, format_table, verify


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="inspect_checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="save folder (with the tracker file) or iter_XXXXXXX folder")
    p.add_argument("--verify", action="store_true",
                   help="check every tensor file's header, size and block checksums")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    try:
        desc = describe(args.checkpoint)
        start = time.perf_counter()
        problems = verify(args.checkpoint) if args.verify else None
        elapsed = time.perf_counter() - start
    except UCPError as e:
        return report("inspect_checkpoint", e)
    except OSError as e:
        return report("inspect_checkpoint", UCPError(str(e)))
    try:
        code = _print(desc, problems, elapsed, args.json)
        sys.stdout.flush()
        return code
    except BrokenPipeError:  # `| head`: the reader has what it wanted; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so exit's flush is quiet
        return 0 if not problems else 1


def _print(desc: dict, problems, elapsed: float, as_json: bool) -> int:
    if as_json:
        if problems is not None:
            desc["problems"] = problems
        print(json.dumps(desc, indent=1))
    else:
        print(format_table(desc))
    if problems is None:
        return 0
    out = sys.stderr if as_json else sys.stdout  # keep --json stdout parseable
    if problems:
        print(f"FAILED: {len(problems)} problem{'s' if len(problems) > 1 else ''}", file=out)
        for msg in problems:
            print(f"  {msg}", file=out)
        return 1
    print(f"OK: {desc['num_tensors']} files, {desc['total_bytes']} bytes verified in {elapsed:.2f} s", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
