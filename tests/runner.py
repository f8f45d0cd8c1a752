"""Run a list of training steps in one torchrun process group (tests' multi-process tier).

    torchrun --nproc-per-node N tests/runner.py SPEC.json RESULT.json

SPEC is {"steps": [{"name": ..., "op": "train" | "roundtrip", "argv": [...], ...}]}. Each step
builds its own parallel layout, so one process start-up (megatron imports cost seconds) serves
many layouts. Rank 0 writes {name: result} to RESULT.json, one step at a time.
"""

import contextlib
import json
import os
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

from megatron_ucp.format import checksums, durability, tensor_io  # noqa: E402
from megatron_ucp.format.layout import fragment_regions  # noqa: E402
from megatron_ucp.engine import collective  # noqa: E402
from megatron_ucp.engine.load import load_universal  # noqa: E402
from megatron_ucp.mcore.model_map import local_tensors  # noqa: E402
from megatron_ucp.engine.save import save_universal  # noqa: E402
from megatron_ucp.train import loop  # noqa: E402


def owned_bytes(tensors, manifest) -> int:
    """Bytes of the slices this rank owns: whole TP-local weights, optimizer fragments' moments."""
    total = 0
    for t in tensors:
        entry = manifest.tensors[t.name]
        held = t.pieces(entry.padding_rows if t.padded_rows is not None else None)
        total += 4 * sum(r.numel for _, r in fragment_regions(held, 0, t.param.numel()))
        if t.fragment is not None:
            f = t.fragment
            total += 8 * sum(r.numel for _, r in fragment_regions(held, f.start, f.stop))
    return total


def train(step):
    """`hosts`: the host name each rank pretends to run on (the local tier's nodes);
    `disk_full_at`: iterations whose persistent save fails with ENOSPC at every positional
    write of rank 0 (a full shared file system, simulated at the write calls)."""
    import errno
    import socket

    from megatron_ucp import api

    with contextlib.ExitStack() as stack:
        printed = stack.enter_context(_teeing_stdout()) if os.environ.get("RANK", "0") == "0" else None
        stack.enter_context(environment(step.get("env", {})))
        if step.get("kill_after"):
            _kill_after(stack, step["kill_after"], step.get("wait_for", []))
        if step.get("die_receiving") and int(os.environ["RANK"]) == step["die_receiving"]["rank"]:
            _die_receiving(stack, step["die_receiving"]["call"])
        if step.get("hosts"):
            node = step["hosts"][int(os.environ["RANK"])]
            stack.callback(setattr, socket, "gethostname", socket.gethostname)
            socket.gethostname = lambda: node
        if step.get("disk_full_at"):
            original = api.save_universal
            stack.callback(setattr, api, "save_universal", original)

            def full(*a, **k):
                raise OSError(errno.ENOSPC, "No space left on device")

            def save_universal(save_dir, iteration, *a, **k):
                if iteration not in step["disk_full_at"] or dist.get_rank() != 0:
                    return original(save_dir, iteration, *a, **k)
                saved = os.pwrite, os.pwritev
                os.pwrite = os.pwritev = full
                try:
                    return original(save_dir, iteration, *a, **k)
                finally:
                    os.pwrite, os.pwritev = saved

            api.save_universal = save_universal
        history = loop.pretrain(step["argv"])
    out = {"losses": {str(i): loss for i, loss in history}}
    if printed is not None:
        out["stdout"] = printed.getvalue()
    return out


@contextlib.contextmanager
def _teeing_stdout():
    """What this rank prints, kept (and printed as usual)."""
    import io

    kept, out = io.StringIO(), sys.stdout

    class Tee(io.TextIOBase):
        def write(self, s):
            kept.write(s)
            return out.write(s)

        def flush(self):
            out.flush()

    with contextlib.redirect_stdout(Tee()):
        yield kept


def _kill_after(stack, iteration: int, wait_for: list) -> None:
    """SIGKILL this process once `iteration` is logged and the files `wait_for` exist (a local
    save known complete): the job dies as a node loss kills it, between two iterations."""
    import signal

    original = loop._log
    stack.callback(setattr, loop, "_log", original)

    def dying(args, it, *a, **k):
        original(args, it, *a, **k)
        if it == iteration:
            deadline = time.monotonic() + 60
            while not all(os.path.exists(p) for p in wait_for) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)

    loop._log = dying


def _die_receiving(stack, call: int) -> None:
    """SIGKILL this process right after the `call`-th local_receive.stage_spans of a restore
    (the bytes a node lacked, received and written into a staged piece)."""
    import signal

    from megatron_ucp.engine import local_receive

    original, calls = local_receive.stage_spans, [0]
    stack.callback(setattr, local_receive, "stage_spans", original)

    def dying(*a, **k):
        calls[0] += 1
        original(*a, **k)
        if calls[0] >= call:
            os.kill(os.getpid(), signal.SIGKILL)

    local_receive.stage_spans = dying


@contextlib.contextmanager
def environment(values: dict):
    """Environment variables set for one step only."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def roundtrip(step):
    """Load universally on this layout, then save again: what the new layout holds, on disk.
    `odd_digest_rank`: that rank claims other needs than its replicas (read-once falls back);
    `ranks_per_node`: the ranks see themselves on nodes of that many ranks (host names)."""
    import socket

    from megatron_ucp.engine import replicas

    odd = dist.get_rank() == step.get("odd_digest_rank")
    with environment(step.get("env", {})), loop.session(step["argv"]) as (args, state), \
            contextlib.ExitStack() as stack:
        if odd:
            digest = replicas.digest
            replicas.digest = lambda needs: "odd" + digest(needs)
            stack.callback(setattr, replicas, "digest", digest)
        if step.get("ranks_per_node"):
            node = f"node{dist.get_rank() // step['ranks_per_node']}"
            stack.callback(setattr, socket, "gethostname", socket.gethostname)
            socket.gethostname = lambda: node
        counter = tensor_io.ReadCounter()
        result = load_universal(args.load, state.model, state.optimizer, state.scheduler,
                                vocab_size=args.vocab_size, iteration=args.ckpt_step,
                                counter=counter, read_policy=args.ckpt_read_policy)
        tensors = local_tensors(state.model, state.optimizer, args.vocab_size)
        owned = owned_bytes(tensors, result.manifest)
        save_universal(step["save_to"], result.iteration, state.model, state.optimizer,
                       state.scheduler, vocab_size=args.vocab_size,
                       consumed_samples=result.consumed_samples)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, {"read": counter.bytes, "owned": owned,
                                          "hashed_after": result.bytes_hashed_after,
                                          "exchanged": result.bytes_exchanged,
                                          "notes": list(result.read_notes)})
        return {"iteration": result.iteration, "per_rank": per_rank,
                "layout_changed": result.layout_changed}


def kill_during_save(step):
    """Resume, then save again with rank `rank` SIGKILLed inside `function` on its `after`-th call."""
    import signal

    with loop.session(step["argv"]) as (args, state):
        iteration, consumed = loop.resume(args, state)
        if dist.get_rank() == step["rank"]:
            from megatron_ucp.engine import store_save

            module = next(m for m in (tensor_io, checksums, durability, store_save) if hasattr(m, step["function"]))
            original, calls = getattr(module, step["function"]), [0]

            def dying(*a, **k):
                calls[0] += 1
                if calls[0] >= step["after"]:
                    os.kill(os.getpid(), signal.SIGKILL)
                return original(*a, **k)

            setattr(module, step["function"], dying)
        save_universal(args.save, iteration + 1, state.model, state.optimizer, state.scheduler,
                       vocab_size=args.vocab_size, consumed_samples=consumed)
    return {"survived": True}


def load_expecting_error(step):
    """Load `--load`; report the error message every rank raised (or that it loaded)."""
    from megatron_ucp.errors import UCPError

    try:
        with environment(step.get("env", {})), loop.session(step["argv"]) as (args, state):
            iteration, _ = loop.resume(args, state)
            return {"loaded": iteration}
    except UCPError as e:  # raised while resolving the checkpoint or while loading it
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, f"{type(e).__name__}: {e}")
        return {"raised": messages}


def save_with_disk_full(step):
    """Resume, then save with every positional write on rank `rank` failing with ENOSPC."""
    import errno

    from megatron_ucp.errors import UCPError

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    with loop.session(step["argv"]) as (args, state):
        iteration, consumed = loop.resume(args, state)
        saved = os.pwrite, os.pwritev
        if dist.get_rank() == step["rank"]:
            os.pwrite = os.pwritev = full
        try:
            save_universal(args.save, iteration + 1, state.model, state.optimizer, state.scheduler,
                           vocab_size=args.vocab_size, consumed_samples=consumed)
            return {"saved": True}
        except UCPError as e:
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, f"{type(e).__name__}: {e}")
            return {"raised": messages}
        finally:
            os.pwrite, os.pwritev = saved


def convert(step):
    """The converter's worker, in this process group: native load, universal save."""
    from megatron_ucp.train import workers

    workers.convert(step["output"], step["argv"])
    return {}


def export_torch_dist(step):
    """The torch_dist exporter's plan and workers, in this process group (the tool starts its own)."""
    from megatron_ucp.convert import export_torch_dist as export
    from megatron_ucp.train import workers

    job = export.plan(step["input"], step["output"], step.get("iteration"), step["argv"],
                      dist.get_world_size(), step.get("optim_format"))
    workers.export(job.root, job.iteration, job.output, job.argv)
    return {"layout": job.layout}


def _megatron_expert_tensors(state) -> dict:
    """megatron's own sharded view of the expert weights, assembled: {key: (values, covered)}.

    Sequential experts give one shard per expert, grouped ones one shard per rank holding all
    of its local experts: assembling into the global shape makes the two comparable.
    """
    import numpy as np
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_ucp.mcore.model_map import unwrap

    out = {}
    for chunk in state.model:
        sd = unwrap(chunk).sharded_state_dict()
        apply_factories(sd)
        for sh in nested_values(sd):
            if not (isinstance(sh, ShardedTensor) and ".mlp.experts." in sh.key):
                continue
            values, covered = out.setdefault(
                sh.key, (np.zeros(sh.global_shape, np.float32), np.zeros(sh.global_shape, bool)))
            extent = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            box = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, extent))
            values[box] = sh.data.detach().float().numpy().reshape(extent)
            covered[box] = True
    return out


def grouped(step):
    """Load a sequential-expert checkpoint into megatron's legacy grouped-GEMM experts (built
    without the kernel, never run forward), check the weights against megatron's own grouped
    mapping, and save again from the grouped layout."""
    from megatron.core.transformer.moe import grouped_gemm_util

    def loaded(argv):
        with loop.session(argv) as (args, state):
            load_universal(args.load, state.model, state.optimizer, state.scheduler,
                           vocab_size=args.vocab_size, iteration=args.ckpt_step)
            if "save_to" in step and "--moe-grouped-gemm" in argv:
                save_universal(step["save_to"], args.ckpt_step, state.model, state.optimizer,
                               state.scheduler, vocab_size=args.vocab_size)
            kinds = {type(m).__name__ for c in state.model for m in c.modules()}
            return _megatron_expert_tensors(state), kinds

    sequential, seq_kinds = loaded(step["argv"])
    kernel = grouped_gemm_util.grouped_gemm
    grouped_gemm_util.grouped_gemm = kernel or object()  # construction only checks it is there
    try:
        fused, fused_kinds = loaded(step["argv"] + ["--moe-grouped-gemm"])
    finally:
        grouped_gemm_util.grouped_gemm = kernel
    mismatched = sorted(k for k in sequential.keys() | fused.keys()
                        if k not in sequential or k not in fused
                        or not (sequential[k][1] == fused[k][1]).all()
                        or not (sequential[k][0] == fused[k][0]).all())
    covered = sum(int(c.sum()) for _, c in fused.values())
    return {"expert_elements": covered, "mismatched": mismatched[:10],
            "layouts": [sorted(seq_kinds & {"SequentialMLP", "GroupedMLP"}),
                        sorted(fused_kinds & {"SequentialMLP", "GroupedMLP"})]}


def names(step):
    """The atomic names the mapping gives, and megatron's own checkpoint keys with their
    prepended coordinates, over all ranks (copies of another stage's tensor left out)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megatron_ucp.mcore.model_map import unwrap

    with loop.session(step["argv"]) as (args, state):
        mine = {t.name for t in local_tensors(state.model, None, args.vocab_size) if t.writes}
        keys = set()
        for chunk in state.model:
            from megatron.core import parallel_state

            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            for v in nested_values(unwrap(chunk).sharded_state_dict(metadata={"dp_cp_group": group})):
                built = v.build() if isinstance(v, ShardedTensorFactory) else v
                for t in nested_values(built) if isinstance(built, (dict, list)) else [built]:
                    if isinstance(t, ShardedTensor) and t.replica_id[0] == 0:
                        keys.add((t.key, tuple(t.global_offset[:t.prepend_axis_num])))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, keys))
    return {"names": sorted(set().union(*(m for m, _ in everyone))),
            "keys": sorted(set().union(*(k for _, k in everyone)))}


def geometry(step):
    """Every rank's local tensors as the mapping gives them (name, shapes, boxes, distributed-
    optimizer fragment), for tests/test_model_shapes.py."""
    with loop.session(step["argv"]) as (args, state):
        mine = [{"name": t.name, "atomic_shape": list(t.atomic_shape), "padded_rows": t.padded_rows,
                 "writes": t.writes, "stateless": t.stateless, "numel": t.param.numel(),
                 "boxes": [[b.local_start, list(b.offset), list(b.shape)] for b in t.boxes],
                 "fragment": None if t.fragment is None else [t.fragment.start, t.fragment.stop]}
                for t in local_tensors(state.model, state.optimizer, args.vocab_size)]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return {"ranks": everyone}


def logits(step):
    """megatron's forward on `tokens` after loading `--load` universally, weights only: the
    true-vocabulary logits [batch, seq, vocab], gathered over TP from the last pipeline stage."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    tokens = torch.tensor(step["tokens"])
    batch, seq = tokens.shape
    positions = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    with loop.session(step["argv"]) as (args, state):
        loaded = load_universal(args.load, state.model, vocab_size=args.vocab_size, iteration=args.ckpt_step,
                                load_optim=False, load_rng=False)
        kept = []

        def forward_step(data_iterator, model):
            output = model(tokens, positions, None)

            def keep(out):
                kept.append(gather_from_tensor_model_parallel_region(out)[..., :args.vocab_size].detach())
                return out.sum() * 0, {}
            return output, keep

        for chunk in state.model:
            chunk.eval()
        iterators = [iter([None]) for _ in state.model]
        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=state.model, num_microbatches=1, seq_length=seq, micro_batch_size=batch,
                decoder_seq_length=seq, forward_only=True)
        mine = kept[0].tolist() if kept and parallel_state.get_tensor_model_parallel_rank() == 0 else None
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    return {"logits": next(x for x in everyone if x is not None), "proof": loaded.proof_note}


def restore_both(step):
    """Issue 46's differential test: a restart from the local tier (`local_argv`: its
    --local-ckpt-dir, no checkpoint newer in --load; `hosts`: each rank's pretended node) and a restart from the persistent checkpoint
    of the same iteration (`persistent_argv`), one after the other in this process group, each
    building its model as such a restart does; each rank's state after each (tests/state_probe.py)
    compared bitwise in memory. Returns every rank's differences (none: equal)."""
    from state_probe import differences, snapshot

    from megatron_ucp.train import checkpointing
    from megatron_ucp.train.data import build_datasets, microbatches

    def held(args, state, iteration, consumed):
        from megatron.core import parallel_state

        dataset, _ = build_datasets(args)
        batches = microbatches(dataset, consumed, args.global_batch_size, args.micro_batch_size,
                               parallel_state.get_data_parallel_rank(),
                               parallel_state.get_data_parallel_world_size())
        return snapshot(state.model, state.optimizer, state.scheduler, iteration=iteration,
                        consumed_samples=consumed, progress=dict(state.progress),
                        next_tokens=[b["tokens"] for b in batches],
                        padded_vocab=args.padded_vocab_size)

    with contextlib.ExitStack() as stack:
        if step.get("hosts"):  # the host name each rank pretends to run on (the local tier's nodes)
            import socket

            node = step["hosts"][int(os.environ["RANK"])]
            stack.callback(setattr, socket, "gethostname", socket.gethostname)
            socket.gethostname = lambda: node
        with loop.session(step["local_argv"]) as (args, state):
            tier = checkpointing.open_local_tier(args, state)
            iteration, consumed = loop.resume(args, state, tier)
            restored = tier.restored
            pieces = getattr(tier, "restore_stats", None)
            local = held(args, state, iteration, consumed)
    with loop.session(step["persistent_argv"]) as (args, state):
        iteration, consumed = loop.resume(args, state)
        persistent = held(args, state, iteration, consumed)
    found = differences(local, persistent)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"differences": found, "local_restored": restored,
                                      "keys": len(local), "iteration": iteration, "pieces": pieces})
    return {"ranks": everyone}


def corrupt_copy(step):
    """Rank 0 copies checkpoint folder `src` to `dst`, then flips one bit of `tensor`'s file at
    `fraction` of it ("flip") or cuts the file there ("truncate"), in every iteration."""
    import shutil

    if dist.get_rank() == 0:
        shutil.copytree(step["src"], step["dst"])
        for iteration in [d for d in os.listdir(step["dst"]) if d.startswith("iter_")]:
            path = os.path.join(step["dst"], iteration, "tensors", f"{step['tensor']}.safetensors")
            at = int(os.path.getsize(path) * step["fraction"])
            if step["action"] == "flip":
                with open(path, "r+b") as f:
                    f.seek(at)
                    byte = f.read(1)[0]
                    f.seek(at)
                    f.write(bytes([byte ^ 0x10]))
            else:
                os.truncate(path, at)
    dist.barrier()
    return {}


def process_groups(step):
    """How many process groups this rank's torch still holds, and how many models (megatron's
    DDP modules) are still alive after a collection (the earlier steps' sessions have ended: the
    default group alone should be left, and no model); this process's OS threads."""
    import gc

    from megatron.core.distributed import DistributedDataParallel

    gc.collect()
    models = sum(1 for o in gc.get_objects() if isinstance(o, DistributedDataParallel))
    return {"held": len(dist.distributed_c10d._world.pg_map), "models": models,
            "threads": len(os.listdir("/proc/self/task"))}


OPS = {"process_groups": process_groups, "corrupt_copy": corrupt_copy, "restore_both": restore_both, "names": names, "convert": convert, "train": train, "roundtrip": roundtrip, "kill_during_save": kill_during_save,
       "load_expecting_error": load_expecting_error, "save_with_disk_full": save_with_disk_full,
       "grouped": grouped, "logits": logits, "geometry": geometry, "export_torch_dist": export_torch_dist}


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    results = {}
    for step in spec["steps"]:
        start = time.perf_counter()
        try:
            results[step["name"]] = OPS[step["op"]](step)
            results[step["name"]]["seconds"] = round(time.perf_counter() - start, 2)
        except Exception as e:  # recorded so that the test names the failing step
            results[step["name"]] = {"error": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc()}
            if step.get("fatal", True):
                break
        finally:
            rank = int(os.environ.get("RANK", 0))
            # Rank 0 writes the results; any rank that failed writes its own traceback too.
            if rank == 0 or "error" in results.get(step["name"], {}):
                path = result_path if rank == 0 else f"{result_path}.rank{rank}"
                with open(f"{path}.tmp", "w") as f:  # atomic: torchrun may kill us mid-write
                    json.dump(results, f, indent=1)
                os.replace(f"{path}.tmp", path)
    collective.close_distributed()  # before the interpreter's exit, which gloo may abort (engine/collective.py)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
