"""Checkpoint benchmark: universal save / resharded load against megatron-core's torch_dist and
against the disk's own sequential bandwidth, all measured in the same run (by hand, not in CI).

    python benchmarks/bench_checkpoint.py [--hidden-size 1152 --num-layers 8 --vocab-size 32000]
        [--nproc 4] [--src tp2pp2] [--dst tp1dp4] [--rounds 5] [--workdir DIR] [--json out.json]

The default state is about 2 GB of fp32 weights and Adam moments over 4 processes (peak about
16.5 GiB in use on the machine during the run, most of it torch_dist's reshardable load);
`--hidden-size 512` gives 0.5 GB. Prints a table of ratios and writes the raw numbers as JSON.
Times include fsync for every writer (ours, torch_dist's, and the baseline, which is the faster
of a plain sequential write and one that starts writeback after each 64 MiB). Every load and
the read baseline read from the disk: their files are dropped from the page cache first
(posix_fadvise DONTNEED, no root needed). The save and the universal load are each timed in
`--rounds` pairs with a disk baseline of the same bytes right before, and their ratios are the
median pair's; the job's first save, whose page-cache memory is fresh, is printed apart. Each
universal load starts without optimizer state and allocates it, as a job's first load does.
Each load round runs both read policies (`once`: DP replicas split the reads and exchange;
`per-rank`), plain and verified, for the resharded load and for a same-layout load of the
state saved again on the target layout; it prints storage bytes read / checkpoint tensor bytes
for each.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "tp2pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "tp1dp4": [],
    "tp4": ["--tensor-model-parallel-size", "4"],
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=1152)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--src", default="tp2pp2", choices=LAYOUTS)
    p.add_argument("--dst", default="tp1dp4", choices=LAYOUTS)
    p.add_argument("--rounds", type=int, default=5, help="(disk baseline, universal save) and (read baseline, universal loads) rounds")
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ucp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = ["--cpu", "--mock-data", "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
             "--num-attention-heads", "8", "--seq-length", "64", "--vocab-size", str(a.vocab_size),
             "--micro-batch-size", "1", "--global-batch-size", str(a.nproc * 2), "--use-distributed-optimizer",
             "--train-iters", "1"]
    spec = {"work": str(work), "model": model, "src": LAYOUTS[a.src], "dst": LAYOUTS[a.dst], "rounds": a.rounds}
    (work / "spec.json").write_text(json.dumps(spec))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / "raw.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           str(REPO / "benchmarks" / "bench_worker.py"), str(work / "spec.json"), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    subprocess.run(cmd, check=True, env=env)
    (work / "spec.json").write_text(json.dumps(dict(spec, phase="load")))  # fresh processes
    cmd[cmd.index("--master-port") + 1] = str(port + 1) if port < 65535 else str(port - 1)
    # A fixed mmap threshold: glibc would otherwise serve later rounds' moments from memory
    # the previous round freed, where a job's first load touches fresh pages.
    subprocess.run(cmd, check=True, env=dict(env, MALLOC_MMAP_THRESHOLD_=str(128 * 1024)))
    r = json.loads(out.read_text())
    gb = r["checkpoint_bytes"] / 1e9
    rounds = list(zip(r["disk_rounds"], r["universal_save_rounds_s"]))
    r["universal_save_s"] = statistics.median(r["universal_save_rounds_s"])
    save_vs_disk = statistics.median(gb / t / (d["bytes"] / d["write_s"] / 1e9) for d, t in rounds)
    disk_w = statistics.median(d["bytes"] / d["write_s"] / 1e9 for d, _ in rounds)
    reads = [d["bytes"] / d["read_s"] / 1e9 for d in r["disk_read_rounds"]]
    disk_r = statistics.median(reads)
    reads_dst = [d["bytes"] / d["read_s"] / 1e9 for d in r["disk_read_rounds_dst"]]
    gb_dst = r["checkpoint_bytes_dst"] / 1e9

    def load_row(label, prefix, policy, verify, gbytes, disk_rates):
        key = f"{prefix}{'_verified' if verify else ''}{'' if policy == 'once' else '_per_rank'}"
        times = r[f"{key}_rounds_s"]
        r[f"{key}_s"] = statistics.median(times)
        vs_disk = statistics.median(gbytes / t / d for t, d in zip(times, disk_rates))
        vs_td = r["torch_dist_fully_reshardable_resharded_load_s"] / r[f"{key}_s"] if prefix.endswith("resharded_load") else None
        return (label, r[f"{key}_s"], vs_disk, vs_td)

    load_rows = []
    for prefix, what, gbytes, rates in (("universal_resharded_load", f"{a.src}->{a.dst}", gb, reads),
                                        ("universal_same_layout_load", f"{a.dst}->{a.dst}", gb_dst, reads_dst)):
        for policy in ("once", "per-rank"):
            load_rows.append(load_row(f"universal load {what}, read {policy}", prefix, policy, False, gbytes, rates))
            load_rows.append(load_row("  same, with checksum verification", prefix, policy, True, gbytes, rates))
    rows = [
        ("universal save", r["universal_save_s"], save_vs_disk,
         r["torch_dist_dp_reshardable_save_s"] / r["universal_save_s"]),
        *load_rows,
        ("torch_dist save (dp_reshardable)", r["torch_dist_dp_reshardable_save_s"], None, None),
        ("torch_dist save (fully_reshardable)", r["torch_dist_fully_reshardable_save_s"], None, None),
        ("torch_dist load (dp_reshardable, same layout)", r["torch_dist_dp_reshardable_same_layout_load_s"], None, None),
        (f"torch_dist load (fully_reshardable, {a.src}->{a.dst})",
         r["torch_dist_fully_reshardable_resharded_load_s"], None, None),
    ]
    print(f"\nstate: {gb:.2f} GB on disk (fp32 weights + 2 Adam moments), {a.nproc} processes; "
          f"disk: write {disk_w:.2f} GB/s, read {disk_r:.2f} GB/s (same bytes, same run)")
    print("save rounds (disk baseline write s, universal save s, ratio): " + ", ".join(
        f"({d['write_s']:.2f}, {t:.2f}, {gb / t / (d['bytes'] / d['write_s'] / 1e9):.2f}x)" for d, t in rounds)
        + f"; the job's first save {r['universal_first_save_s']:.2f} s (fresh page-cache memory)")
    for prefix, what, base in (("universal_resharded_load", f"{a.src}->{a.dst}", "disk_read_rounds"),
                               ("universal_same_layout_load", f"{a.dst}->{a.dst}", "disk_read_rounds_dst")):
        print(f"load rounds {what} (disk baseline read s; read once: load s, verified s; per rank: load s, "
              "verified s): " + ", ".join(
                  f"({d['read_s']:.2f}; {o:.2f}, {ov:.2f}; {p:.2f}, {pv:.2f})" for d, o, ov, p, pv in zip(
                      r[base], r[f"{prefix}_rounds_s"], r[f"{prefix}_verified_rounds_s"],
                      r[f"{prefix}_per_rank_rounds_s"], r[f"{prefix}_verified_per_rank_rounds_s"])))
    print("the table's save and load rows: the median round's ratio and seconds; every load reads from "
          "the disk (files dropped from the page cache), as the read baseline does, into moments it "
          "allocates, as a job's first load does")
    print(f"{'operation':50s} {'seconds':>9s} {'x disk bw':>10s} {'torch_dist / ours':>18s}")
    for name, seconds, vs_disk, vs_td in rows:
        f = lambda x: f"{x:10.2f}" if x is not None else f"{'':10s}"  # noqa: E731
        g = f"{vs_td:18.2f}" if vs_td is not None else ""
        print(f"{name:50s} {seconds:9.2f} {f(vs_disk)} {g}")
    save_s = statistics.median(r["universal_save_rounds_s"])
    print(f"resume proof (recorded by every save, recomputed by every load): {r['proof_record_s']:.3f} s "
          f"= {100 * r['proof_record_s'] / save_s:.1f}% of the median universal save ({save_s:.2f} s, the "
          f"proof included); its forward pass {r['proof_forward_s']:.3f} s, the state digests the rest (a "
          f"save digests what it writes, in the background for an async one); a load's first "
          f"{r['proof_first_record_s']:.3f} s (it plans the digests' regions)")
    proved, unproved = r["async_save_stall_s"], r["async_save_unproved_stall_s"]
    print(f"resume proof in an async save's stall: {proved:.3f} s with it, {unproved:.3f} s without: "
          f"{100 * (proved - unproved) / save_s:.1f}% of the median universal save (goal: under 1%)")
    print(f"async save: training stalls {r['async_save_stall_s']:.2f} s = "
          f"{r['async_save_stall_s'] / r['memcpy_state_s']:.2f}x an in-memory copy of the state "
          f"({r['memcpy_state_s']:.2f} s); the save completes in {r['async_save_total_s']:.2f} s; "
          f"the job's first async save stalls {r['async_save_first_stall_s']:.2f} s (plan, staging buffers)")
    print("storage bytes read / checkpoint tensor bytes (the load's reads, plus with verification the "
          "bytes read again to hash them; headers, manifest and RNG files aside: "
          f"{(r['checkpoint_bytes'] - r['tensor_bytes']) / 1e6:.2f} MB in the {a.src} checkpoint):")
    for what, rec in r["load_reads"].items():
        data = r["tensor_bytes"] if what.startswith("resharded") else r["tensor_bytes_dst"]
        read = [x + h for x, h in zip(rec["read"], rec["hashed_after"])]
        print(f"  {what:36s} {sum(read) / data:5.2f}  (per rank MB: {[round(x / 1e6, 1) for x in read]}, "
              f"received from replicas MB: {[round(x / 1e6, 1) for x in rec['exchanged']]})")
    mem = r["load_memory_per_rank"]
    extra = [m["peak_rss_load_mib"] - m["rss_before_load_mib"] - (m["state_mib"] - m["state_before_load_mib"])
             for m in mem]
    print(f"resharded load, per rank: training state {[round(m['state_mib']) for m in mem]} MiB; the first "
          f"round's loads' peak RSS beyond the state they allocate: {[round(x) for x in extra]} MiB")
    print(f"peak RSS per rank over the loads, torch_dist's included (MiB): {[round(x) for x in r['peak_rss_mib_per_rank']]}")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
