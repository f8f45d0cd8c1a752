"""Read-once for the tied output layer: the last pipeline stage's copy of the word embeddings
comes from the first stage over the network, not a second time from storage.

With `share_embeddings_and_output_weights` and pipeline parallelism, megatron keeps the output
layer's weight on the last stage as a copy of the first stage's word embeddings (its
sharded_state_dict marks it a replica, replica_id[0] = 1; model_map: `writes` False), kept
equal by an all-reduce of their gradients over megatron's embedding group. Read by both
stages, it would cost a second read of what is often the largest tensor of the model.

Instead the two stages split the tensor's weights (and, without the distributed optimizer, its
moments) over their data-parallel groups the same way, in a replica class of their own (the
other tensors of the two stages differ, and so would a common split): member i of the first
stage's group reads share i from storage and sends it to its partner on the last stage (member
i there, the other rank of its embedding group), before each group broadcasts its shares as
usual. Under the distributed optimizer each member holds only its own fragment of the moments,
cut differently on the two stages (their gradient buckets differ): the first stage's members
read theirs, and send each fragment of the last stage the parts that overlap it, point to
point (`moment_transfers`).
"""

import bisect
import socket
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_ucp.engine.collective import all_true, group_device, run_everywhere
from megatron_ucp.engine.replicas import all_equal
from megatron_ucp.errors import LayoutError

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Held:
    """What a rank of an embedding group holds of one tensor: its geometry (`what`, as
    reads.replica_needs describes it), whether it writes it (False: a tied copy), and the
    local elements [start, stop) of its moments under the distributed optimizer (None
    without it, or without optimizer state)."""

    what: str
    writes: bool
    fragment: Optional[Tuple[int, int]]


@dataclass(frozen=True)
class Member:
    """One rank of an embedding group, as it tells the other: its global rank, its place in its
    data-parallel group, and what it holds of each of its tensors."""

    rank: int
    dp_index: int
    dp_size: int
    held: Dict[str, Held]


def tied_names(members: List[Member]) -> Tuple[List[str], Optional[str]]:
    """Pure: the tensors one member of a two-rank embedding group copies from the other (sorted),
    and why the pair cannot exchange them (None when it can): the writer must hold each with the
    same geometry, and both must sit at the same place of data-parallel groups of one size."""
    if len(members) != 2:
        return [], None
    a, b = members
    copies = sorted(n for m in members for n, h in m.held.items() if not h.writes)
    for name in copies:
        ha, hb = a.held.get(name), b.held.get(name)
        if ha is None or hb is None or ha.writes == hb.writes:
            return [], f"tied tensor {name!r}: ranks {a.rank} and {b.rank} do not hold it as writer and copy"
        if ha.what != hb.what:
            return [], f"tied tensor {name!r}: ranks {a.rank} and {b.rank} hold other parts of it"
    if copies and (a.dp_index, a.dp_size) != (b.dp_index, b.dp_size):
        return [], (f"ranks {a.rank} and {b.rank} are members {a.dp_index} and {b.dp_index} of "
                    f"data-parallel groups of {a.dp_size} and {b.dp_size}")
    return copies, None


def moment_transfers(sources: List[Tuple[int, int, int]], sinks: List[Tuple[int, int, int]]
                     ) -> List[Tuple[int, int, int, int]]:
    """Pure: (source rank, sink rank, start, stop) of every overlap of a source's elements with
    a sink's, in element order: sources (rank, start, stop) tile what the sinks need, each
    sink receives each of its elements once. Raises if a sink's element has no source.
    O((sources + sinks) log sources): a job's data-parallel groups may have thousands of members."""
    held = sorted((s for s in sources if s[1] < s[2]), key=lambda s: s[1])
    ends = [b for _, _, b in held]
    out = []
    for dst, lo, hi in sorted(sinks, key=lambda s: (s[1], s[0])):
        covered, k = lo, bisect.bisect_right(ends, lo)
        while covered < hi and k < len(held) and held[k][1] <= covered:
            src, _, b = held[k]
            stop = min(b, hi)
            out.append((src, dst, covered, stop))
            covered, k = stop, k + 1
        if covered < hi:
            raise LayoutError(f"tied tensor moments: elements [{covered}, {hi}) of rank {dst} held by no "
                              "rank of the first stage")
    return sorted(out, key=lambda t: (t[2], t[1]))


@dataclass
class TiedPlan:
    """This rank's part in the tied exchange."""

    names: List[str]  # the tied tensors (atomic names)
    copy: bool  # this rank holds the copies (the last stage), else the written tensors
    group: object  # the embedding group
    ranks: List[int]  # its global ranks
    source: int  # index of the writer in `ranks`
    # (peer rank, send, tensor index, state, start, stop) of the moments under the distributed
    # optimizer, in the order both ends post them
    transfers: list = field(default_factory=list)
    relay: bool = False  # the last stage's members broadcast what they received to their group


def _held(tensors, what) -> Dict[str, Held]:
    out = {}
    for t in tensors:
        f = t.fragment
        out[t.name] = Held(what(t), bool(t.writes), (f.start, f.stop) if f is not None else None)
    return out


def negotiate(tensors, policy: str, distributed_moments: bool, what) -> Optional[TiedPlan]:
    """Collective over the job: this rank's tied plan, or None (also on the ranks of no
    embedding group, and where no tensor is tied). A pair that cannot exchange makes the whole
    job read its copies from storage, as the policy "per-rank" does, and says why. Under
    "auto" only a job that spans nodes exchanges (one node's page cache serves the second
    read). `what(t)`: a tensor's geometry, as the replica groups compare it."""
    from megatron.core import parallel_state

    plan, why, members = None, None, []
    group = parallel_state.get_embedding_group(check_initialized=False)
    if policy != "per-rank" and group is not None and parallel_state.is_rank_in_embedding_group():
        ranks = dist.get_process_group_ranks(group)
        dp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        dp_ranks = dist.get_process_group_ranks(dp)
        me = Member(dist.get_rank(), dp_ranks.index(dist.get_rank()), len(dp_ranks), _held(tensors, what))
        members = [None] * len(ranks)
        dist.all_gather_object(members, me, group=group)
        names, why = tied_names(members)
        if names:
            source = next(k for k, m in enumerate(members) if m.held[names[0]].writes)
            plan = TiedPlan(names, source != ranks.index(me.rank), group, ranks, source)
    use = all_true(why is None)
    if use and policy == "auto":
        use = not all_equal([socket.gethostname()], None)[0]
    if not use:
        if why is not None and dist.get_rank() == min(m.rank for m in members):
            print(f" warning: read-once load: {why}: the tied copies are read from storage", flush=True)
        return None
    pairs = None
    if plan is not None and distributed_moments:  # every pair of the two stages' groups' fragments
        writer, copy = members[plan.source], members[1 - plan.source]
        mine = tuple((m.rank, {n: m.held[n].fragment or (0, 0) for n in plan.names}) for m in (writer, copy))
        pairs = [None] * dist.get_world_size(dp)
        dist.all_gather_object(pairs, mine, group=dp)
    transfers = run_everywhere(lambda: plan_transfers(plan.names, pairs, tensors, dist.get_rank()) if pairs else [])
    if plan is not None:
        plan.transfers = transfers
    return plan


def plan_transfers(names: List[str], pairs, tensors, me: int) -> list:
    """Pure: this rank's sends and receives of the moments of the tied tensors `names`, in the
    order both ends post them, from every pair's ((writer rank, {name: fragment}), (copy rank,
    {name: fragment})) of the two stages' data-parallel groups."""
    index = {t.name: i for i, t in enumerate(tensors)}
    out = []
    for name in names:
        sources = [(w[0], *w[1][name]) for w, _ in pairs]
        sinks = [(c[0], *c[1][name]) for _, c in pairs]
        for src, dst, start, stop in moment_transfers(sources, sinks):
            if me in (src, dst):
                for state in MOMENTS:
                    out.append((dst if me == src else src, me == src, index[name], state, start, stop))
    return out


def send_moments(tensors, plan: TiedPlan, deliver, local_region) -> int:
    """Point to point, over the default group: the moments of the tied tensors from the first
    stage's fragments to the last stage's. Returns the bytes this rank received."""
    device = group_device()
    works, landing, received = [], [], 0
    for peer, send, i, state, start, stop in plan.transfers:
        region = local_region(tensors[i], state, start, stop)
        if send:
            works.append(dist.isend(region.detach().to(device, torch.float32).contiguous(), peer))
            continue
        direct = region.dtype == torch.float32 and region.device == device and region.is_contiguous()
        buf = region if direct else torch.empty(stop - start, dtype=torch.float32, device=device)
        works.append(dist.irecv(buf, peer))  # straight into the optimizer's moments where it can
        if not direct:
            landing.append((i, state, start, stop, buf))
        received += buf.numel() * 4
    for w in works:
        w.wait()
    for i, state, start, stop, buf in landing:
        deliver(tensors[i], state, start, stop, buf)
    return received
