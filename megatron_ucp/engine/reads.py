"""Where a load's bytes come from and where they land: the ranges of its checkpoint each local
tensor holds, the reads that fill them from the tensor files (in place where the memory allows),
and, under read-once, the shares each replica-group member reads and broadcasts to the others
(read_plan.py, replicas.py)."""

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_ucp.engine import replicas, tied as tied_exchange
from megatron_ucp.engine.collective import all_true, group_device, run_everywhere
from megatron_ucp.engine.read_plan import Need, Share
from megatron_ucp.engine.tied import TiedPlan
from megatron_ucp.format import host_memory, safe_files, tensor_io
from megatron_ucp.format.layout import fragment_regions, padding_shape, region_runs
from megatron_ucp.format.tensor_entry import file_tensor_name


def host_view(tensor: torch.Tensor) -> Optional[np.ndarray]:
    """A flat fp32 numpy view sharing `tensor`'s memory, so reads land in place (CPU only)."""
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or not tensor.is_contiguous():
        return None
    return tensor.detach().view(-1).numpy()


def file_runs(entry, t, state, start, stop):
    """The reads that fill local flat elements [start, stop) of `state`: (file tensor name,
    [(file element, element from start, length)]) per held region, and whether they cover
    every element (they do not where the checkpoint lacks rows: new vocabulary padding)."""
    held = t.pieces(entry.padding_rows if t.padded_rows is not None else None)
    regions = fragment_regions(held, start, stop)
    part_shapes = {"": entry.shape, "padding": padding_shape(entry.shape, entry.padding_rows)}
    reads = []
    for local_start, region in regions:
        runs = region_runs(part_shapes[region.part], region)
        reads.append((file_tensor_name(state, region.part),
                      np.stack([runs[:, 1], runs[:, 0] + (local_start - start), runs[:, 2]], axis=1)))
    return reads, sum(r.numel for _, r in regions) == stop - start


def read_range(path, entry, layout, t, state, start, stop, counter, out=None, hash_spans=(),
                hashes=None, read=tensor_io.read_runs) -> np.ndarray:
    """Local flat elements [start, stop) of `state`, zero where the checkpoint holds nothing.

    Reads into `out` (stop - start fp32 elements) when given, else into a new array (on huge
    pages: it is filled at once). Hashes the `hash_spans` it reads (tensor_io.read_runs).
    `read`: tensor_io.read_runs's interface (`path` is its first argument): the local tier's
    pieces serve it instead of files (piece_reads.PieceSource).
    """
    reads, complete = file_runs(entry, t, state, start, stop)
    if out is None:
        out = host_memory.empty_fp32(stop - start)
    if not complete:
        out[:] = 0  # rows the checkpoint does not hold (new vocabulary padding) start at zero
    for name, runs in reads:
        read(path, layout, name, runs, out, counter, hash_spans, hashes)
    return out


def param_numel(t) -> int:
    return t.param.numel()


def ranges(t, numel=param_numel):
    """(state, local start, local stop) of every range of its checkpoint `t` holds; `numel(t)`:
    elements of the local tensor (the simulator's tensors have no parameter)."""
    yield "param", 0, numel(t)
    if t.fragment is not None:
        for state in ("exp_avg", "exp_avg_sq"):
            yield state, t.fragment.start, t.fragment.stop


def local_region(t, state: str, start: int, stop: int) -> torch.Tensor:
    """The model's tensor of local flat elements [start, stop) of `state` (1-D view)."""
    if state == "param":
        return t.param.data.view(-1)[start:stop]
    f = t.fragment
    return getattr(f, state).view(-1)[start - f.start:stop - f.start]


def deliver(t, state: str, start: int, stop: int, data: torch.Tensor) -> None:
    """Hand fp32 values of local flat elements [start, stop) of `state` to the model: its
    tensor (unless `data` is it), and the distributed optimizer's fp32 master copy."""
    region = local_region(t, state, start, stop)
    if region.data_ptr() != data.data_ptr() or region.device != data.device:
        region.copy_(data)
    f = t.fragment
    if state == "param" and f is not None and not f.main_is_model:
        lo, hi = max(start, f.start), min(stop, f.stop)
        if lo < hi:
            f.main[lo - f.start:hi - f.start].copy_(data[lo - start:hi - start])


@dataclass
class ReadPlan:
    """What this rank reads from storage, and what it exchanges with its replicas."""

    reads: list  # per local tensor: [(state, start, stop, staged)]; staged: kept for an exchange
    # (group, its global ranks, [(key, share)]) in the agreed order; key: (tensor index, state,
    # start, stop) of the share
    exchanges: list
    notes: list  # why a replica group reads per rank
    tied: Optional[TiedPlan] = None  # the tied output layer's copy, from the first stage (tied.py)
    partner: list = field(default_factory=list)  # [(key, share)] sent over the embedding group first


def replica_class(t, state: str, tensor_parallel_size: int, distributed_moments: bool) -> Optional[str]:
    """Which replica group holds the same bytes of `state` of `t` as this rank (replicas.CLASSES),
    or None where no other rank does. Dense tensors are replicated over data parallelism, and
    those every TP rank holds whole (norms, row-parallel biases) over tensor parallelism too;
    experts over expert data parallelism. The distributed optimizer gives each data-parallel
    rank its own fragment of the moments: those are replicated over tensor parallelism only,
    for tensors held whole, and nowhere else."""
    own_moments = state != "param" and distributed_moments
    if t.expert:
        return None if own_moments else "expert"
    whole = (tensor_parallel_size > 1 and t.padded_rows is None and len(t.boxes) == 1
             and tuple(t.boxes[0].shape) == tuple(t.atomic_shape) and not any(t.boxes[0].offset))
    if own_moments:
        return "tensor" if whole else None
    return "tensor+data" if whole else "data"


def geometry(t) -> str:
    """What members of a replica group compare to know they hold the same parts of a tensor."""
    return repr((t.atomic_shape, t.padded_rows, t.boxes))


def replica_needs(tensors, policy: str, distributed_moments: bool, tensor_parallel_size: int,
                  numel=param_numel, handled=frozenset()):
    """Per replica class (replicas.CLASSES): the ranges all the members of this rank's group of
    that class hold, as (Need, tensor index); and the per-tensor reads this rank makes alone
    (replica_class None; everything, with the policy "per-rank"). `handled`: the (tensor index,
    state) pairs the tied exchange fills (tied_states)."""
    reads = [[] for _ in tensors]
    needs = {kind: [] for kind in replicas.CLASSES}
    for i, t in enumerate(tensors):
        what = geometry(t)
        for state, start, stop in ranges(t, numel):
            if (i, state) in handled:
                continue
            kind = replica_class(t, state, tensor_parallel_size, distributed_moments)
            if policy != "per-rank" and kind is not None:
                needs[kind].append((Need(t.name, state, start, stop, what), i))
            else:
                reads[i].append((state, start, stop, False))
    return reads, needs


def tied_states(tensors, tied: Optional[TiedPlan], distributed_moments: bool) -> dict:
    """Pure: the (tensor index, state) pairs the tied exchange fills -> whether the two stages'
    data-parallel groups split them alike (the weights, and the moments without the
    distributed optimizer); the distributed optimizer's moments of the copies come point to
    point, the written tensor's are read as any other fragment."""
    if tied is None:
        return {}
    out = {}
    for i, t in enumerate(tensors):
        if t.name in tied.names:
            for state, _, _ in ranges(t):
                if state == "param" or not distributed_moments:
                    out[(i, state)] = True
                elif tied.copy:
                    out[(i, state)] = False
    return out


def read_plan(tensors, policy: str, distributed_moments: bool) -> ReadPlan:
    """Collective (one small all-reduce per replica group, but with "per-rank"): this rank's
    reads and exchanges. "auto" splits the reads of groups that span nodes only."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tied = tied_exchange.negotiate(tensors, policy, distributed_moments, geometry)
    handled = tied_states(tensors, tied, distributed_moments)
    reads, needs = run_everywhere(replica_needs, tensors, policy, distributed_moments, tp, handled=handled)
    plan = ReadPlan(reads, [], [])
    if policy == "per-rank":
        return plan
    for kind in replicas.CLASSES:  # every rank, in this order: each takes part in every group
        if kind.startswith("tensor") and tp == 1:
            continue  # no tensor-parallel replicas, on any rank
        group = replicas.replica_group(kind)
        pairs = needs[kind]
        shares, ranks, why = replicas.agreed_split([n for n, _ in pairs], group, policy == "auto")
        device = group_device(group) if shares is not None else None
        take_shares(plan, pairs, shares, group, ranks, why, ranks.index(dist.get_rank()),
                    lambda i, state, start, stop: _staged(tensors, device, i, state, start, stop))
    _plan_tied(plan, tensors, tied, handled)
    return plan


def _staged(tensors, device, i, state, start, stop) -> bool:
    """Whether a share read here is broadcast from a staging copy (the model's tensor is not
    fp32 on the group's device)."""
    region = local_region(tensors[i], state, start, stop)
    return region.dtype != torch.float32 or region.device != device


def _plan_tied(plan: ReadPlan, tensors, tied: Optional[TiedPlan], handled: dict) -> None:
    """Collective over the data-parallel groups of the first and last stages, then the job:
    the tied tensors split alike on both stages; the first stage's member reads its shares and
    sends them to its partner, which broadcasts them to its own group as if it had read them.
    A split that fails anywhere (members that hold other parts) makes every rank read the tied
    exchange's ranges itself."""
    from megatron.core import parallel_state

    pairs = [(Need(tensors[i].name, state, start, stop, geometry(tensors[i])), i)
             for i, t in enumerate(tensors) for state, start, stop in ranges(t) if handled.get((i, state))]
    shares, ranks, why = None, [], None
    if tied is not None:
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        shares, ranks, why = replicas.agreed_split([n for n, _ in pairs], group)
        if len(ranks) == 1:
            shares = replicas.split_needs([n for n, _ in pairs], 1)
    if not all_true(tied is None or shares is not None):
        for i, state in handled:
            plan.reads[i] += [(s, start, stop, False) for s, start, stop in ranges(tensors[i]) if s == state]
        if why is not None:
            plan.notes.append(why)
        return
    if tied is None:
        return
    plan.tied = tied
    me, device = ranks.index(dist.get_rank()), group_device(tied.group)
    items = []
    for j, share in shares:
        n, i = pairs[j]
        key = (i, n.state, share.start, share.stop)
        items.append((key, share))
        if share.reader == me:
            plan.partner.append((key, Share(share.need, share.start, share.stop, tied.source)))
            if not tied.copy:
                plan.reads[i].append((n.state, share.start, share.stop, _staged(tensors, device, *key)))
    if len(ranks) > 1:
        plan.exchanges.append((group, ranks, items))
        tied.relay = True


def take_shares(plan: ReadPlan, pairs, shares, group, ranks, why, me: int, staged) -> None:
    """Pure: one replica group's split (replicas.agreed_split) into this rank's plan: its own
    shares as reads (`staged(i, state, start, stop)`: whether the read lands in a staging copy
    to broadcast from), every share as an item of the group's exchange; with no split (None),
    every need as this rank's own read, and `why` as a note."""
    if shares is None:
        for n, i in pairs:
            plan.reads[i].append((n.state, n.start, n.stop, False))
        if why is not None:
            plan.notes.append(why)
        return
    items = []
    for j, share in shares:
        n, i = pairs[j]
        if share.reader == me:
            plan.reads[i].append((n.state, share.start, share.stop, staged(i, n.state, share.start, share.stop)))
        items.append(((i, n.state, share.start, share.stop), share))
    plan.exchanges.append((group, ranks, items))


def read_tensors(root, m, layouts, tensors, plan: ReadPlan, counter, hash_spans: dict,
                  hashes: dict, staged: dict, source=None) -> None:
    """This rank's reads from storage, in place where it can; several files in flight where
    this node has cores to spare (tensor_io.read_threads), each thread counting its own bytes.
    The `hash_spans` of each tensor are hashed as they are read, into `hashes`; the reads an
    exchange sends from a staging copy leave it in `staged`. `source`: a reader that serves
    the atomic tensors in place of `root`'s files (piece_reads.PieceSource)."""
    read = tensor_io.read_runs if source is None else source.read_runs

    def load_one(i):
        t, mine, found = tensors[i], tensor_io.ReadCounter(), []
        entry, layout = m.tensors[t.name], layouts[t.name]
        # safe_join refuses names that escape the checkpoint
        path = safe_files.safe_join(root, entry.file) if source is None else t.name
        spans = hash_spans.get(t.name, ())
        with torch.no_grad():
            for state, start, stop, keep in plan.reads[i]:  # the reads read_spans planned the hashing of
                in_place = host_view(local_region(t, state, start, stop))
                data = read_range(path, entry, layout, t, state, start, stop, mine, in_place,
                                   spans, found, read)
                deliver(t, state, start, stop, torch.from_numpy(data))
                if keep:
                    staged[(i, state, start, stop)] = data
        return t.name, mine, found

    # Largest first, so that the threads' tails are short.
    order = sorted((i for i, reads in enumerate(plan.reads) if reads),
                   key=lambda i: -sum(stop - start for _, start, stop, _ in plan.reads[i]))
    threads = max(tensor_io.read_threads(), getattr(source, "threads", 1))  # a store's GETs wait on the network
    for name, done, found in tensor_io.in_parallel(load_one, order, threads):
        counter.bytes += done.bytes
        counter.calls += done.calls
        hashes.setdefault(name, []).extend(found)


def exchange(tensors, plan: ReadPlan, staged: dict) -> int:
    """Collective over each replica group: every share broadcast from its reader to the other
    members; first, the tied tensors' shares from the first stage to the last (tied.py).
    Returns the bytes this rank received."""
    def land(key, data):
        i, state, start, stop = key
        with torch.no_grad():
            deliver(tensors[i], state, start, stop, data)

    received = 0
    if plan.tied is not None:
        received += _exchange_tied(tensors, plan, staged, land)
    for group, ranks, items in plan.exchanges:
        received += replicas.broadcast_shares(
            group, ranks, [(key, local_region(tensors[key[0]], *key[1:]), share) for key, share in items],
            staged, land)
    return received


def _exchange_tied(tensors, plan: ReadPlan, staged: dict, land) -> int:
    """The first stage's shares of the tied tensors to their partners on the last stage, which
    keep a staging copy where their own group's broadcast needs one; then the distributed
    optimizer's moments of the copies, point to point."""
    tied = plan.tied
    relay = tied.relay

    def land_and_keep(key, data):
        land(key, data)
        if relay and _staged(tensors, group_device(tied.group), *key):
            staged[key] = data.cpu().numpy()

    items = [(key, local_region(tensors[key[0]], *key[1:]), share) for key, share in plan.partner]
    received = replicas.broadcast_shares(tied.group, tied.ranks, items, staged, land_and_keep, keep_staged=relay)
    with torch.no_grad():
        return received + tied_exchange.send_moments(tensors, tied, deliver, local_region)
