"""Local-tier benchmark: the training stall of a local save against a persistent save, and the
recovery time from the local tier against the persistent tier and a memcpy of the state, as
ratios measured in one run (by hand, not in CI).

    python benchmarks/bench_local_tier.py [--sizes 512x8,1024x10] [--vocab-size 32000]
        [--nproc 2] [--local-dir /dev/shm/ucp-bench] [--workdir DIR] [--rounds 2] [--json out.json]

`--sizes`: the models measured in one run, hidden size x layers: 512x8 is 500 MB of state,
1024x10 about 1.9 GB.

One training job (the project's loop, `--nproc` CPU processes on 2 pretended nodes, each rank's
host name node0 or node1 as tests/runner.py pretends them, TP = nproc, distributed optimizer)
saves persistently to `--workdir` every 4 iterations (synchronously: the stall is the whole
save) and to the local tier in `--local-dir` at iterations 2, 6 with one replica on the other
node (the stall is the in-memory copy; the write and the replicas run in the background). Then
restarts, each a fresh job of the same size, mostly after node1 is lost (its dir deleted: node1
is a new, empty node that receives from node0 the bytes its rank reads of the pieces it
lacks): from the local tier (iteration 6, newer than the persistent 4 they are pointed at)
and from the persistent checkpoint 4 alone (its files dropped from the page cache first, as bench_checkpoint.py does:
read from the disk), on the saving layout (TP = nproc) and on another (PP2 x DP nproc/2); and
once on the saving layout with no node lost (a process crash: every piece is where it was;
node1's dir is put back as training left it before each such restart, so that every round
measures a crash). The
recovery time is the loop's own "resumed iteration N in X s"; the local restore's own line
says where its time goes and the MB each node received against the MB its ranks loaded.
All "nodes" share this one machine: the transfers are loopback gloo, the disk is one.
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
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from disk import drop_cache  # noqa: E402 (beside this script)

# Each rank pretends to run on node<rank * 2 // world> (the local tier's nodes are host names).
PRETEND = """import os, runpy, socket
node = "node%d" % (int(os.environ["RANK"]) * 2 // int(os.environ["WORLD_SIZE"]))
socket.gethostname = lambda: node
runpy.run_module("megatron_ucp.train", run_name="__main__")
"""


def run(nproc: int, argv: list, work: Path) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = work / "pretend_nodes.py"
    script.write_text(PRETEND)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port), str(script), *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"training failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def seconds(pattern: str, text: str) -> list:
    return [float(x) for x in re.findall(pattern, text)]


def memcpy_seconds(nbytes: int) -> float:
    """The best of 3 copies of `nbytes` from one array into another already touched one: the
    physical floor of a restore on one node (the state crosses memory once)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return best


def snapshot_floor(nbytes: int) -> float:
    """The best of 3 copies of `nbytes` into a buffer touched before (a local save's stall
    copies a rank's share into the buffers of the previous save): what a snapshot must cost."""
    return memcpy_seconds(nbytes)


def traffic(line: str) -> dict:
    """{node: (MB received, MB loaded)} of a restore line."""
    part = re.search(r"MB received / loaded: ([^;)]*)", line).group(1)
    return {m[0]: (float(m[1]), float(m[2])) for m in re.findall(r"(\S+) ([\d.]+) / ([\d.]+)", part)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="512x8,1024x10", help="models measured, hidden x layers, comma-separated")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--local-dir", default=None, help="default: a new folder under /dev/shm")
    p.add_argument("--workdir", default=None)
    p.add_argument("--rounds", type=int, default=2, help="restarts from each tier per layout, alternating")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.nproc % 2:
        sys.exit("--nproc must be even (2 pretended nodes)")
    results = []
    for size in a.sizes.split(","):
        hidden, layers = (int(x) for x in size.lower().split("x"))
        results.append(measure(a, hidden, layers))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


def measure(a, hidden: int, layers: int) -> dict:
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ucp-bench-local-")) / f"h{hidden}x{layers}"
    local = Path(a.local_dir or tempfile.mkdtemp(prefix="ucp-bench-local-", dir="/dev/shm"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(local, ignore_errors=True)
    model = ["--cpu", "--mock-data", "--num-layers", str(layers), "--hidden-size", str(hidden),
             "--num-attention-heads", "8", "--seq-length", "64", "--vocab-size", str(a.vocab_size),
             "--micro-batch-size", "1", "--global-batch-size", str(2 * a.nproc), "--use-distributed-optimizer",
             "--lr-decay-style", "constant"]
    same = ["--tensor-model-parallel-size", str(a.nproc)]
    # restart kind -> (layout, whether node1 is lost first)
    layouts = {"same, no loss": (same, False), "same layout": (same, True),
               "changed layout": (["--pipeline-model-parallel-size", "2"], True)}
    tier = ["--local-ckpt-dir", str(local), "--local-save-interval", "2"]
    local_out = {name: "" for name in layouts}
    persistent_out = {name: "" for name in layouts}
    pristine = work / "node1.pristine"  # node1's tier as training left it: each round's crash finds it
    try:
        out = run(a.nproc, model + same + tier
                  + ["--train-iters", "8", "--save", str(ckpt), "--save-interval", "4"], work)
        stalls = seconds(r"local save at iteration +\d+ started \(([\d.]+) s stall", out)
        probes = seconds(r"local save at iteration +\d+ started \([\d.]+ s stall: probe ([\d.]+) s", out)
        copies = seconds(r"local save at iteration +\d+ started \([\d.]+ s stall: probe [\d.]+ s, copy ([\d.]+) s", out)
        saves = seconds(r"saved checkpoint at iteration +\d+ to .* in ([\d.]+) s", out)
        shutil.rmtree(pristine, ignore_errors=True)
        shutil.copytree(local / "node1", pristine)
        for _ in range(a.rounds):  # alternating, so that a busy spell of the machine hits both
            for name, (layout, lost) in layouts.items():
                restart = model + layout + ["--train-iters", "9", "--load", str(ckpt), "--ckpt-step", "4",
                                            "--load-universal"]
                shutil.rmtree(local / "node1", ignore_errors=True)
                if not lost:  # a crash: every piece where it was; else node1 is a new, empty node
                    shutil.copytree(pristine, local / "node1")
                local_out[name] += run(a.nproc, restart + tier[:2] + ["--local-save-interval", "100"], work)
                if lost:  # the persistent restart of the saving layout serves both of its kinds
                    drop_cache(ckpt / "iter_0000004")  # the persistent tier is storage: read from the disk
                    persistent_out[name] += run(a.nproc, restart, work)
    finally:
        shutil.rmtree(pristine, ignore_errors=True)
        if not a.local_dir:
            shutil.rmtree(local, ignore_errors=True)
    state_bytes = sum(f.stat().st_size for f in (ckpt / "iter_0000004" / "tensors").iterdir())
    floor = memcpy_seconds(state_bytes)
    share = snapshot_floor(state_bytes // a.nproc)
    r = {"hidden": hidden, "layers": layers, "state_bytes": state_bytes, "nproc": a.nproc, "local_stall_s": stalls,
         "persistent_save_s": saves, "memcpy_s": floor, "rank_share_memcpy_s": share, "restarts": {}}
    if not (stalls and saves):
        sys.exit("a timing line is missing from the training output:\n" + out[-2000:])
    print(f"state: {state_bytes / 1e6:.0f} MB (hidden {hidden}, {layers} layers: fp32 weights and Adam moments), "
          f"{a.nproc} processes on 2 pretended nodes; a memcpy of it: {floor:.3f} s, of one rank's share: {share:.3f} s")
    # The first local save allocates its buffers; the later ones reuse them (the steady state).
    steady = stalls[1:] or stalls
    r["stall_probe_s"], r["stall_copy_s"] = probes, copies
    r["stall_ratio"] = statistics.median(saves) / statistics.median(steady)
    r["stall_over_copy"] = statistics.median(steady) / share
    print(f"training stall  local save {statistics.median(steady):.3f} s (median of {len(steady)} after the first, "
          f"{stalls[0]:.3f} s) | in-memory copy of a rank's share {share:.3f} s | local / copy = "
          f"{r['stall_over_copy']:.1f}x | persistent save {statistics.median(saves):.3f} s (median of {len(saves)}) | "
          f"persistent / local = {r['stall_ratio']:.1f}x")
    if probes and copies:  # where the stall goes (after the first save)
        print(f"  the local stall: the resume proof's probe (a forward pass) {statistics.median(probes[1:] or probes):.3f} s, "
              f"the copy into the reused buffers {statistics.median(copies[1:] or copies):.3f} s, the rest planning")
    for name in layouts:
        local_s = seconds(r"resumed iteration 6 in ([\d.]+) s", local_out[name])
        persistent_s = seconds(r"resumed iteration 4 in ([\d.]+) s",
                               persistent_out[name] or persistent_out["same layout"])
        lines = re.findall(r"local checkpoint tier: restored.*", local_out[name])
        if not (local_s and persistent_s and lines):
            sys.exit(f"{name}: a timing line is missing:\n" + local_out[name][-2000:] + persistent_out[name][-2000:])
        moved = traffic(lines[-1])
        x = {"local_recovery_rounds_s": local_s, "persistent_recovery_rounds_s": persistent_s,
             "local_recovery_s": statistics.median(local_s), "persistent_recovery_s": statistics.median(persistent_s),
             "restore_lines": lines, "mb_received_loaded": moved}
        x["persistent_over_local"] = x["persistent_recovery_s"] / x["local_recovery_s"]
        x["local_over_memcpy"] = x["local_recovery_s"] / floor
        r["restarts"][name] = x
        print(f"{name:15} local {x['local_recovery_s']:.2f} s | persistent {x['persistent_recovery_s']:.2f} s "
              f"(medians of {a.rounds}) | persistent / local = {x['persistent_over_local']:.2f}x | local / memcpy "
              f"= {x['local_over_memcpy']:.1f}x | received / loaded per node: "
              + ", ".join(f"{h} {rc:.0f} / {ld:.0f} MB" for h, (rc, ld) in sorted(moved.items())))
        print(f"  {lines[-1]}")
    return r


if __name__ == "__main__":
    sys.exit(main())
