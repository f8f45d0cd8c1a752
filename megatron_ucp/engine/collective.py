"""Agreement across ranks: a failure on any rank becomes the same error on every rank."""

import contextlib
import gc
from typing import Optional

import torch
import torch.distributed as dist

from megatron_ucp import errors as errors_module
from megatron_ucp.errors import UCPError


def group_device(group=None) -> torch.device:
    """Where a collective over `group` (None: the default group) takes its tensors: the CPU for
    gloo, else the current accelerator (NCCL and its kin exchange through device memory)."""
    backend = str(dist.get_backend(group)).lower()
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if backend == "gloo" or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def agree(error: Optional[BaseException], group=None) -> None:
    """A barrier that also raises, on every rank, the first rank's error (if any rank failed).

    The failing rank re-raises its own exception; the others raise the same class of
    megatron-ucp error (UCPError for anything else) naming that rank (its rank in `group`), so
    no rank is left waiting in a later collective.

    Bytes per rank: one int64 all-reduced (the lowest failing rank, or the group's size when
    none failed), whatever the group's size; only when a rank failed does the first of them
    broadcast its (error class, message), pickled (one int64 length, then its bytes).
    """
    device = group_device(group)
    me, size = dist.get_rank(group), dist.get_world_size(group)
    first = torch.tensor([size if error is None else me], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    first = int(first.item())
    if first == size:
        return
    report = [(type(error).__name__, str(error)) if me == first else None]
    src = first if group is None else dist.get_global_rank(group, first)  # broadcast's src is global
    dist.broadcast_object_list(report, src=src, group=group, device=device)
    if error is None:
        kind, message = report[0]
        cls = getattr(errors_module, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, UCPError)):
            cls, message = UCPError, f"{kind}: {message}"
        error = cls(f"{message} (raised on rank {first})")
    error.agreed = True  # raised on every rank: entry points print it once (errors.report)
    raise error


def run_everywhere(fn, *args, group=None, **kwargs):
    """Run `fn` on this rank, then `agree` (over `group`) on the outcome; returns fn's result."""
    error, result = None, None
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # reported to every rank by agree()
        error = e
    agree(error, group)
    return result


def on_rank_zero(fn, *args, group=None, **kwargs):
    """Run `fn` on rank 0 only (e.g. one read of a file every rank needs), agree on the outcome,
    and return rank 0's result on every rank."""
    rank0 = dist.get_rank() == 0  # broadcast's src is a global rank
    result = [run_everywhere(lambda: fn(*args, **kwargs) if rank0 else None, group=group)]
    dist.broadcast_object_list(result, src=0, group=group)
    return result[0]


def exchange_objects(payloads: dict, group=None, device=None) -> dict:
    """All-to-all of picklable objects: payloads[dest] goes to rank `dest` of `group`; returns
    {source: object} for the ranks that sent this rank something. Unlike all_gather_object, a
    rank receives only what is addressed to it (plus one length per rank), so the bytes follow
    the rank's share, not the world's. `device`: where the group's collectives take tensors
    (group_device by default)."""
    import pickle

    device = device if device is not None else group_device(group)
    world = dist.get_world_size(group)
    blobs = [pickle.dumps(payloads[d], protocol=pickle.HIGHEST_PROTOCOL) if d in payloads else b""
             for d in range(world)]
    send_sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64, device=device)
    recv_sizes = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    recv_sizes = recv_sizes.cpu().tolist()
    data = b"".join(blobs)
    send = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(recv, send.to(device), recv_sizes, [len(b) for b in blobs], group=group)
    raw, out, at = recv.cpu().numpy().tobytes(), {}, 0
    for source, n in enumerate(recv_sizes):
        if n:
            out[source] = pickle.loads(raw[at:at + n])
        at += n
    return out


def all_true(flag: bool, group=None, device=None) -> bool:
    """Whether `flag` holds on every rank: one integer reduced, whatever the world's size."""
    device = device if device is not None else group_device(group)
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


@contextlib.contextmanager
def groups_of_this_scope():
    """Destroy, on leaving, the process groups created inside (megatron's parallel state).

    megatron's destroy_model_parallel() (megatron-core 0.16.1 parallel_state.py:2085, 0.19.2
    :2506) sets its groups to None and destroys only its gloo data-parallel ones; torch keeps
    every other one, with its gloo threads and connections, until the process ends. A process
    that builds one layout after another (sessions in a row, a test runner) then drags every
    earlier layout's groups along: measured on CPU, a run's steps were 2.2x slower after 24
    earlier layouts. Destroying a subgroup is local to the rank (no collective); the default
    group stays.
    """
    if not dist.is_initialized():
        yield
        return
    before = set(_registered_groups())
    try:
        yield
    finally:
        for group in _registered_groups():
            if group not in before and group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
        # A group's threads end with the group object, which the model's modules refer to in
        # cycles: collected now, not at some later collection (their threads piled up: 48 more
        # per 2-rank session).
        gc.collect()


def _registered_groups() -> list:
    """Every process group torch holds (torch has no public list of them)."""
    return list(dist.distributed_c10d._world.pg_map)


def is_registered(group) -> bool:
    """Whether `group` is still usable (not destroyed), e.g. one a module kept across sessions."""
    return group in _registered_groups()


def close_distributed() -> None:
    """Destroy the process groups before the interpreter exits.

    Left to interpreter finalization, gloo's worker threads may still hold finished work whose
    tensors reference Python objects; freeing them then aborts the process ("terminate called
    without an active exception", SIGABRT; pytorch/pytorch#190489), which turns a clean exit,
    or the exit status 2 of a one-line error, into a crash that torchrun reports. Call it where
    every rank takes the same path (the job's end, an error all ranks agreed on): it waits for
    the group's pending work.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
