"""Agreement across ranks: a failure on any rank becomes the same error on every rank."""

from typing import Optional

import torch.distributed as dist

from megatron_ucp import errors as errors_module
from megatron_ucp.errors import UCPError


def agree(error: Optional[BaseException], group=None) -> None:
    """A barrier that also raises, on every rank, the first rank's error (if any rank failed).

    The failing rank re-raises its own exception; the others raise the same class of
    megatron-ucp error (UCPError for anything else) naming that rank, so no rank is left waiting
    in a later collective.
    """
    errors = [None] * dist.get_world_size()
    report = None if error is None else (type(error).__name__, str(error))
    dist.all_gather_object(errors, report, group=group)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if error is None:
        rank, (kind, message) = failed[0]
        cls = getattr(errors_module, kind, None)
        if not (isinstance(cls, type) and issubclass(cls, UCPError)):
            cls, message = UCPError, f"{kind}: {message}"
        error = cls(f"{message} (raised on rank {rank})")
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
