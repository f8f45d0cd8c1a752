"""Universal load: each rank gets only the bytes of the slices it owns in the new layout.

For every local parameter: the whole TP-local slice of the fp32 master weight (the model needs
all of it), and only the distributed-optimizer fragment of the Adam moments. With the read
policy "once", what replicas all hold (over data parallelism, and over tensor parallelism for
tensors every TP rank holds whole: reads.replica_class) is read from storage once per replica
group, each member reading a share and broadcasting it to the others (reads.py, read_plan.py,
replicas.py), and the tied output layer's copy on the last pipeline stage is sent by the first
stage (tied.py); with "per-rank" each rank reads
everything it holds; "auto" (the default) reads once where a replica group spans nodes, per
rank where it runs on one node, whose page cache already serves the replicas one read. The step
count, scheduler, iteration and consumed samples are global; RNG is restored on the same layout
and reseeded deterministically on a different one.
"""

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from megatron_ucp.engine import proof
from megatron_ucp.engine.collective import exchange_objects, run_everywhere
from megatron_ucp.engine.planner import names_by_owner, unclaimed
from megatron_ucp.engine.reads import exchange, read_plan, read_tensors
from megatron_ucp.engine.save import current_layout, owned_regions
from megatron_ucp.engine.verify import Layouts, check_hashes, check_headers, hash_plan
from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError, LayoutError
from megatron_ucp.format import manifest as mf, storage, tensor_io
from megatron_ucp.format.folder import iteration_dir, read_tracker
from megatron_ucp.mcore import rng
from megatron_ucp.mcore.model_map import local_tensors, unwrap
from megatron_ucp.mcore.optimizer_state import (grad_scaler_state, load_grad_scaler,
                                                uses_distributed_optimizer, write_step)

READ_POLICIES = ("auto", "once", "per-rank")


@dataclass
class LoadResult:
    iteration: int
    consumed_samples: int
    layout_changed: bool
    bytes_read: int
    manifest: mf.Manifest
    bytes_hashed_after: int = 0  # verification: bytes this rank read again to hash them
    read_policy: str = "auto"
    bytes_exchanged: int = 0  # bytes this rank received from its replicas instead of storage
    read_notes: tuple = ()  # why a replica group read per rank under the policies "once" and "auto"
    proof_note: Optional[str] = None  # how the resume proof went (engine/proof.check's line)


def _check_tensors(m: mf.Manifest, tensors, path: str) -> None:
    saved = m.tensors
    wanted = {t.name for t in tensors}
    missing = sorted(wanted - saved.keys())
    if missing:
        raise IncompleteCheckpointError(
            f"{path}: {len(missing)} tensors of the model are not in the checkpoint: {missing[:5]}")
    for t in tensors:
        shape = saved[t.name].shape
        if shape != tuple(t.atomic_shape):
            raise LayoutError(
                f"{path}: tensor {t.name!r} has shape {list(shape)} in the checkpoint, the model "
                f"expects {list(t.atomic_shape)}")


def _unrequested(m: mf.Manifest, tensors, path: str, strict: bool, owned) -> set:
    """Collective: the checkpoint tensors no rank's model asks for; with `strict` an error.

    Each checkpoint tensor is checked by its owner (planner.owner_of; `owned`: this rank's),
    told by the ranks that hold it: a rank sends and receives names of its own share, not the
    world's. Only the (normally empty) lists of unrequested names go to every rank: a load
    neither reads nor hashes them (a 4 KB manifest entry may name a 1 TiB file)."""
    told = exchange_objects(names_by_owner({t.name for t in tensors}, dist.get_world_size()))

    def check():
        unexpected = unclaimed(owned, told.values())
        if strict and unexpected:
            raise LayoutError(
                f"{path}: checkpoint tensors have no place in the model: "
                f"{unexpected[:5]} (strict=False, --no-strict-load, ignores them)")
        return unexpected

    mine = run_everywhere(check)
    if strict:
        return set()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return set().union(*map(set, everyone))


def _same_layout(saved: dict, current: dict) -> bool:
    keys = [k for k in current if k != "use_distributed_optimizer"]
    older = {"context_parallel_size": 1}  # manifests from before it was recorded
    return all(saved.get(k, older.get(k)) == current[k] for k in keys)


def _missing_pieces(m: mf.Manifest, path: str, optimizer, scheduler, load_optim, load_scheduler) -> None:
    """What the caller asked to load must be in the checkpoint: a missing piece is an error
    naming the flag that skips it, never a silent fresh start."""
    if optimizer is None or not load_optim:
        return
    if m.optimizer is None or any("exp_avg" not in e.states for e in m.tensors.values() if not e.buffer):
        raise IncompleteCheckpointError(
            f"{path}: checkpoint holds no optimizer state; load with load_optim=False (--no-load-optim)")
    if scheduler is not None and load_scheduler and m.scheduler is None:
        raise IncompleteCheckpointError(
            f"{path}: 'scheduler' is null, the checkpoint holds no learning-rate scheduler state; "
            "load with load_scheduler=False (--no-load-scheduler) to start a fresh one")


def _prepare(root, model, optimizer, scheduler, vocab_size, iteration, load_optim, load_scheduler,
             load_rng, source=None):
    """The manifest checked as a whole, and this rank's RNG state read, before any tensor is
    (`source`'s where it serves the checkpoint: piece_reads.PieceSource)."""
    m = mf.read_manifest(root) if source is None else source.manifest
    path = os.path.join(root, mf.MANIFEST)

    if m.iteration != iteration:
        raise FormatError(f"{path}: 'iteration' is {m.iteration}, expected {iteration} "
                          "(the iteration asked for, or the tracker's)")
    mf.check_architecture(m.architecture, mf.architecture(unwrap(model[0]), vocab_size), root)
    _missing_pieces(m, path, optimizer, scheduler, load_optim, load_scheduler)
    with_optim = optimizer is not None and load_optim
    tensors = local_tensors(model, optimizer if with_optim else None, vocab_size, for_load=True)
    _check_tensors(m, tensors, root)
    changed = not _same_layout(m.layout, current_layout(optimizer).to_json())
    # A checkpoint saved without RNG (--no-save-rng) reseeds; a missing file of one saved with
    # it stays an error naming --no-load-rng.
    load_rng = load_rng and m.rng_saved is not False
    rng_state = None
    if load_rng and not changed:
        rank = dist.get_rank()
        rng_state = rng.read(os.path.join(root, "rng"), rank) if source is None else source.rng(rank)
    return m, tensors, with_optim, changed, rng_state


def load_universal(load_dir: str, model, optimizer=None, scheduler=None, *, vocab_size: int,
                   iteration: Optional[int] = None, load_optim: bool = True,
                   load_rng: bool = True, strict: bool = True, verify: bool = True, reseed=None,
                   counter: Optional[tensor_io.ReadCounter] = None,
                   load_scheduler: bool = True, read_policy: str = "auto", prove: bool = True,
                   tier: str = "persistent", source=None) -> LoadResult:
    """Load a universal checkpoint into model chunks (and optimizer, scheduler) of any layout.

    Collective; a failure on any rank raises on every rank, and leaves the model and optimizer
    partially loaded (values are read in place): resume from another checkpoint or restart.
    `verify` checks every file's size and header before reading, and every block checksum of
    the checkpoint from the bytes the load reads (checksums.py; bytes nobody loads are read
    after), raising before anything returns. `strict` refuses checkpoint tensors that have no
    place in the model. `reseed(iteration)` is called when the layout changed (or RNG is not
    loaded), to reseed deterministically. The manifest is checked as a whole first: what was
    asked for (optimizer state with `load_optim`, scheduler state with `load_scheduler` as
    well, RNG state of this rank with `load_rng` on the same layout) must be there.
    `read_policy`: "once" reads what data-parallel replicas share once per replica group and
    exchanges it over the group; "per-rank" has every rank read all it holds (faster where the
    replicas share a node, whose page cache serves them one read); "auto" reads once in the
    replica groups that span nodes, per rank in the others (docs/design.md, "Read once").
    `prove` recomputes the checkpoint's resume proof on this layout before anything returns
    (engine/proof.py) and raises proof.ResumeProofError on every rank when the restored state
    computes something else; `tier` names where the checkpoint came from in that message.
    `source` serves the manifest, RNG states and tensor reads in place of the folder's files
    (the local tier's pieces: piece_reads.PieceSource; no verification: they were checked).
    """
    if read_policy not in READ_POLICIES:
        raise ConfigError(f"read_policy {read_policy!r}: expected one of {list(READ_POLICIES)}")
    if iteration is None:
        iteration = run_everywhere(read_tracker, load_dir)
    root = iteration_dir(load_dir, iteration)
    if source is None and storage.is_remote(root):  # an object store: ranged GETs (store_source.py)
        from megatron_ucp.engine.store_source import StoreSource
        source = run_everywhere(StoreSource, root)
    checked = source if getattr(source, "verifies", False) else None  # verify.py's checks through it
    if source is not None and checked is None and verify:
        raise ConfigError("a load from the local tier's pieces is not verified per block (verify=False)")
    counter = counter if counter is not None else tensor_io.ReadCounter()
    m, tensors, with_optim, changed, rng_state = run_everywhere(
        _prepare, root, model, optimizer, scheduler, vocab_size, iteration, load_optim,
        load_scheduler, load_rng, source)
    # The checkpoint's tensors this rank plans for (the strict check, the hashing): one pass
    # over the manifest's names.
    owned = names_by_owner(m.tensors, dist.get_world_size()).get(dist.get_rank(), [])
    full = m
    unrequested = _unrequested(m, tensors, root, strict, owned)
    if unrequested:  # what the load reads, checks and hashes: the tensors the model asks for
        m = dataclasses.replace(m, tensors={n: e for n, e in m.tensors.items() if n not in unrequested})
        owned = [n for n in owned if n not in unrequested]
    layouts = Layouts(m.tensors)
    reading = read_plan(tensors, read_policy, with_optim and uses_distributed_optimizer(optimizer))
    if hasattr(source, "plan_reads"):  # the local tier: a node's ranks' spans of what it lacks, fetched
        source.plan_reads(m, tensors, reading)
    if not verify and (source is None or checked is not None):
        run_everywhere(check_headers, root, m, tensors, reading, checked)
    plan = hash_plan(root, m, layouts, tensors, reading, owned, checked) if verify else None
    hashes: dict = {}
    staged: dict = {}
    run_everywhere(read_tensors, root, m, layouts, tensors, reading, counter,
                   plan.inline if plan else {}, hashes, staged, source)
    if hasattr(source, "reads_done"):  # the local tier: the transfer it overlapped with the reads, finished
        run_everywhere(source.reads_done)
    exchanged = exchange(tensors, reading, staged)

    def restore():
        for t in tensors:
            t.apply_write_back()
            if t.fragment is not None and t.fragment.store is not None:
                t.fragment.store()  # the optimizer keeps its own copies (precision-aware: maybe bf16)
        if with_optim:
            _restore_optimizer_record(optimizer, m.optimizer, root)
            if scheduler is not None and load_scheduler:
                scheduler.load_state_dict(m.scheduler)

    run_everywhere(restore)
    rehashed = check_hashes(root, m, layouts, plan, hashes, checked) if plan is not None else 0
    note = None
    if prove:  # before RNG is restored: the probe's forward pass must not shift any generator
        live = owned_regions(local_tensors(model, optimizer if with_optim else None, vocab_size), with_optim)
        note = run_everywhere(proof.check, full.proof, model, live, vocab_size, root, tier)
        if note and dist.get_rank() == 0:
            print(f" {note}", flush=True)
    if rng_state is not None:
        run_everywhere(rng.restore, rng_state)
    elif reseed is not None:
        reseed(int(m.iteration))
    if reading.notes and dist.get_rank() == 0:
        print(" warning: read-once load: " + "; ".join(reading.notes) + ": each member of such a group "
              "reads all it holds", flush=True)
    return LoadResult(int(m.iteration), int(m.consumed_samples), changed, counter.bytes, full,
                      rehashed, read_policy, exchanged, tuple(reading.notes),
                      note if prove else "resume proof not checked (--no-resume-proof)")


def _restore_optimizer_record(optimizer, record: dict, root: str) -> None:
    """Adam's step in the optimizer's own convention, and the fp16 loss scaler's state."""
    write_step(optimizer, int(record.get("step", 0)))
    scaler = record.get("grad_scaler")
    if scaler is not None:
        load_grad_scaler(optimizer, scaler)
    elif grad_scaler_state(optimizer) is not None and dist.get_rank() == 0:
        print(f" warning: {root} holds no loss-scaler state (saved without --fp16); the loss "
              "scale starts afresh", flush=True)
