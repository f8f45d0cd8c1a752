"""Does this torch's gloo still corrupt memory in asynchronous coalesced all-gathers? Crashed
runs of the asynchronous form against the synchronous one (the baseline), in one run (by hand,
not in CI).

CPU mode runs megatron's coalesced collectives synchronously because of it
(megatron_ucp/mcore/cpu_mode.py, `_patch_coalescing`). This reproduces the defect without
megatron, in the pattern Megatron-FSDP uses: each step all-gathers a few flat buckets from their
shards, each inside `_coalescing_manager(async_ops=...)`, and waits on the handles later.

    python benchmarks/gloo_coalesced_allgather.py [--modes async sync] [--runs 4] [--steps 3000]

Each run is two fresh gloo processes; a run that crashes (SIGABRT "malloc(): unaligned tcache
chunk detected", or SIGSEGV) is counted. Measured on a 2-core machine, 6 runs of 3000 steps:
async crashed in 3 (torch 2.13.0) and 4 (torch 2.14.1), sync in none of 3; plain asynchronous
`all_gather_into_tensor` and asynchronous coalesced reduce-scatters and all-reduces never did
(4 runs each, a variant of this script).
The exit status is the number of crashed runs, so a torch whose gloo is fixed exits 0, and the
workaround can go.
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BUCKETS, BUCKET_NUMEL = 5, 10656  # a tiny GPT's Megatron-FSDP buckets


def _steps(rank: int, world: int, port: int, mode: str, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shards = [torch.randn(BUCKET_NUMEL // world) for _ in range(BUCKETS)]
    buckets = [torch.empty(BUCKET_NUMEL) for _ in range(BUCKETS)]
    for _ in range(steps):
        handles = []
        for shard, bucket in zip(shards, buckets):
            with dist._coalescing_manager(async_ops=(mode == "async")) as handle:
                dist.all_gather_into_tensor(bucket, shard, async_op=True)
            handles.append(handle)
            _ = [torch.randn(32) * 2 for _ in range(20)]  # the main thread allocates meanwhile
        for handle in handles:
            handle.wait()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=("async", "sync"), default=["async", "sync"])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    crashed = {mode: _crashed_runs(mode, args.runs, args.steps) for mode in args.modes}
    print(f"torch {torch.__version__}, {args.steps} steps a run: "
          + ", ".join(f"{mode} crashed in {n} of {args.runs} runs" for mode, n in crashed.items()))
    return sum(crashed.values())


def _crashed_runs(mode: str, runs: int, steps: int) -> int:
    crashed = 0
    for run in range(runs):
        context = mp.start_processes(_steps, args=(2, _free_port(), mode, steps), nprocs=2,
                                     join=False, start_method="spawn")
        try:
            while not context.join():
                pass
            outcome = "completed"
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:  # a crash, or its peer's
            crashed += 1
            outcome = f"crashed ({e})"
        finally:
            for process in context.processes:
                process.kill()
        print(f"run {run + 1}/{runs}, {mode}: {outcome}", flush=True)
    return crashed


if __name__ == "__main__":
    raise SystemExit(main())
