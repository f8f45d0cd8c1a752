"""Local-tier benchmark: the training stall of a local save against a persistent save, and the
recovery time from the local tier against from the persistent tier, as ratios measured in
one run (by hand, not in CI).

    python benchmarks/bench_local_tier.py [--hidden-size 512 --num-layers 8 --vocab-size 32000]
        [--nproc 2] [--local-dir /dev/shm/ucp-bench] [--workdir DIR] [--json out.json]

One training job (the project's loop, `--nproc` CPU processes, TP = nproc, distributed
optimizer) saves persistently to `--workdir` every 4 iterations (synchronously: the stall is
the whole save) and to the local tier in `--local-dir` at iterations 2, 6 (the stall is the
in-memory copy; the write and the replicas run in the background). Then two restarts, each a
fresh job of the same size, resume once from the local tier (iteration 6, newer than the
persistent 4 they are pointed at) and once from the persistent checkpoint 4 alone; the
recovery time is the loop's own "resumed iteration N in X s" (inventory, checks, assembly
and the universal load for the local tier; the universal load for the persistent one, whose
files are dropped from the page cache first, as bench_checkpoint.py does: read from the disk).
All processes run on this one host: there are no replicas, and the restore reads the pieces
locally (a restart on other nodes would receive them over the network first).
"""

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from disk import drop_cache  # noqa: E402 (beside this script)


def run(nproc: int, argv: list) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "megatron_ucp.train", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def seconds(pattern: str, text: str) -> list:
    return [float(x) for x in re.findall(pattern, text)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--local-dir", default=None, help="default: a new folder under /dev/shm")
    p.add_argument("--workdir", default=None)
    p.add_argument("--rounds", type=int, default=3, help="restarts from each tier, alternating")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ucp-bench-local-"))
    local = Path(a.local_dir or tempfile.mkdtemp(prefix="ucp-bench-local-", dir="/dev/shm"))
    ckpt = work / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
    model = ["--cpu", "--mock-data", "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
             "--num-attention-heads", "8", "--seq-length", "64", "--vocab-size", str(a.vocab_size),
             "--micro-batch-size", "1", "--global-batch-size", str(2 * a.nproc), "--use-distributed-optimizer",
             "--tensor-model-parallel-size", str(a.nproc), "--lr-decay-style", "constant"]
    tier = ["--local-ckpt-dir", str(local), "--local-save-interval", "2"]
    try:
        out = run(a.nproc, model + tier + ["--train-iters", "8", "--save", str(ckpt), "--save-interval", "4"])
        stalls = seconds(r"local save at iteration +\d+ started \(([\d.]+) s stall\)", out)
        saves = seconds(r"saved checkpoint at iteration +\d+ to .* in ([\d.]+) s", out)
        restart = model + ["--train-iters", "9", "--load", str(ckpt), "--ckpt-step", "4", "--load-universal"]
        from_local, from_persistent = "", ""
        for _ in range(a.rounds):  # alternating, so that a busy spell of the machine hits both
            from_local += run(a.nproc, restart + tier[:2] + ["--local-save-interval", "100"])
            drop_cache(ckpt / "iter_0000004")  # the persistent tier is storage: read from the disk
            from_persistent += run(a.nproc, restart)
    finally:
        if not a.local_dir:
            shutil.rmtree(local, ignore_errors=True)
    local_s = seconds(r"resumed iteration 6 in ([\d.]+) s", from_local)
    persistent_s = seconds(r"resumed iteration 4 in ([\d.]+) s", from_persistent)
    if not (stalls and saves and local_s and persistent_s):
        sys.exit("a timing line is missing from the training output:\n" + out[-2000:] + from_local[-2000:])
    state_bytes = sum(f.stat().st_size for f in (ckpt / "iter_0000004" / "tensors").iterdir())
    r = {"state_bytes": state_bytes, "nproc": a.nproc, "local_stall_s": stalls, "persistent_save_s": saves,
         "local_recovery_rounds_s": local_s, "persistent_recovery_rounds_s": persistent_s,
         "local_recovery_s": statistics.median(local_s), "persistent_recovery_s": statistics.median(persistent_s),
         "local_restore_lines": re.findall(r"local checkpoint tier: restored.*", from_local)}
    r["stall_ratio"] = statistics.median(saves) / statistics.median(stalls)
    r["recovery_ratio"] = r["persistent_recovery_s"] / r["local_recovery_s"]
    print(f"state: {state_bytes / 1e6:.0f} MB (fp32 weights and Adam moments), {a.nproc} processes")
    print(f"training stall  local save {statistics.median(stalls):.3f} s (median of {len(stalls)}) | "
          f"persistent save {statistics.median(saves):.3f} s (median of {len(saves)}) | "
          f"persistent / local = {r['stall_ratio']:.1f}x")
    print(f"recovery        local tier {r['local_recovery_s']:.2f} s | persistent {r['persistent_recovery_s']:.2f} s"
          f" (medians of {a.rounds}) | persistent / local = {r['recovery_ratio']:.2f}x")
    print(f"local restore, one round: {r['local_restore_lines'][0]}")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
