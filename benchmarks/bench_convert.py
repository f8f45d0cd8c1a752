"""Conversion benchmark: Megatron checkpoints of a few GB (legacy `torch` and megatron-core
`torch_dist`, distributed optimizer) converted to universal ones, against the disk's own
bandwidth measured in the same run, and the converter's peak memory against the largest tensor
(by hand, not in CI).

    python benchmarks/bench_convert.py [--hidden-size 2048 --num-layers 3 --vocab-size 16000]
        [--formats torch torch_dist] [--workers 1 2] [--via-megatron] [--workdir DIR] [--json out.json]

1. A short run of pretrain_gpt_ucp.py (2 CPU processes, TP2, 1 iteration) saves the checkpoint
   with `--ckpt-format torch|torch_dist --use-distributed-optimizer` (torch_dist: megatron's
   default `dp_reshardable` optimizer sharding).
2. Disk baseline: write the converted byte count with fsync (the faster of a plain write and
   one that starts writeback per 64 MiB, as the universal save does per file), drop it from the page cache
   (posix_fadvise), read it back.
3. The checkpoint's files are dropped from the page cache the same way, then
   tools/convert_to_universal.py runs as a child process; its process tree's RSS is sampled.
Time ratio = conversion seconds / (baseline write + read seconds of the same bytes).
`--via-megatron` adds, for torch_dist, a run of the non-streaming path (megatron's loader in
processes of the source layout) for comparison.
"""

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from disk import CHUNK, drop_cache, sequential_read, sequential_write

REPO = Path(__file__).resolve().parents[1]


def _timed_write(path: Path, nbytes: int, block: bytes, kick: bool) -> float:
    start = time.perf_counter()
    sequential_write(path, nbytes, block, kick)
    return time.perf_counter() - start


def disk_baseline(directory: Path, nbytes: int) -> dict:
    """Sequential write (fsync included) and read of `nbytes` in `directory`. The write is the
    faster of a plain one and one that starts writeback after each chunk."""
    path = directory / "disk_baseline.bin"
    block = os.urandom(CHUNK)
    plain_s = _timed_write(path, nbytes, block, False)
    path.unlink()
    os.sync()
    write_s = min(plain_s, _timed_write(path, nbytes, block, True))
    drop_cache(path)
    start = time.perf_counter()
    sequential_read(path)
    read_s = time.perf_counter() - start
    path.unlink()
    os.sync()
    return {"bytes": nbytes, "write_s": write_s, "plain_write_s": plain_s, "read_s": read_s}


def run_sampled(cmd, env) -> tuple:
    """Run `cmd`; return (seconds, peak RSS of its whole process tree in bytes)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    parent, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            procs = [parent] + parent.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in procs if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[1]} failed with exit code {proc.returncode}")
    return seconds, peak


def make_checkpoint(work: Path, a, fmt: str) -> Path:
    ckpt = work / fmt
    if (ckpt / "latest_checkpointed_iteration.txt").exists():
        return ckpt
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", str(port), str(REPO / "pretrain_gpt_ucp.py"), "--cpu", "--mock-data",
           "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size), "--num-attention-heads", "16",
           "--seq-length", "16", "--vocab-size", str(a.vocab_size), "--micro-batch-size", "1",
           "--global-batch-size", "1", "--train-iters", "1", "--tensor-model-parallel-size", "2",
           "--use-distributed-optimizer", "--ckpt-format", fmt, "--save", str(ckpt)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    subprocess.run(cmd, check=True, env=env)
    return ckpt


def idle_rss() -> int:
    """RSS of a Python process that has imported what the converter imports (its floor)."""
    code = ("import torch, numpy, tqdm, megatron_ucp.convert.to_universal, megatron_ucp.convert.legacy, psutil, os, "
            "megatron.core.models.gpt; "
            "print(psutil.Process(os.getpid()).memory_info().rss)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return int(subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True,
                              text=True).stdout.strip())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-layers", type=int, default=3)
    p.add_argument("--vocab-size", type=int, default=16000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--formats", nargs="+", default=["torch", "torch_dist"], choices=["torch", "torch_dist"])
    p.add_argument("--via-megatron", action="store_true", help="also time torch_dist through megatron's loader")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ucp-bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    results = {"idle_rss": idle_rss(), "runs": []}
    for fmt in a.formats:
        ckpt = make_checkpoint(work, a, fmt)
        files = [f for f in ckpt.rglob("*") if f.is_file() and f.name != "latest_checkpointed_iteration.txt"]
        input_bytes = sum(f.stat().st_size for f in files)
        modes = [(w, False) for w in a.workers] + ([(1, True)] if a.via_megatron and fmt == "torch_dist" else [])
        for workers, via in modes:
            out = work / f"universal_{fmt}_w{workers}{'_via' if via else ''}"
            shutil.rmtree(out, ignore_errors=True)
            for f in files:
                drop_cache(f)
            cmd = [sys.executable, str(REPO / "tools" / "convert_to_universal.py"), "--input", str(ckpt),
                   "--output", str(out), "--workers", str(workers)] + (["--via-megatron"] if via else [])
            seconds, peak = run_sampled(cmd, env)
            manifest = json.loads(next(out.glob("iter_*/ucp.json")).read_text())
            tensors = manifest["tensors"].values()
            out_bytes = sum(e["file_size"] for e in tensors)
            largest = max(tensors, key=lambda e: math.prod(e["shape"]) + e["padding_rows"] * math.prod(e["shape"][1:]))
            largest_tensor = 4 * (math.prod(largest["shape"]) + largest["padding_rows"] * math.prod(largest["shape"][1:]))
            disk = disk_baseline(work, out_bytes)
            results["runs"].append({"format": fmt, "via_megatron": via, "input_bytes": input_bytes, "workers": workers,
                                    "seconds": seconds, "peak_rss": peak, "output_bytes": out_bytes,
                                    "tensors": len(manifest["tensors"]), "largest_tensor_bytes": largest_tensor,
                                    "largest_file_bytes": largest["file_size"], "disk": disk})
            shutil.rmtree(out, ignore_errors=True)
    print(f"\nidle converter process RSS {results['idle_rss'] / 2**20:.0f} MiB")
    for r in results["runs"]:
        d = r["disk"]
        base = d["write_s"] + d["read_s"]
        how = "through megatron's loader (--via-megatron)" if r["via_megatron"] else f"workers {r['workers']}"
        print(f"{r['format']} ({r['input_bytes'] / 1e9:.2f} GB, TP2, distributed optimizer), {how}: "
              f"{r['tensors']} tensors, {r['output_bytes'] / 1e9:.2f} GB written in {r['seconds']:.1f} s "
              f"({r['output_bytes'] / r['seconds'] / 1e9:.3f} GB/s end to end, process start included)")
        print(f"  disk, same bytes: write+fsync {d['write_s']:.1f} s, read {d['read_s']:.1f} s -> "
              f"time ratio {r['seconds'] / base:.2f}x (conversion / (write + read))")
        idle = results["idle_rss"] * (1 if r["via_megatron"] else r["workers"])
        print(f"  peak RSS {r['peak_rss'] / 2**20:.0f} MiB = {r['peak_rss'] / r['largest_tensor_bytes']:.2f}x the "
              f"largest tensor ({r['largest_tensor_bytes'] / 2**20:.0f} MiB, one state), "
              f"{(r['peak_rss'] - idle) / r['largest_tensor_bytes']:.2f}x above the idle processes' RSS")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
