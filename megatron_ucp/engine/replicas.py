"""Read-once loads over megatron's replica groups: which group replicates a tensor, whether its
members agree on what they need, and the exchange of what each read (read_plan.py plans it).

Dense parameters are replicated over the data-parallel group (with context parallelism, data x
context), expert parameters over the expert data-parallel group: the groups megatron's own DDP
and distributed optimizer use for them; dense parameters that every tensor-parallel rank holds
whole (norms, row-parallel biases) over the tensor-and-data-parallel group. The members' needs
are compared by fingerprint, one all-reduce of a few integers per group, rather than gathered.
The exchange broadcasts each share from its reader over the group, on the group's device (the
CPU for gloo, the accelerator for NCCL), straight into the model's tensor where it is fp32 on
that device, else through a staging buffer.
"""

import hashlib
import socket
from collections import deque
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_ucp.engine.collective import group_device
from megatron_ucp.engine.read_plan import Need, Share, digest, disagreement, order, split

# Bytes of staging buffers in flight at once during an exchange (where the model's tensor
# cannot receive the broadcast itself: bf16 parameters, host tensors with an NCCL group).
STAGING_BYTES = 256 * 2**20


# A share of at most SMALL_BYTES (a norm, a bias, their moments) travels in one broadcast with
# the other small shares of its reader, up to BATCH_BYTES: a model has a few of them per layer,
# and one collective each cost 0.3 ms here over gloo (155 of them: 0.05 s of a 1 s restart).
SMALL_BYTES = 2**16
BATCH_BYTES = 4 * 2**20


# The replica classes, in the order every rank takes part in their groups' exchanges.
CLASSES = ("data", "tensor+data", "tensor", "expert")


def replica_group(kind: str):
    """The process group over which bytes of replica class `kind` (reads.replica_class) are
    replicated: the groups megatron's DDP and distributed optimizer use (data parallel, with
    context parallel; expert data parallel), and for dense tensors that every TP rank holds
    whole, data x tensor parallel (their moments under the distributed optimizer: tensor
    parallel)."""
    from megatron.core import parallel_state

    if kind == "expert":
        return parallel_state.get_expert_data_parallel_group()
    if kind == "tensor+data":
        return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    if kind == "tensor":
        return parallel_state.get_tensor_model_parallel_group()
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def agreed_split(needs: List[Need], group, across_nodes_only: bool = False
                 ) -> Tuple[Optional[List[Tuple[int, Share]]], List[int], Optional[str]]:
    """Collective over `group`: (shares in agreed order as (index into `needs`, share), the
    group's global ranks, None) when every member needs the same bytes; (None, ranks, why)
    when they do not, and each must read its own. A group of one splits nothing, nor, with
    `across_nodes_only`, a group whose members all run on one node (one page cache).

    The members compare fingerprints of their needs and host names with one all-reduce of
    eight integers (64 bytes a rank, whatever the group's size); only when they differ are the
    digests gathered, to name the members that differ."""
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return None, ranks, None
    agreed = order(needs)
    mine = digest([needs[i] for i in agreed])
    same_needs, one_node = all_equal([mine, socket.gethostname()], group)
    if not same_needs:
        found = [None] * len(ranks)
        dist.all_gather_object(found, mine, group=group)
        why = disagreement(found, ranks)
        if why is not None:
            return None, ranks, why
    if across_nodes_only and one_node:
        return None, ranks, None
    return split_needs(needs, len(ranks), agreed), ranks, None


def fingerprints(texts: List[str]) -> List[int]:
    """Pure: two non-negative 62-bit integers (negatable in int64) from each of `texts`."""
    out = []
    for text in texts:
        raw = hashlib.blake2b(text.encode(), digest_size=16).digest()
        out += [int.from_bytes(raw[:8], "little") >> 2, int.from_bytes(raw[8:], "little") >> 2]
    return out


AGREEMENT_BYTES = 2 * 8 * 2 * 2  # what all_equal all-reduces of two texts: fingerprints, negated


def all_equal(texts: List[str], group) -> List[bool]:
    """Collective over `group`: for each of `texts`, whether every member passed the same
    one (by 124-bit fingerprint): one all-reduce (max) of the fingerprints and their negations."""
    values = fingerprints(texts)
    t = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=group_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    top, bottom = t[:len(values)].tolist(), [-v for v in t[len(values):].tolist()]
    return [top[2 * k:2 * k + 2] == bottom[2 * k:2 * k + 2] for k in range(len(texts))]


def split_needs(needs: List[Need], members: int, agreed: Optional[List[int]] = None) -> List[Tuple[int, Share]]:
    """Pure: `needs` laid in the agreed order (read_plan.order, unless given) and cut into one
    run per member (read_plan.split), as (index into `needs`, share)."""
    agreed = order(needs) if agreed is None else agreed
    return [(agreed[s.need], s) for s in split([needs[i] for i in agreed], members)]


def batches(sizes: List[int], readers: List[int], small: int = SMALL_BYTES, limit: int = BATCH_BYTES
            ) -> List[List[int]]:
    """Pure: the items (indices into `sizes` and `readers`, in order) broadcast together: a
    share of more than `small` bytes alone, the small ones of each reader packed in order into
    batches of at most `limit` bytes; batches in the order of their first item. Every member
    computes the same from the agreed shares."""
    out, open_batch = [], {}
    for k, (n, reader) in enumerate(zip(sizes, readers)):
        if n > small:
            out.append([k])
            continue
        batch = open_batch.get(reader)
        if batch is None or batch[1] + n > limit:
            batch = open_batch[reader] = [[], 0]
            out.append(batch[0])
        batch[0].append(k)
        batch[1] += n
    return out


def broadcast_shares(group, ranks: List[int], items, staged: dict, deliver, keep_staged: bool = False) -> int:
    """Collective over `group`: each item (key, region, share) is broadcast from its reader,
    the small ones of a reader together (`batches`).

    `region` is the fp32-valued destination of the share in the model's tensor (1-D); the
    reader has already filled it, and `staged[key]` holds the reader's fp32 host copy where
    the region cannot take part in the collective itself (not fp32, or not on the group's
    device). `deliver(key, data)` hands a received share to the model (called on the
    receivers, in item order); `keep_staged` leaves the reader's copies in `staged` for a later
    broadcast. Returns the bytes this rank received."""
    device = group_device(group)
    me = ranks.index(dist.get_rank())
    pending: deque = deque()
    in_flight = received = 0

    def direct(region) -> bool:
        return region.dtype == torch.float32 and region.device == device

    def held(key, region) -> torch.Tensor:  # the reader's fp32 values of a share, on the group's device
        if direct(region):
            return region
        return torch.from_numpy(staged[key] if keep_staged else staged.pop(key)).to(device)

    def finish():
        nonlocal in_flight
        work, batch, buf, staged_bytes, mine = pending.popleft()
        work.wait()
        in_flight -= staged_bytes
        if mine:
            return
        if len(batch) == 1:
            deliver(batch[0][0], buf)
            return
        pos = 0
        for key, region, _ in batch:
            data = buf[pos:pos + region.numel()]
            pos += region.numel()
            if direct(region):
                region.copy_(data)
                data = region
            deliver(key, data)

    for batch in batches([4 * region.numel() for _, region, _ in items], [share.reader for _, _, share in items]):
        batch = [items[k] for k in batch]
        mine = batch[0][2].reader == me
        if len(batch) > 1:  # packed: staged like a share the model's tensor cannot receive
            buf = (torch.cat([held(key, region) for key, region, _ in batch]) if mine else
                   torch.empty(sum(region.numel() for _, region, _ in batch), dtype=torch.float32, device=device))
        else:
            key, region, _ = batch[0]
            buf = held(key, region) if mine or direct(region) else torch.empty(
                region.numel(), dtype=torch.float32, device=device)
        work = dist.broadcast(buf, src=ranks[batch[0][2].reader], group=group, async_op=True)
        staged_bytes = 0 if len(batch) == 1 and direct(batch[0][1]) else buf.numel() * 4
        pending.append((work, batch, buf, staged_bytes, mine))
        in_flight += staged_bytes
        received += 0 if mine else buf.numel() * 4
        while in_flight > STAGING_BYTES and pending:
            finish()
    while pending:
        finish()
    return received
