"""One torchrun group of the checkpoint benchmark (see bench_checkpoint.py, which launches it)."""

import gc
import json
import os
import resource
import shutil
import sys
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from disk import CHUNK, drop_cache, sequential_read, sequential_write  # noqa: E402
from megatron_ucp.format import tensor_io  # noqa: E402
from megatron_ucp.format.folder import iteration_dir, write_tracker  # noqa: E402
from megatron_ucp.engine import collective  # noqa: E402
from megatron_ucp.engine.load import load_universal  # noqa: E402
from megatron_ucp.mcore.optimizer_state import inner_optimizers  # noqa: E402
from megatron_ucp.engine.save import save_universal  # noqa: E402
from megatron_ucp.train import loop, native  # noqa: E402


def timed(fn):
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    dist.barrier()
    return time.perf_counter() - start, result


def rss_mib() -> float:
    """The process's peak RSS so far (since the last reset_peak_rss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> None:
    """Start the peak over from the current RSS (Linux 4.0+), so that a peak measured after a
    load is the load's, not the model build's (whose temporaries are returned to the system)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # elsewhere the peak is the process's: an upper bound


ZEROS = bytes(CHUNK)


def _share_file(work: str, nbytes: int) -> tuple[str, int]:
    return os.path.join(work, f"baseline_{dist.get_rank()}.bin"), nbytes // dist.get_world_size()


def drop_cache_everywhere(path: str) -> None:
    if dist.get_rank() == 0:
        drop_cache(path)
    dist.barrier()


def settle() -> None:
    """Flush every dirty page (untimed) so that the next measurement starts on a quiet disk."""
    dist.barrier()
    if dist.get_rank() == 0:
        os.sync()
    dist.barrier()


def remove(path: str) -> None:
    """Delete a file or folder (rank 0) and wait for the file system to settle: with the
    `discard` mount option a deletion's trims land on the next journal commit, which would bill
    them to whichever timed fsync comes next."""
    if dist.get_rank() == 0:
        shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        os.sync()
    dist.barrier()


def disk_write(work: str, nbytes: int) -> dict:
    """Each rank writes its share of `nbytes` (64 MiB sequential blocks, fsync), in parallel:
    plainly, and with writeback started after each block (as our save does per file), which
    was 4-7x faster on this VM. The baseline is the faster of the two."""
    path, share = _share_file(work, nbytes)
    out = {"bytes": share * dist.get_world_size()}
    for key, kick in (("plain_write_s", False), ("writeback_write_s", True)):
        out[key], _ = timed(lambda: sequential_write(path, share, ZEROS, kick))
        os.unlink(path)
        os.sync()
        dist.barrier()
    out["write_s"] = min(out["plain_write_s"], out["writeback_write_s"])
    return out


def disk_read(work: str, nbytes: int) -> dict:
    """Each rank reads its share of `nbytes` back from the disk (dropped from the page cache)."""
    path, share = _share_file(work, nbytes)
    sequential_write(path, share, ZEROS, kick=False)
    drop_cache(path)
    t, _ = timed(lambda: sequential_read(path))
    os.unlink(path)
    os.sync()
    dist.barrier()
    return {"read_s": t, "bytes": share * dist.get_world_size()}


def tensor_data_bytes(folder: str) -> int:
    """The checkpoint's tensor data: every tensor file's bytes but its header."""
    from megatron_ucp.format import manifest as mf
    from megatron_ucp.format.tensor_entry import file_layout

    layouts = [file_layout(e) for e in mf.read_manifest(folder).tensors.values()]
    return sum(layout.file_size - len(layout.header) for layout in layouts)


def checkpoint_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def main(spec: dict, out_path: str) -> None:
    """Saves (universal, torch_dist in both optimizer formats), async stall, the disk baseline."""
    work, base = spec["work"], spec["model"]
    results = {}
    uni, td_dp, td_full = (os.path.join(work, n) for n in ("universal", "td_dp", "td_full"))
    with loop.session(base + spec["src"]) as (args, state):
        # One real step so that Adam's moments exist, as in any checkpoint worth saving.
        from megatron_ucp.train.data import build_dataset, microbatches
        from megatron.core import parallel_state as ps

        ds = build_dataset(None, True, args.vocab_size, args.seq_length, args.seed)
        batches = microbatches(ds, 0, args.global_batch_size, args.micro_batch_size,
                               ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        loop.train_step(state, batches, args)
        save = lambda folder: timed(lambda: save_universal(  # noqa: E731
            folder, 1, state.model, state.optimizer, state.scheduler, vocab_size=args.vocab_size))[0]
        # The job's first save, then rounds of (disk baseline, save) back to back: the disk's
        # rate drifts by 2x within minutes here, so each save is set against its neighbour.
        results["universal_first_save_s"] = save(uni)
        results["checkpoint_bytes"] = checkpoint_bytes(iteration_dir(uni, 1))
        dist.barrier()  # every rank has sized the folder before the first round removes it
        results["disk_rounds"], results["universal_save_rounds_s"] = [], []
        for _ in range(spec["rounds"]):
            remove(uni)
            results["disk_rounds"].append(disk_write(work, results["checkpoint_bytes"]))
            results["universal_save_rounds_s"].append(save(uni))
        for name, folder, fmt in (("torch_dist_dp_reshardable", td_dp, "dp_reshardable"),
                                  ("torch_dist_fully_reshardable", td_full, "fully_reshardable")):
            args.dist_ckpt_optim_format = fmt
            t, _ = timed(lambda: native.save(args, state, 1, 0, iteration_dir(folder, 1)))
            if dist.get_rank() == 0:
                write_tracker(folder, 1)
            results[f"{name}_save_s"] = t
            settle()  # what torch_dist left dirty is not billed to the next measurement
        results["rss_after_saves_mib"] = rss_mib()
        # The resume proof each save records (and each load recomputes): its share of a save.
        from megatron_ucp.engine import proof
        from megatron_ucp.engine.save import owned_regions
        from megatron_ucp.mcore.model_map import local_tensors

        tensors = local_tensors(state.model, state.optimizer, args.vocab_size)
        # the first record plans the digest's regions (cached, as every save after a job's first)
        results["proof_first_record_s"] = timed(lambda: proof.record(state.model, owned_regions(tensors, True), args.vocab_size))[0]
        results["proof_record_s"] = timed(lambda: proof.record(state.model, owned_regions(tensors, True), args.vocab_size))[0]
        results["proof_forward_s"] = timed(lambda: proof.record_probe(state.model, args.vocab_size))[0]
        # Async stall against an in-memory copy of this rank's whole state (weights + moments).
        def copy_state():
            out = [p.detach().clone() for m in state.model for p in m.parameters()]
            for opt in inner_optimizers(state.optimizer):
                for s in opt.optimizer.state.values():
                    out += [v.clone() for v in s.values() if torch.is_tensor(v)]
            return out
        t, _ = timed(copy_state)
        results["memcpy_state_s"] = t
        # A job saves many times: the first save builds the plan and staging buffers, later
        # ones reuse them. Both stalls are reported; the steady state is the second.
        # The last one records no resume proof: the proof's share of the stall.
        for i, key, prove in ((1, "async_save_first_stall_s", True), (2, "async_save_stall_s", True),
                              (3, "async_save_unproved_stall_s", False)):
            t, pending = timed(lambda: save_universal(os.path.join(work, "async"), i, state.model,
                                                      state.optimizer, state.scheduler,
                                                      vocab_size=args.vocab_size, async_save=True, prove=prove))
            results[key] = t
            t_wait, _ = timed(pending.wait)
            if prove:
                results["async_save_total_s"] = t + t_wait
            # as the rounds do: the page cache reuses memory, as on a job's node
            remove(iteration_dir(os.path.join(work, "async"), i))
        shutil.rmtree(os.path.join(work, "async"), ignore_errors=True)
        # Same-layout load of the default format (the only layout it can load into).
        args.dist_ckpt_optim_format = "dp_reshardable"
        drop_cache_everywhere(td_dp)
        t, _ = timed(lambda: native.load(args, state, iteration_dir(td_dp, 1)))
        results["torch_dist_dp_reshardable_same_layout_load_s"] = t
    if dist.get_rank() == 0:
        json.dump(results, open(out_path, "w"), indent=1)


def state_bytes(state) -> int:
    """Bytes of tensors this rank holds for training: weights, gradient buffers, optimizer state."""
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()

    for chunk in state.model:
        for p in chunk.parameters():
            add(p.data)
        for buf in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
            add(buf.grad_data)
            add(buf.param_data)
    for opt in inner_optimizers(state.optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                add(p.data)
        for st in opt.optimizer.state.values():
            for v in st.values():
                add(v)
    return total


def forget_optimizer_state(state) -> None:
    """Drop Adam's moments, so that the next load allocates them as a job's first load does."""
    for opt in inner_optimizers(state.optimizer):
        opt.optimizer.state.clear()
    gc.collect()


def load_phase(spec: dict, out_path: str) -> None:
    """The resharded loads, in processes of their own, so that peak RSS is the load's.

    Every universal load is a job's first load: it reads from the disk (the files dropped from
    the page cache, as the read baseline's are) into moments it allocates (state dropped before
    each; bench_checkpoint runs these processes with a fixed malloc mmap threshold, so that each
    allocation is fresh memory). The loads are timed in rounds, each right after a read
    baseline of the same bytes, as the saves are; each round loads with both read policies
    (read once per replica group, and per rank), plain and verified, in alternating orders.
    Then the state is saved on this layout and loaded back (a same-layout DP load), in rounds
    of both policies too."""
    import psutil

    work, base = spec["work"], spec["model"]
    uni, td_full = os.path.join(work, "universal"), os.path.join(work, "td_full")
    same = os.path.join(work, "universal_dst")
    results = json.load(open(out_path)) if os.environ.get("RANK", "0") == "0" else {}
    nbytes = checkpoint_bytes(iteration_dir(uni, 1))
    results["tensor_bytes"] = tensor_data_bytes(iteration_dir(uni, 1))

    def everyone(value):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
        return gathered

    with loop.session(base + spec["dst"]) as (args, state):
        reset_peak_rss()
        rss_built = psutil.Process().memory_info().rss / 2**20
        state_built = state_bytes(state) / 2**20  # no optimizer state yet: the load makes it

        def first_load(folder: str, policy: str, verify: bool, record: str = None) -> float:
            forget_optimizer_state(state)
            drop_cache_everywhere(folder)
            counter = tensor_io.ReadCounter()
            t, result = timed(lambda: load_universal(folder, state.model, state.optimizer, state.scheduler,
                                                     vocab_size=args.vocab_size, counter=counter,
                                                     verify=verify, read_policy=policy))
            if record is not None and record not in results.setdefault("load_reads", {}):
                # Bytes from storage: the load's reads, and (verified) those read again to hash.
                results["load_reads"][record] = {
                    "read": everyone(counter.bytes), "hashed_after": everyone(result.bytes_hashed_after),
                    "exchanged": everyone(result.bytes_exchanged)}
            return t

        loads = [(policy, verify) for policy in ("once", "per-rank") for verify in (False, True)]

        def key(policy, verify, prefix="universal_resharded_load"):
            return f"{prefix}{'_verified' if verify else ''}{'' if policy == 'once' else '_per_rank'}_rounds_s"

        results["disk_read_rounds"] = []
        for i in range(spec["rounds"]):
            results["disk_read_rounds"].append(disk_read(work, nbytes))
            # The loads alternate their order, so that none always follows the baseline.
            for policy, verify in (loads if i % 2 == 0 else loads[::-1]):
                results.setdefault(key(policy, verify), []).append(
                    first_load(uni, policy, verify, f"resharded {policy} verified={verify}"))
            if i == 0:  # peak RSS of the first loads against what the rank must hold
                results["load_memory_per_rank"] = everyone(
                    {"rss_before_load_mib": rss_built, "peak_rss_load_mib": rss_mib(),
                     "state_before_load_mib": state_built, "state_mib": state_bytes(state) / 2**20})
        # A same-layout DP load: the state saved on this layout, loaded back.
        save_universal(same, 1, state.model, state.optimizer, state.scheduler, vocab_size=args.vocab_size)
        results["checkpoint_bytes_dst"] = checkpoint_bytes(iteration_dir(same, 1))
        results["tensor_bytes_dst"] = tensor_data_bytes(iteration_dir(same, 1))
        results["disk_read_rounds_dst"] = []
        for i in range(spec["rounds"]):
            results["disk_read_rounds_dst"].append(disk_read(work, results["checkpoint_bytes_dst"]))
            for policy, verify in (loads if i % 2 == 0 else loads[::-1]):
                results.setdefault(key(policy, verify, "universal_same_layout_load"), []).append(
                    first_load(same, policy, verify, f"same {policy} verified={verify}"))
        args.dist_ckpt_optim_format = "fully_reshardable"
        drop_cache_everywhere(td_full)
        t, _ = timed(lambda: native.load(args, state, iteration_dir(td_full, 1)))
        results["torch_dist_fully_reshardable_resharded_load_s"] = t
        results["peak_rss_mib_per_rank"] = everyone(rss_mib())
    if dist.get_rank() == 0:
        json.dump(results, open(out_path, "w"), indent=1)
        for folder in (uni, same, os.path.join(work, "td_dp"), td_full):
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    spec = json.load(open(sys.argv[1]))
    (load_phase if spec.get("phase") == "load" else main)(spec, sys.argv[2])
    collective.close_distributed()  # before the interpreter's exit, which gloo may abort
