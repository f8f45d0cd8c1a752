"""Context parallelism's sequence layout, for attention computed outside transformer-engine.

megatron splits a sequence into 2 x CP equal chunks and gives CP rank r chunks r and
2CP-1-r (load balance for causal attention: `get_batch_on_this_cp_rank`, megatron-core 0.19.2
core/utils.py:2456; rotary embeddings alike, rope_utils.py:62). A rank's queries attend to every
rank's keys: these pure functions say where each gathered key sits in the whole sequence.
"""

import torch


def chunks_of_rank(cp_size: int, cp_rank: int) -> tuple:
    """The two sequence chunks CP rank `cp_rank` holds, in the order it holds them."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context-parallel rank {cp_rank} outside a group of {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def positions_of_rank(cp_size: int, cp_rank: int, local_length: int) -> list:
    """Global sequence positions of a rank's `local_length` tokens (two chunks of half each)."""
    if local_length % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks, not {local_length} tokens")
    chunk = local_length // 2
    return [c * chunk + i for c in chunks_of_rank(cp_size, cp_rank) for i in range(chunk)]


def global_order(cp_size: int, local_length: int) -> list:
    """For each position of the whole sequence, its index in the rank-ordered gather of every
    rank's tokens (rank 0's, then rank 1's, ...)."""
    gathered = [p for r in range(cp_size) for p in positions_of_rank(cp_size, r, local_length)]
    index = [0] * len(gathered)
    for i, position in enumerate(gathered):
        index[position] = i
    return index


class GatherSequence(torch.autograd.Function):
    """All-gather [s, ...] over the context-parallel group into the whole sequence in order.

    Backward: every rank's queries took grads through every rank's keys, so the grad of this
    rank's tokens is the sum over ranks (an all-reduce: gloo has no reduce-scatter), sliced.
    """

    @staticmethod
    def forward(ctx, local, group):
        import torch.distributed as dist

        size, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        order = torch.tensor(global_order(size, local.shape[0]), device=local.device)
        ctx.group, ctx.order = group, order
        ctx.mine = torch.tensor(positions_of_rank(size, rank, local.shape[0]), device=local.device)
        return torch.cat(parts).index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.index_select(0, ctx.mine), None
