"""Summarize (and optionally verify) a megatron-ucp universal checkpoint.

    megatron-ucp inspect CKPT [--verify [--prove]] [--json]

CKPT is a save folder (its latest_checkpointed_iteration.txt picks the iteration) or an
iter_XXXXXXX folder, on disk or in an object store (s3://BUCKET/PREFIX, msc://PROFILE/PATH). Exit status: 0 OK, 1 verification found problems, 2 unreadable checkpoint.
Needs numpy only: neither torch nor megatron is imported, but by --prove, which loads the model
in one CPU process (from the manifest's arguments) and recomputes its resume proof there.
"""

import argparse
import json
import os
import sys
import time

from megatron_ucp.errors import UCPError, report
from megatron_ucp.format.inspection import describe, format_table, verify
from megatron_ucp.format.storage import is_remote


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="inspect_checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="save folder (with the tracker file) or iter_XXXXXXX folder")
    p.add_argument("--verify", action="store_true",
                   help="check every tensor file's header, size and block checksums")
    p.add_argument("--prove", action="store_true",
                   help="with --verify: load the checkpoint into a one-process CPU model built from its "
                        "arguments and recompute its resume proof (what its model computes)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    if args.prove and not args.verify:
        p.error("--prove goes with --verify")
    try:
        desc = describe(args.checkpoint)
        start = time.perf_counter()
        if args.verify and is_remote(args.checkpoint):  # s3://, msc://: through the store
            from megatron_ucp.format.store_inspection import verify as verify_in_store
            problems = verify_in_store(args.checkpoint)
        else:
            problems = verify(args.checkpoint) if args.verify else None
        if args.prove and not problems:
            problems = _prove(desc)
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


def _prove(desc: dict) -> list:
    """[] when the resume proof holds in one process, else its line; the line is printed."""
    from megatron_ucp.convert import prove

    path = desc["path"]  # an iter_ folder; in a store a URL, which normpath would cut ("s3:/")
    root = path.rstrip("/").rsplit("/", 1)[0] if is_remote(path) else os.path.dirname(os.path.normpath(path))
    result = prove.check(root, desc["iteration"])
    desc["proof_check"] = result["line"]
    if result.get("ok") and desc["proof"] is None:
        return [f"{desc['path']}: no resume proof to check (saved before megatron-ucp recorded one)"]
    return [] if result.get("ok") else [result["line"]]


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
    proved = f"; {desc['proof_check']}" if desc.get("proof_check") else ""
    print(f"OK: {desc['num_tensors']} files, {desc['total_bytes']} bytes verified in {elapsed:.2f} s{proved}", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
