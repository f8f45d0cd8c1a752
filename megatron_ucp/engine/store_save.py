"""A universal save into an object store (storage.py): the same plan and the same files as a
save to a folder, committed without a rename.

An object is written whole, so the ranks that hold parts of a tensor file send them to the
rank that creates it (planner: one creator per file), which assembles the file in a private
local staging folder with the folder's own code (tensor_io), checksums it, uploads it (in
parallel parts where large) and drops it. The commit protocol, for a store without rename:

1. rank 0 first takes the iteration's old manifest away, if any (a re-save of an iteration
   replaces it), aborts unfinished multipart uploads under the prefix and deletes the objects
   of iteration folders that hold no manifest: what dead saves left;
2. every rank uploads its files and RNG state under `iter_XXXXXXX/`;
3. once every rank has, rank 0 writes the manifest (`ucp.json`, one PUT: readers see all of it
   or none), then the tracker.

A load takes only an iteration whose manifest exists (the tracker's, by default), so a save
killed before step 3 leaves no object a load takes: the tracker still names the previous
checkpoint. What is not guaranteed without conditional writes: two jobs saving into one
prefix at once (the folder's owner lock, ownership.py, has no counterpart here yet).
"""

import dataclasses
import functools
import json
import os
import shutil
import tempfile

import torch.distributed as dist

from megatron_ucp.engine import proof, store_owner
from megatron_ucp.engine.collective import exchange_objects, on_rank_zero, run_everywhere
from megatron_ucp.errors import SaveError
from megatron_ucp.format import checksums, storage, stores, tensor_io
from megatron_ucp.format.folder import MANIFEST, TRACKER, iteration_dir, iteration_of, rng_file
from megatron_ucp.format.layout import region_runs
from megatron_ucp.format.tensor_entry import file_layout, file_tensor_name


def json_bytes(obj) -> bytes:
    """As durability.atomic_write_json writes it: the same bytes on disk and in a store."""
    return json.dumps(obj, indent=1, sort_keys=True).encode("utf-8")


def committed(store, save_dir: str) -> tuple:
    """(iterations whose folder holds a manifest, {iteration: its objects}) under `save_dir`."""
    objects: dict = {}
    for path, _ in store.list(save_dir):
        first = path[len(save_dir.rstrip("/")) + 1:].split("/", 1)[0]
        number = iteration_of(first)
        if number is not None:
            objects.setdefault(number, []).append(path)
    done = {i for i, paths in objects.items() if storage.join(iteration_dir(save_dir, i), MANIFEST) in paths}
    return done, objects


def prepare(store, save_dir: str, iteration: int) -> int:
    """Rank 0, before any upload: this iteration uncommitted (its old manifest first), dead
    saves' leftovers removed (unfinished uploads, folders without a manifest). Returns the
    objects and uploads removed."""
    store_owner.claim(save_dir)  # this job owns the prefix (refreshed at every save, as for a folder)
    manifest = storage.join(iteration_dir(save_dir, iteration), MANIFEST)
    if store.exists(manifest):
        store.delete([manifest])
    removed = store.abort_uploads(save_dir)
    done, objects = committed(store, save_dir)
    stale = [p for i, paths in objects.items() if i not in done for p in paths]
    store.delete(stale)
    return removed + len(stale)


def prune(store, save_dir: str, keep_last, newest: int) -> list:
    """--keep-last on a store: complete checkpoints beyond the newest `keep_last` deleted,
    manifest first (a half-deleted one is then a leftover, never loaded); never `newest`."""
    if keep_last is None or keep_last < 1:
        return []
    done, objects = committed(store, save_dir)
    doomed = [i for i in sorted(done)[:-keep_last] if i != newest]
    for i in doomed:
        manifest = storage.join(iteration_dir(save_dir, i), MANIFEST)
        store.delete([manifest])
        store.delete([p for p in objects[i] if p != manifest])
    return doomed


def _build(local: str, entries, layouts, created, received, part_shapes) -> None:
    """The files this rank creates, assembled in `local` from every rank's parts."""
    for name in created:
        tensor_io.create_tensor_file(os.path.join(local, entries[name].file), layouts[name])
    for item, chunks in received:
        path = os.path.join(local, entries[item.name].file)
        runs = region_runs(part_shapes[(item.name, item.region.part)], item.region)
        for state, chunk in chunks.items():
            tensor_io.write_runs(path, layouts[item.name], file_tensor_name(state, item.region.part), runs, chunk)


def _upload(store, final: str, local: str, entries, layouts, created, rng_state) -> dict:
    """Checksum and upload each file this rank created (then drop it), and its RNG state."""
    def one(name):
        path = os.path.join(local, entries[name].file)
        sums = checksums.block_checksums(path, len(layouts[name].header), layouts[name].file_size)
        store.upload(storage.join(final, entries[name].file), path)
        os.unlink(path)
        return name, {"file_size": layouts[name].file_size, "block_bytes": checksums.BLOCK_BYTES,
                      "checksums": sums}

    sums = dict(tensor_io.in_parallel(one, list(created)))
    if rng_state is not None:
        store.write(rng_file(storage.join(final, "rng"), dist.get_rank()), json_bytes(rng_state))
    return sums


def _commit(store, save_dir: str, iteration: int, head, all_checksums) -> None:
    """Rank 0: the manifest, then the tracker."""
    tensors = dict(head.tensors)
    for c in all_checksums:
        for name, info in c.items():
            tensors[name] = tensors[name].written(**info)
    commit(store, save_dir, iteration, json_bytes(dataclasses.replace(head, tensors=tensors).to_json()))


def commit(store, save_dir: str, iteration: int, manifest: bytes) -> None:
    """Step 3, once every object of the iteration is up: its manifest, then the tracker (also
    the commit of a converter's output staged on local disk: convert/store_output.py)."""
    store.write(storage.join(iteration_dir(save_dir, iteration), MANIFEST), manifest)
    store.write(storage.join(save_dir, TRACKER), f"{iteration}\n".encode())


def discard(store, final: str) -> None:
    """A failed save's objects under `final` removed (it has no manifest: a load never takes
    them); errors ignored, the save's own is the one to report (a crash leaves them to the
    next save's prepare)."""
    try:
        store.delete([p for p, _ in store.list(final)])
    except Exception:  # noqa: BLE001
        pass


def execute(save_dir, iteration, items, snapshot, transfers, entries, part_shapes, created, rng_state,
            head, keep_last, group, dtypes=None, *, exchange_rows, digests_of):
    """save._execute's steps for a store (same arguments): column blocks exchanged, every
    item's bytes sent to its file's creator, files assembled, checksummed and uploaded, the
    resume proof's digests, then the commit; every step agreed by all ranks over `group`.
    `exchange_rows`, `digests_of`: save.py's steps of the same names."""

    rank = dist.get_rank()
    store = stores.store_for(save_dir)
    layouts = {name: file_layout(e) for name, e in entries.items()}
    everywhere = functools.partial(run_everywhere, group=group)
    final = iteration_dir(save_dir, iteration)
    local = tempfile.mkdtemp(prefix=f"ucp-upload-{rank}-")
    try:
        os.makedirs(os.path.join(local, "tensors"))
        on_rank_zero(prepare, store, save_dir, iteration, group=group)
        everywhere(exchange_rows, transfers, group)
        creators = [None] * dist.get_world_size(group)
        dist.all_gather_object(creators, sorted(created), group=group)
        creator = {name: r for r, names in enumerate(creators) for name in names}
        outgoing: dict = {}
        for item in items:
            outgoing.setdefault(creator[item.name], []).append((item, snapshot[item.key]))
        received = exchange_objects(outgoing, group)
        everywhere(_build, local, entries, layouts, created,
                   [x for r in sorted(received) for x in received[r]], part_shapes)
        sums = everywhere(_upload, store, final, local, entries, layouts, created, rng_state)
        digests = None if dtypes is None else (everywhere(digests_of, items, snapshot, part_shapes), dtypes)
        sent = list(exchange_objects({0: (sums, digests)} if sums or digests else {}, group).values())
        if rank == 0 and dtypes is not None:
            head = dataclasses.replace(head, proof=proof.with_digests(head.proof, [d for _, d in sent if d]))
        everywhere(lambda: _commit(store, save_dir, iteration, head, [s for s, _ in sent if s])
                   if rank == 0 else None)
    except Exception as e:
        if rank == 0:  # nothing of this save is committed: its objects go
            discard(store, final)
        if isinstance(e, SaveError):
            raise
        raise SaveError(f"save of iteration {iteration} to {save_dir} failed, nothing committed: {e}") from e
    finally:
        shutil.rmtree(local, ignore_errors=True)
    everywhere(lambda: prune(store, save_dir, keep_last, iteration) if rank == 0 else None)
    return final
