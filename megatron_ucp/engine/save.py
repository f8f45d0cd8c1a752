"""Universal save: every rank writes the regions it owns straight into the atomic files.

1. Each rank offers the regions of atomic tensors it holds (its distributed-optimizer fragments,
   or whole TP-local tensors); all ranks gather the offers and compute the same plan.
2. Files are created at full size, spread over ranks; then each rank writes its planned regions
   with positional writes (no gather, no temporary copy of the state).
3. File creators checksum and fsync; rank 0 writes the manifest into the temporary folder,
   renames it into place, then moves the tracker: the commit. A save killed before that rename
   leaves the previous checkpoint and tracker untouched.
"""

import dataclasses
import functools
import hashlib
import os
import pickle
import shutil
import threading

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ucp import settings
from megatron_ucp.engine import ownership, proof, store_save
from megatron_ucp.engine.collective import (all_true, exchange_objects, group_device, is_registered,
                                            on_rank_zero, run_everywhere)
from megatron_ucp.engine.plan import offer_items
from megatron_ucp.engine.planner import part_shapes_of, plan_save
from megatron_ucp.errors import IncompleteCheckpointError, SaveError
from megatron_ucp.format import checksums, durability, folder, host_memory, manifest as mf, storage, tensor_io
from megatron_ucp.format.folder import iteration_dir
from megatron_ucp.format.layout import region_runs
from megatron_ucp.format.tensor_entry import STATES, TensorEntry, file_layout, file_tensor_name
from megatron_ucp.mcore import rng
from megatron_ucp.mcore.model_map import local_tensors, unwrap
from megatron_ucp.mcore.optimizer_state import (grad_scaler_state, inner_optimizers, plain_groups, read_step,
                                                uses_distributed_optimizer)


def current_layout(optimizer, padded_vocab_size=None) -> mf.Layout:
    ps = parallel_state
    return mf.Layout(
        world_size=dist.get_world_size(),
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        data_parallel_size=ps.get_data_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
        use_distributed_optimizer=uses_distributed_optimizer(optimizer),
        padded_vocab_size=padded_vocab_size,
    )


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()


def sources_of(t, states):
    """1-D fp32 tensors per state covering [start, stop) of the local flat tensor."""
    if t.fragment is None:
        return 0, t.param.numel(), {"param": t.param.detach().reshape(-1)}
    f = t.fragment
    out = {"param": f.main}
    if "exp_avg" in states:
        out["exp_avg"], out["exp_avg_sq"] = f.exp_avg, f.exp_avg_sq
    return f.start, f.stop, out


def _offers(tensors, states, with_optimizer: bool):
    offers, sources = [], {}
    for item, t, offset in offer_items(tensors, len(states), with_optimizer):
        offers.append(item)
        sources[item.key] = (offset, sources_of(t, states)[2])
    return offers, sources


def _tensor_entries(tensors, states) -> dict:
    return {t.name: TensorEntry.new(t.name, t.atomic_shape, t.padded_rows is not None, t.padding_rows,
                                    ["param"] if t.stateless else states, t.stateless)
            for t in tensors if t.writes}


def _optimizer_record(optimizer) -> dict:
    """The optimizer's global state: Adam's step, its groups' hyper-parameters, and the fp16
    loss scaler's state where there is one."""
    groups = [g for opt in inner_optimizers(optimizer) for g in opt.optimizer.param_groups]
    record = {"type": "adam", "step": read_step(optimizer), "param_groups": plain_groups(groups)}
    scaler = grad_scaler_state(optimizer)
    if scaler is not None:
        record["grad_scaler"] = scaler
    return record


def _prepare(save_dir: str, iteration: int) -> str:
    """Rank 0: own the folder, clear dead saves' leftovers, make this save's temporary folder."""
    os.makedirs(save_dir, exist_ok=True)
    ownership.claim(save_dir)
    ownership.remove_leftovers(save_dir)
    return folder.begin(save_dir, iteration)


_PLAN_CACHE = {}  # digest of what this rank offered -> (its plan, entries of the files it creates, merge)


def _plan(tensors, states, with_optimizer: bool, merge: bool = None):
    """This rank's part of the save plan (planner.plan_save: each tensor planned by its owner).

    The plan depends only on the layout, so a job saving again with the same offers on every
    rank reuses it: one integer is reduced to learn that every rank's offers are unchanged.
    Returns (plan, sources, entries, part_shapes, created): entries of the tensors this rank
    holds or creates (every tensor's on rank 0, for the manifest), and the files it creates.
    `merge` (default: UCP_MERGE_ROWS) merges TP column blocks into whole rows; the local tier
    plans without merging (each rank keeps what it holds) and keeps its plan beside the save's.
    """
    merge = _merging_rows() if merge is None else merge
    offers, sources = _offers(tensors, states, with_optimizer)
    entries_here = _tensor_entries(tensors, states)
    world, rank = dist.get_world_size(), dist.get_rank()
    digest = hashlib.sha256(pickle.dumps((offers, entries_here, merge, world))).hexdigest()
    cached = _PLAN_CACHE.get(digest)
    if all_true(cached is not None):
        plan, created, _ = cached
    else:
        plan, created = plan_save(offers, entries_here, rank, world,
                                  exchange_objects,
                                  lambda e: file_layout(e).file_size, merge)
        if plan.errors:
            raise IncompleteCheckpointError("save plan does not cover the model: " + "; ".join(plan.errors[:5]))
        for old in [k for k, v in _PLAN_CACHE.items() if v[2] == merge]:
            del _PLAN_CACHE[old]  # one layout at a time (per merge choice)
        _PLAN_CACHE[digest] = (plan, created, merge)
    entries = {**entries_here, **created, **plan.entries}
    return plan, _with_ends(sources, plan.ends), entries, part_shapes_of(entries), sorted(created)


def owned_regions(tensors, with_optimizer: bool) -> list:
    """Collective: this rank's share of the job's state, each region of it exactly once (a save
    plan without row merges: regions this rank holds), with its data: [(atomic name, region,
    part shape, offset in the sources, {state: 1-D source})] (what the resume proof digests)."""
    states = STATES if with_optimizer else ("param",)
    plan, sources, _, part_shapes, _ = _plan(tensors, states, with_optimizer, merge=False)
    return [(i.name, i.region, part_shapes[(i.name, i.region.part)], *sources[i.key]) for i in plan.items]


def _with_ends(sources: dict, ends: dict) -> dict:
    """Sources for the partial rows left at the ends of merged ranges: slices of the data of
    the item they were cut from."""
    out = dict(sources)
    for key, source in ends.items():
        offset, data = sources[source]
        out[key] = (offset + key[1].start - source[1].start, data)
    return out


def _merging_rows() -> bool:
    """UCP_MERGE_ROWS=0 writes split columns where they are (each rank its part of every row)."""
    return settings.merge_rows()


def _create_files(tmp, entries, layouts, mine) -> None:
    for name in mine:
        tensor_io.create_tensor_file(os.path.join(tmp, entries[name].file), layouts[name])


class _Staging:
    """Host buffers for asynchronous saves, kept between saves: copying into memory already
    mapped costs a memcpy, while fresh buffers cost a page fault per 4 KiB on top. A buffer
    set is reused only once the save that used it has finished."""

    def __init__(self):
        self.buffers, self.owner = {}, None

    def take(self) -> dict:
        if self.owner is not None and not self.owner.done():
            return {}  # still being written: this save gets fresh buffers
        return self.buffers


_STAGING = _Staging()


def _snapshot(items, sources, states, copy: bool, staging: dict = None) -> dict:
    """The bytes this rank will write, as fp32 numpy arrays (copies for an asynchronous save,
    into `staging`'s buffers where they fit)."""
    out = {}
    for item in items:
        offset, data = sources[item.key]
        out[item.key] = {}
        for state in data:
            source = data[state][offset:offset + item.region.numel]
            if copy:  # one pass from the source (any device, any dtype) into the staging buffer
                buf = _staging_buffer(staging, (item.key, state), (item.region.numel,), source.is_cuda)
                torch.from_numpy(buf).copy_(source.detach())
                out[item.key][state] = buf
            else:
                out[item.key][state] = _to_numpy(source)
    return out


def _staging_buffer(staging, key, shape, pinned: bool = False) -> np.ndarray:
    """The previous save's fp32 buffer under `key` when it has `shape`, else a new one
    (page-locked for a copy from a GPU)."""
    buf = staging.get(key) if staging is not None else None
    if buf is None or buf.shape != shape:
        buf = host_memory.empty_fp32(int(np.prod(shape)), pinned).reshape(shape)
    return buf


def _block_views(block, source) -> list:
    """Block `block` of this rank's offered region, per state: (rows, width) views."""
    (_, region), (offset, data) = block.source, source
    width = region.shape[1]
    lo = offset + block.rows[0] * width - region.start
    hi = offset + block.rows[1] * width - region.start
    rows = block.rows[1] - block.rows[0]
    return [data[s][lo:hi].detach().view(rows, width) for s in data]


def _column_block(views, out: torch.Tensor = None) -> torch.Tensor:
    """A block's per-state views as one (states, rows, width) fp32 tensor (a copy: training
    may go on), into `out` when given."""
    if out is None:
        return torch.stack([v.to(torch.float32) for v in views])
    for target, view in zip(out, views):
        target.copy_(view)
    return out


def _stage_rows(merges, rank, sources, staging, device) -> tuple:
    """The whole-row items this rank writes, with its own column blocks copied in, and the
    transfers still to make: its blocks of the rows other ranks write (copied now, so that
    training may go on) and the blocks it receives. `device`: where transfers travel. With
    `staging` (an asynchronous save) host buffers of the previous save are reused, and the
    send buffers are returned too, to be kept with the others."""
    out, kept, sends, receives = {}, {}, [], []
    for m in merges:
        mine = [b for b in m.blocks if b.rank == rank]
        if m.writer != rank:
            for b in mine:
                views = _block_views(b, sources[b.source])
                if staging is None:
                    sends.append((m.writer, _column_block(views).to(device)))
                    continue
                key = ("send", m.item.key, b.rank)
                kept[key] = _staging_buffer(staging, key, (len(views),) + tuple(views[0].shape))
                sends.append((m.writer, _column_block(views, torch.from_numpy(kept[key]))))
            continue
        region = m.item.region
        bufs = {state: _staging_buffer(staging, (m.item.key, state), (region.numel,))
                for state in sources[mine[0].source][1]}
        out[m.item.key] = bufs
        for b in m.blocks:
            if b.rank == rank:
                _fill_columns(bufs, b, _block_views(b, sources[b.source]))
            else:
                shape = (len(bufs), region.shape[0], b.columns[1] - b.columns[0])
                receives.append((b.rank, torch.empty(shape, device=device), bufs, b))
    return out, kept, (sends, receives)


def _fill_columns(bufs: dict, block, data) -> None:
    """Copy per-state (rows, width) blocks into their columns of the rows' buffers."""
    for buf, part in zip(bufs.values(), data):
        torch.from_numpy(buf).view(part.shape[0], -1)[:, block.columns[0]:block.columns[1]].copy_(part)


def _exchange_rows(transfers, group=None) -> None:
    """Make the staged transfers (point-to-point, in the plan's order on every rank) and put
    the received blocks into their rows."""
    sends, receives = transfers
    ops = [dist.P2POp(dist.isend, t, peer, group) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for peer, t, _, _ in receives]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for _, data, bufs, block in receives:
        _fill_columns(bufs, block, data)


def _write(tmp, items, snapshot, entries, layouts, part_shapes, rng_state) -> None:
    by_file = {}
    for item in items:
        by_file.setdefault(item.name, []).append(item)

    def write_file(file_items):
        for item in file_items:
            path = os.path.join(tmp, entries[item.name].file)
            runs = region_runs(part_shapes[(item.name, item.region.part)], item.region)
            for state, chunk in snapshot[item.key].items():
                tensor_io.write_runs(path, layouts[item.name], file_tensor_name(state, item.region.part),
                                   runs, chunk)
        durability.start_writeback(path)  # the disk writes this file while this rank writes the next

    tensor_io.in_parallel(write_file, list(by_file.values()))
    if rng_state is not None:  # None: --no-save-rng, the manifest says "rng_saved": false
        rng.save(os.path.join(tmp, "rng"), dist.get_rank(), rng_state)


def _digests(items, snapshot, part_shapes) -> dict:
    """The resume proof's digests (proof.state_digests) of the regions this rank wrote, from the
    bytes it wrote: together, the ranks' writes hold every element of the state once."""
    regions = [(i.name, i.region, part_shapes[(i.name, i.region.part)], 0,
                {state: torch.from_numpy(chunk).reshape(-1) for state, chunk in snapshot[i.key].items()})
               for i in items]
    return proof.state_digests(regions)[0]


def _checksum(tmp, entries, layouts, mine) -> dict:
    def one(name):
        path = os.path.join(tmp, entries[name].file)
        sums = checksums.block_checksums(path, len(layouts[name].header), layouts[name].file_size)
        durability.fsync_file(path)  # after hashing, which the page cache serves while the disk writes
        return name, {"file_size": layouts[name].file_size, "block_bytes": checksums.BLOCK_BYTES,
                      "checksums": sums}

    return dict(tensor_io.in_parallel(one, list(mine)))


_CHECKPOINT_GROUP = None


def _checkpoint_group():
    """A process group of its own for background saves, so their collectives never interleave
    with training's on the same communicator. Created collectively on the first async save,
    and again after a session that ended destroyed it (collective.groups_of_this_scope)."""
    global _CHECKPOINT_GROUP
    if _CHECKPOINT_GROUP is None or not is_registered(_CHECKPOINT_GROUP):
        _CHECKPOINT_GROUP = dist.new_group(backend="gloo")
    return _CHECKPOINT_GROUP


class AsyncSave:
    """A save running in a background thread; `wait()` returns its folder or raises its error."""

    def __init__(self, fn):
        self._result, self._error = None, None

        def run():
            try:
                self._result = fn()
            except BaseException as e:  # handed to the caller by wait()
                self._error = e

        self._thread = threading.Thread(target=run, name="ucp-async-save", daemon=False)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def save_universal(save_dir: str, iteration: int, model, optimizer=None, scheduler=None, *,
                   vocab_size: int, consumed_samples: int = 0, args: dict = None,
                   keep_last: int = None, async_save: bool = False, save_rng: bool = True,
                   progress: dict = None, prove: bool = True):
    """Write a universal checkpoint of the model (and optimizer, scheduler) at `iteration`.

    Collective: every rank of the job calls it. Returns the committed folder. A failure on any
    rank (disk full, I/O error, another job owning the folder) raises SaveError on every rank,
    removes this save's temporary folder and leaves earlier checkpoints as they were.
    `keep_last` prunes older complete checkpoints after the commit. With `async_save`, the
    caller waits only for the plan and an in-memory copy of the bytes this rank writes; files
    are written and committed in a background thread, and an `AsyncSave` is returned (call
    `wait()` before the next save and before exit). Without `save_rng` no RNG file is written
    and the manifest says so ("rng_saved": false): the load reseeds. `progress` is the training
    loop's bookkeeping (docs/FORMAT.md), stored as given. `prove` records the resume proof
    (engine/proof.py: one forward pass of a probe sequence), which every load checks.
    """
    rank = dist.get_rank()
    states = STATES if optimizer is not None else ("param",)
    tensors = local_tensors(model, optimizer, vocab_size)
    # The probe's forward pass now; the digests of what each rank writes as it writes it (in the
    # background for an async save), summed by rank 0 at the commit.
    record = proof.record_probe(model, vocab_size) if prove else None
    plan, sources, entries, part_shapes, created = _plan(tensors, states, optimizer is not None)
    dtypes = proof.source_dtypes(data for _, data in sources.values()) if prove else None
    merges = plan.merges
    staging = _STAGING.take() if async_save else None
    merged = {m.item.key for m in merges if m.writer == rank}
    snapshot = _snapshot([i for i in plan.items if i.key not in merged], sources, states,
                         copy=async_save, staging=staging)
    # Column blocks travel over NCCL as device tensors on a synchronous save; an asynchronous
    # one stages them on the host now and sends them over its own gloo group in the background.
    rows, send_buffers, transfers = _stage_rows(merges, rank, sources, staging,
                                                torch.device("cpu") if async_save else group_device())
    snapshot.update(rows)
    head = _manifest_head(iteration, entries, model, optimizer, scheduler, vocab_size,
                          consumed_samples, args, save_rng, progress, record) if rank == 0 else None
    execute = _execute
    if storage.is_remote(save_dir):  # an object store: no rename, each file uploaded whole
        execute = functools.partial(store_save.execute, exchange_rows=_exchange_rows, digests_of=_digests)
    job = functools.partial(execute, save_dir, iteration, plan.items, snapshot, transfers, entries,
                            part_shapes, created, rng.capture() if save_rng else None, head, keep_last,
                            _checkpoint_group() if async_save else None, dtypes)
    if not async_save:
        return job()
    pending = AsyncSave(job)
    _STAGING.buffers = {(key, state): chunk for key, states_ in snapshot.items()
                        for state, chunk in states_.items()}
    _STAGING.buffers.update(send_buffers)
    _STAGING.owner = pending
    return pending


def _execute(save_dir, iteration, items, snapshot, transfers, entries, part_shapes, created, rng_state,
             head, keep_last, group, dtypes=None):
    """Column blocks exchanged, files (`created`: those this rank creates and checksums),
    checksums, the resume proof's digests of what this rank wrote (`dtypes`: the dtypes its
    sources keep each state in; None: no proof) and commit; every step agreed by all ranks over
    `group`."""
    rank = dist.get_rank()
    layouts = {name: file_layout(e) for name, e in entries.items()}
    everywhere = functools.partial(run_everywhere, group=group)
    tmp = None
    try:
        tmp = on_rank_zero(_prepare, save_dir, iteration, group=group)
        everywhere(_exchange_rows, transfers, group)
        everywhere(_create_files, tmp, entries, layouts, created)
        everywhere(_write, tmp, items, snapshot, entries, layouts, part_shapes, rng_state)
        sums = everywhere(_checksum, tmp, entries, layouts, created)
        digests = None if dtypes is None else (everywhere(_digests, items, snapshot, part_shapes), dtypes)
        # Only rank 0 writes them into the manifest: each rank sends it its files' checksums
        # and its digests.
        sent = list(exchange_objects({0: (sums, digests)} if sums or digests else {}, group).values())
        all_checksums = [s for s, _ in sent if s]
        if rank == 0 and dtypes is not None:
            head = dataclasses.replace(head, proof=proof.with_digests(head.proof, [d for _, d in sent if d]))
        final = iteration_dir(save_dir, iteration)
        everywhere(lambda: _commit(save_dir, tmp, iteration, head, all_checksums, keep_last)
                   if rank == 0 else None)
    except Exception as e:
        if rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, SaveError):
            raise
        raise SaveError(f"save of iteration {iteration} to {save_dir} failed, nothing committed: {e}") from e
    return final


def _manifest_head(iteration, entries, model, optimizer, scheduler, vocab_size,
                   consumed_samples, args, save_rng=True, progress=None, proof_record=None) -> mf.Manifest:
    """Everything in the manifest but the checksums, taken when the save is called."""
    head = mf.head(iteration=iteration, consumed_samples=consumed_samples,
                   architecture=mf.architecture(unwrap(model[0]), vocab_size),
                   layout=current_layout(optimizer, mf.padded_vocab_size(entries)),
                   optimizer=None if optimizer is None else _optimizer_record(optimizer),
                   scheduler=scheduler.state_dict() if scheduler is not None else None,
                   args=args, rng_saved=save_rng,
                   progress=None if progress is None else mf.jsonable(progress), proof=proof_record)
    return dataclasses.replace(head, tensors=dict(entries))


def _commit(save_dir, tmp, iteration, head, all_checksums, keep_last) -> None:
    """Rank 0: every rank's checksums into the manifest, the folder committed, old ones pruned."""
    tensors = dict(head.tensors)
    for c in all_checksums:
        for name, info in c.items():
            tensors[name] = tensors[name].written(**info)
    folder.commit(save_dir, tmp, iteration, dataclasses.replace(head, tensors=tensors).to_json())
    ownership.prune(save_dir, keep_last, newest=iteration)


