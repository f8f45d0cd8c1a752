"""Universal load: each rank gets only the bytes of the slices it owns in the new layout.

For every local parameter: the whole TP-local slice of the fp32 master weight (the model needs
all of it), and only the distributed-optimizer fragment of the Adam moments. With the read
policy "once", what data-parallel replicas all hold (weights; moments too without the
distributed optimizer) is read from storage once per replica group, each member reading a share
and broadcasting it to the others (read_plan.py, replicas.py); with "per-rank" each rank reads
everything it holds; "auto" (the default) reads once where a replica group spans nodes, per
rank where it runs on one node, whose page cache already serves the replicas one read. The step
count, scheduler, iteration and consumed samples are global; RNG is restored on the same layout
and reseeded deterministically on a different one.
"""

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_ucp import settings
from megatron_ucp.engine import replicas
from megatron_ucp.engine.collective import run_everywhere
from megatron_ucp.engine.read_plan import Need
from megatron_ucp.errors import (ConfigError, FormatError, IncompleteCheckpointError, IntegrityError,
                                 LayoutError)
from megatron_ucp.format import checksums, host_memory, manifest as mf, safe_files, tensor_io
from megatron_ucp.format.folder import iteration_dir, read_tracker
from megatron_ucp.format.layout import fragment_regions, padding_shape, region_runs
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
    manifest: dict
    bytes_hashed_after: int = 0  # verification: bytes this rank read again to hash them
    read_policy: str = "auto"
    bytes_exchanged: int = 0  # bytes this rank received from its replicas instead of storage
    read_notes: tuple = ()  # why a replica group read per rank under the policies "once" and "auto"


def _host_view(tensor: torch.Tensor) -> Optional[np.ndarray]:
    """A flat fp32 numpy view sharing `tensor`'s memory, so reads land in place (CPU only)."""
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or not tensor.is_contiguous():
        return None
    return tensor.detach().view(-1).numpy()


def _file_runs(entry, t, state, start, stop):
    """The reads that fill local flat elements [start, stop) of `state`: (file tensor name,
    [(file element, element from start, length)]) per held region, and whether they cover
    every element (they do not where the checkpoint lacks rows: new vocabulary padding)."""
    held = t.pieces(entry["padding_rows"] if t.padded_rows is not None else None)
    regions = fragment_regions(held, start, stop)
    part_shapes = {"": tuple(entry["shape"]), "padding": padding_shape(entry["shape"], entry["padding_rows"])}
    reads = []
    for local_start, region in regions:
        runs = region_runs(part_shapes[region.part], region)
        reads.append((mf.file_tensor_name(state, region.part),
                      np.stack([runs[:, 1], runs[:, 0] + (local_start - start), runs[:, 2]], axis=1)))
    return reads, sum(r.numel for _, r in regions) == stop - start


def _read_range(path, entry, layout, t, state, start, stop, counter, out=None, hash_spans=(),
                hashes=None) -> np.ndarray:
    """Local flat elements [start, stop) of `state`, zero where the checkpoint holds nothing.

    Reads into `out` (stop - start fp32 elements) when given, else into a new array (on huge
    pages: it is filled at once). Hashes the `hash_spans` it reads (tensor_io.read_runs).
    """
    reads, complete = _file_runs(entry, t, state, start, stop)
    if out is None:
        out = host_memory.empty_fp32(stop - start)
    if not complete:
        out[:] = 0  # rows the checkpoint does not hold (new vocabulary padding) start at zero
    for name, file_runs in reads:
        tensor_io.read_runs(path, layout, name, file_runs, out, counter, hash_spans, hashes)
    return out


def _ranges(t):
    """(state, local start, local stop) of every range of its checkpoint `t` holds."""
    yield "param", 0, t.param.numel()
    if t.fragment is not None:
        for state in ("exp_avg", "exp_avg_sq"):
            yield state, t.fragment.start, t.fragment.stop


def _region(t, state: str, start: int, stop: int) -> torch.Tensor:
    """The model's tensor of local flat elements [start, stop) of `state` (1-D view)."""
    if state == "param":
        return t.param.data.view(-1)[start:stop]
    f = t.fragment
    return getattr(f, state).view(-1)[start - f.start:stop - f.start]


def _deliver(t, state: str, start: int, stop: int, data: torch.Tensor) -> None:
    """Hand fp32 values of local flat elements [start, stop) of `state` to the model: its
    tensor (unless `data` is it), and the distributed optimizer's fp32 master copy."""
    region = _region(t, state, start, stop)
    if region.data_ptr() != data.data_ptr() or region.device != data.device:
        region.copy_(data)
    f = t.fragment
    if state == "param" and f is not None and not f.main_is_model:
        lo, hi = max(start, f.start), min(stop, f.stop)
        if lo < hi:
            f.main[lo - f.start:hi - f.start].copy_(data[lo - start:hi - start])


@dataclass
class _ReadPlan:
    """What this rank reads from storage, and what it exchanges with its replicas."""

    reads: list  # per local tensor: [(state, start, stop, staged)]; staged: kept for an exchange
    # (group, its global ranks, [(key, share)]) in the agreed order; key: (tensor index, state,
    # start, stop) of the share
    exchanges: list
    notes: list  # why a replica group reads per rank


def _needs(tensors, policy: str, distributed_moments: bool):
    """Per replica group (dense, expert): the ranges all its members hold, as (Need, tensor
    index); and the per-tensor reads this rank makes alone (distributed-optimizer moments are
    this rank's own; everything, with the policy "per-rank")."""
    reads = [[] for _ in tensors]
    needs = {False: [], True: []}
    for i, t in enumerate(tensors):
        what = repr((t.atomic_shape, t.padded_rows, t.boxes))
        for state, start, stop in _ranges(t):
            if policy != "per-rank" and (state == "param" or not distributed_moments):
                needs[t.expert].append((Need(t.name, state, start, stop, what), i))
            else:
                reads[i].append((state, start, stop, False))
    return reads, needs


def _read_plan(tensors, policy: str, distributed_moments: bool) -> _ReadPlan:
    """Collective (one small all-gather per replica group, but with "per-rank"): this rank's
    reads and exchanges. "auto" splits the reads of groups that span nodes only."""
    reads, needs = run_everywhere(_needs, tensors, policy, distributed_moments)
    plan = _ReadPlan(reads, [], [])
    if policy == "per-rank":
        return plan
    for expert in (False, True):  # every rank, in this order: each takes part in both groups
        group = replicas.replica_group(expert)
        pairs = needs[expert]
        shares, ranks, why = replicas.agreed_split([n for n, _ in pairs], group, policy == "auto")
        if shares is None:
            for n, i in pairs:
                reads[i].append((n.state, n.start, n.stop, False))
            if why is not None:
                plan.notes.append(why)
            continue
        device = replicas.group_device(group)
        me = ranks.index(dist.get_rank())
        items = []
        for j, share in shares:
            n, i = pairs[j]
            key = (i, n.state, share.start, share.stop)
            if share.reader == me:
                region = _region(tensors[i], n.state, share.start, share.stop)
                staged = region.dtype != torch.float32 or region.device != device
                reads[i].append((n.state, share.start, share.stop, staged))
            items.append((key, share))
        plan.exchanges.append((group, ranks, items))
    return plan


def _check_tensors(m: dict, tensors, path: str, strict: bool) -> None:
    saved = m["tensors"]
    wanted = {t.name for t in tensors}
    missing = sorted(wanted - saved.keys())
    if missing:
        raise IncompleteCheckpointError(
            f"{path}: {len(missing)} tensors of the model are not in the checkpoint: {missing[:5]}")
    for t in tensors:
        shape = tuple(saved[t.name]["shape"])
        if shape != tuple(t.atomic_shape):
            raise LayoutError(
                f"{path}: tensor {t.name!r} has shape {list(shape)} in the checkpoint, the model "
                f"expects {list(t.atomic_shape)}")
    if strict:
        # Each rank sees only its own tensors: the union over ranks must cover the checkpoint.
        # Each checkpoint tensor is checked by its owner (planner.owner_of), told by the ranks
        # that hold it: a rank sends and receives names of its own share, not the world's.
        from megatron_ucp.engine.collective import exchange_objects
        from megatron_ucp.engine.planner import names_by_owner, unclaimed
        from megatron_ucp.engine.save import _p2p_device

        rank, world = dist.get_rank(), dist.get_world_size()
        told = exchange_objects(names_by_owner(wanted, world), device=_p2p_device())

        def check():
            unexpected = unclaimed(saved.keys(), told.values(), rank, world)
            if unexpected:
                raise LayoutError(
                    f"{path}: checkpoint tensors have no place in the model: "
                    f"{unexpected[:5]} (pass strict=False to ignore them)")

        run_everywhere(check)


def _same_layout(saved: dict, current: dict) -> bool:
    keys = [k for k in current if k != "use_distributed_optimizer"]
    return all(saved.get(k) == current[k] for k in keys)


def _missing_pieces(m: dict, path: str, optimizer, scheduler, load_optim, load_scheduler) -> None:
    """What the caller asked to load must be in the checkpoint: a missing piece is an error
    naming the flag that skips it, never a silent fresh start."""
    if optimizer is None or not load_optim:
        return
    if m.get("optimizer") is None or any("exp_avg" not in e["states"] for e in m["tensors"].values()
                                         if not e.get("buffer")):
        raise IncompleteCheckpointError(
            f"{path}: checkpoint holds no optimizer state; load with load_optim=False (--no-load-optim)")
    if scheduler is not None and load_scheduler and m.get("scheduler") is None:
        raise IncompleteCheckpointError(
            f"{path}: 'scheduler' is null, the checkpoint holds no learning-rate scheduler state; "
            "load with load_scheduler=False (--no-load-scheduler) to start a fresh one")


def _prepare(root, model, optimizer, scheduler, vocab_size, iteration, load_optim, load_scheduler,
             load_rng):
    """The manifest checked as a whole, and this rank's RNG state read, before any tensor is."""
    m = mf.read_manifest(root)
    path = os.path.join(root, mf.MANIFEST)
    from megatron_ucp.engine.save import current_layout

    if m["iteration"] != iteration:
        raise FormatError(f"{path}: 'iteration' is {m['iteration']}, expected {iteration} "
                          "(the iteration asked for, or the tracker's)")
    mf.check_architecture(m["architecture"], mf.architecture(unwrap(model[0]), vocab_size), root)
    _missing_pieces(m, path, optimizer, scheduler, load_optim, load_scheduler)
    with_optim = optimizer is not None and load_optim
    tensors = local_tensors(model, optimizer if with_optim else None, vocab_size, for_load=True)
    _check_tensors(m, tensors, root, strict=False)
    changed = not _same_layout(m["layout"], current_layout(optimizer).to_json())
    # A checkpoint saved without RNG (--no-save-rng) reseeds; a missing file of one saved with
    # it stays an error naming --no-load-rng.
    load_rng = load_rng and m.get("rng_saved", True) is not False
    rng_state = rng.read(os.path.join(root, "rng"), dist.get_rank()) if load_rng and not changed else None
    return m, tensors, with_optim, changed, rng_state


def _inline_hash_bytes() -> int:
    """Reads shorter than this (a TP rank's half rows) are not hashed inline: each would be a
    piece to gather and combine. The pass after the load hashes those bytes, from the page
    cache the load has just filled. UCP_INLINE_HASH_BYTES overrides the 256 KiB."""
    return settings.inline_hash_bytes()


class _Layouts(dict):
    """Each tensor file's layout, built from its manifest entry when first asked for: a load
    builds only the layouts of what it reads, and each once."""

    def __init__(self, entries: dict):
        super().__init__()
        self._entries = entries

    def __missing__(self, name):
        self[name] = layout = mf.file_layout(self._entries[name])
        return layout


@dataclass
class _HashPlan:
    """Who hashes which bytes of the checkpoint's tensor files (see checksums.py)."""

    inline: dict  # tensor name -> sorted file byte spans this rank hashes as it reads them
    after: list  # (tensor name, lo, hi) this rank hashes by reading, after the load
    checks: list  # tensor names whose blocks this rank checks, from the hashes sent to it
    checker: dict  # tensor name -> the rank that checks its blocks


def _check_files(root: str, m: dict) -> list:
    """Sizes, headers and recorded checksums of this rank's share of the tensor files (the
    share by size, as file creation); returns every rank's share."""
    from megatron_ucp.engine.plan import assign_files
    from megatron_ucp.format.inspection import check_file

    sizes = {name: int(e.get("file_size", 0)) for name, e in m["tensors"].items()}
    shares = assign_files(sizes, dist.get_world_size())
    mine = shares[dist.get_rank()]
    # A cold header read is a disk round trip (10 ms here): several in flight.
    found = tensor_io.in_parallel(lambda name: check_file(root, name, m["tensors"][name]), mine)
    problems = [p for file_problems in found for p in file_problems]
    if problems:
        raise IntegrityError(f"{root}: checkpoint failed verification: " + "; ".join(problems[:5]))
    return shares


def _check_headers(root: str, m: dict, tensors, plan: _ReadPlan) -> None:
    """Without verification, the header of each file this rank reads (a few KB) is still
    checked against the manifest: the reads take their offsets from the manifest's layout, so a
    valid file with a longer header would be misread silently. Also refuses FIFOs and devices."""
    from megatron_ucp.format.inspection import check_header

    names = sorted({t.name for t, reads in zip(tensors, plan.reads) if reads})
    tensor_io.in_parallel(lambda name: check_header(root, name, m["tensors"][name]), names)


def _read_spans(m: dict, layouts, tensors, plan: _ReadPlan) -> dict:
    """The file byte spans of this rank's load reads, per tensor, long enough to hash inline."""
    out: dict = {}
    shortest = _inline_hash_bytes()
    for t, reads in zip(tensors, plan.reads):
        entry = m["tensors"][t.name]
        layout = layouts[t.name]
        for state, start, stop, _ in reads:
            for name, runs in _file_runs(entry, t, state, start, stop)[0]:
                out.setdefault(t.name, []).extend(
                    s for s in tensor_io.read_spans(layout, name, runs) if s[1] - s[0] >= shortest)
    return out


def _hash_plan(root: str, m: dict, layouts, tensors, reads: _ReadPlan) -> _HashPlan:
    """Collective: files checked (sizes, headers), then every byte of every tensor file given
    one rank to hash, as it loads it where it can (the reads of `reads`: under read-once, each
    replicated byte is read, and so hashed, by one member of its replica group)."""
    shares = run_everywhere(_check_files, root, m)
    rank, world = dist.get_rank(), dist.get_world_size()
    checker = {name: r for r, names in enumerate(shares) for name in names}
    # Each file's hashing is planned by its owner (planner.owner_of), from the spans its readers
    # send it: a rank sends and receives what concerns its own reads and files, not the world's.
    from megatron_ucp.engine.collective import exchange_objects
    from megatron_ucp.engine.planner import owner_of
    from megatron_ucp.engine.save import _p2p_device
    from megatron_ucp.format.checksums import plan_hashes

    device = _p2p_device()
    spans = run_everywhere(_read_spans, m, layouts, tensors, reads)
    routed: dict = {}
    for name, s in spans.items():
        routed.setdefault(owner_of(name, world), {})[name] = s
    told = exchange_objects(routed, device=device)

    def plan():
        files = {name: (len(layouts[name].header), entry["file_size"], entry["block_bytes"])
                 for name, entry in m["tensors"].items() if owner_of(name, world) == rank}
        return plan_hashes(files, told, world, rank)

    mine = exchange_objects(run_everywhere(plan), device=device)
    inline, after = {}, []
    for owner in sorted(mine):
        inline.update(mine[owner]["inline"])
        after += mine[owner]["after"]
    return _HashPlan(inline, after, shares[rank], checker)


def _check_hashes(root: str, m: dict, layouts, plan: _HashPlan, hashes: dict) -> int:
    """Collective, after the load: hash what the load did not, send each file's hashes to the
    rank that checks it, and check the blocks of this rank's share of the files. Returns the
    bytes hashed after."""

    def hash_rest():
        todo = list(plan.after)
        for name, spans in plan.inline.items():  # any piece the reads did not meet
            done = {(lo, hi) for lo, hi, _ in hashes.get(name, ())}
            todo += [(name, lo, hi) for lo, hi in spans if (lo, hi) not in done]
        by_file: dict = {}
        for name, lo, hi in todo:
            by_file.setdefault(name, []).append((lo, hi))
        for name, spans in by_file.items():
            path = safe_files.safe_join(root, m["tensors"][name]["file"])
            crcs = checksums.crc_spans(path, spans)
            hashes.setdefault(name, []).extend((lo, hi, c) for (lo, hi), c in zip(spans, crcs))
        return sum(hi - lo for _, lo, hi in todo)

    rehashed = run_everywhere(hash_rest)
    from megatron_ucp.engine.collective import exchange_objects
    from megatron_ucp.engine.save import _p2p_device

    # Each file's hashes go to its checker only: a rank sends and receives what concerns its
    # own reads and files, not the world's. A set: bytes a rank happens to read twice are
    # hashed twice, and must count once.
    routed: dict = {}
    for name, h in hashes.items():
        if h:
            routed.setdefault(plan.checker[name], {})[name] = sorted(set(h))
    received = exchange_objects(routed, device=_p2p_device())

    def check():
        problems = []
        for name in plan.checks:
            entry = m["tensors"][name]
            hashed = [p for h in received.values() for p in h.get(name, ())]
            problems += checksums.check_blocks(safe_files.safe_join(root, entry["file"]),
                                               len(layouts[name].header), entry["file_size"],
                                               entry["block_bytes"], entry["checksums"], hashed)
        if problems:
            raise IntegrityError(f"{root}: checkpoint failed verification: " + "; ".join(problems[:5]))

    run_everywhere(check)
    return rehashed


def load_universal(load_dir: str, model, optimizer=None, scheduler=None, *, vocab_size: int,
                   iteration: Optional[int] = None, load_optim: bool = True,
                   load_rng: bool = True, strict: bool = True, verify: bool = True, reseed=None,
                   counter: Optional[tensor_io.ReadCounter] = None,
                   load_scheduler: bool = True, read_policy: str = "auto") -> LoadResult:
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
    """
    if read_policy not in READ_POLICIES:
        raise ConfigError(f"read_policy {read_policy!r}: expected one of {list(READ_POLICIES)}")
    if iteration is None:
        iteration = run_everywhere(read_tracker, load_dir)
    root = iteration_dir(load_dir, iteration)
    counter = counter if counter is not None else tensor_io.ReadCounter()
    m, tensors, with_optim, changed, rng_state = run_everywhere(
        _prepare, root, model, optimizer, scheduler, vocab_size, iteration, load_optim,
        load_scheduler, load_rng)
    if strict:
        _check_tensors(m, tensors, root, strict=True)
    layouts = _Layouts(m["tensors"])
    reads = _read_plan(tensors, read_policy, with_optim and uses_distributed_optimizer(optimizer))
    if not verify:
        run_everywhere(_check_headers, root, m, tensors, reads)
    plan = _hash_plan(root, m, layouts, tensors, reads) if verify else None
    hashes: dict = {}
    staged: dict = {}
    run_everywhere(_read_tensors, root, m, layouts, tensors, reads, counter,
                   plan.inline if plan else {}, hashes, staged)
    exchanged = _exchange(tensors, reads, staged)

    def restore():
        for t in tensors:
            t.apply_write_back()
            if t.fragment is not None and t.fragment.store is not None:
                t.fragment.store()  # the optimizer keeps its own copies (precision-aware: maybe bf16)
        if with_optim:
            _restore_optimizer_record(optimizer, m["optimizer"], root)
            if scheduler is not None and load_scheduler:
                scheduler.load_state_dict(m["scheduler"])

    run_everywhere(restore)
    rehashed = _check_hashes(root, m, layouts, plan, hashes) if plan is not None else 0
    if rng_state is not None:
        run_everywhere(rng.restore, rng_state)
    elif reseed is not None:
        reseed(int(m["iteration"]))
    if reads.notes and dist.get_rank() == 0:
        print(" warning: read-once load: " + "; ".join(reads.notes) + ": each member of such a group "
              "reads all it holds", flush=True)
    return LoadResult(int(m["iteration"]), int(m["consumed_samples"]), changed, counter.bytes, m,
                      rehashed, read_policy, exchanged, tuple(reads.notes))


def _read_tensors(root, m, layouts, tensors, plan: _ReadPlan, counter, hash_spans: dict,
                  hashes: dict, staged: dict) -> None:
    """This rank's reads from storage, in place where it can; several files in flight where
    this node has cores to spare (tensor_io.read_threads), each thread counting its own bytes.
    The `hash_spans` of each tensor are hashed as they are read, into `hashes`; the reads an
    exchange sends from a staging copy leave it in `staged`."""
    def load_one(i):
        t, mine, found = tensors[i], tensor_io.ReadCounter(), []
        entry, layout = m["tensors"][t.name], layouts[t.name]
        path = safe_files.safe_join(root, entry["file"])  # refuses names that escape the checkpoint
        spans = hash_spans.get(t.name, ())
        with torch.no_grad():
            for state, start, stop, keep in plan.reads[i]:  # the reads _read_spans planned the hashing of
                in_place = _host_view(_region(t, state, start, stop))
                data = _read_range(path, entry, layout, t, state, start, stop, mine, in_place,
                                   spans, found)
                _deliver(t, state, start, stop, torch.from_numpy(data))
                if keep:
                    staged[(i, state, start, stop)] = data
        return t.name, mine, found

    # Largest first, so that the threads' tails are short.
    order = sorted((i for i, reads in enumerate(plan.reads) if reads),
                   key=lambda i: -sum(stop - start for _, start, stop, _ in plan.reads[i]))
    for name, done, found in tensor_io.in_parallel(load_one, order, tensor_io.read_threads()):
        counter.bytes += done.bytes
        counter.calls += done.calls
        hashes.setdefault(name, []).extend(found)


def _exchange(tensors, plan: _ReadPlan, staged: dict) -> int:
    """Collective over each replica group: every share broadcast from its reader to the other
    members. Returns the bytes this rank received."""
    def deliver(key, data):
        i, state, start, stop = key
        with torch.no_grad():
            _deliver(tensors[i], state, start, stop, data)

    received = 0
    for group, ranks, items in plan.exchanges:
        received += replicas.broadcast_shares(
            group, ranks, [(key, _region(tensors[key[0]], *key[1:]), share) for key, share in items],
            staged, deliver)
    return received


def _restore_optimizer_record(optimizer, record: dict, root: str) -> None:
    """Adam's step in the optimizer's own convention, and the fp16 loss scaler's state."""
    write_step(optimizer, int(record.get("step", 0)))
    scaler = record.get("grad_scaler")
    if scaler is not None:
        load_grad_scaler(optimizer, scaler)
    elif grad_scaler_state(optimizer) is not None and dist.get_rank() == 0:
        print(f" warning: {root} holds no loss-scaler state (saved without --fp16); the loss "
              "scale starts afresh", flush=True)
