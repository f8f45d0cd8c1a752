"""torch FSDP2's parameters (megatron's TorchFullyShardedDataParallel): `DTensor`s sharded on
dim 0 over data x context parallelism. megatron's `sharded_state_dict()` describes their local
shards (`make_sharded_tensor_for_checkpoint`, core/utils.py:1014-1029 in 0.19.2: the
`_local_tensor`, offset along dim 0 by the data-parallel rank), and the optimizer keeps `DTensor`
moments of the same placement: the mapping follows both to the local shard. Its optimizer
state is ours to map: megatron's `optimizer.sharded_state_dict()` fails on them ("Param id 0
does not match any model sharded param")."""

import torch


def local_shard(t):
    """The local tensor of a DTensor (the very object megatron's ShardedTensor holds), else `t`."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) and local is not t else t


def unevenly_sharded(named_params) -> list:
    """Names of DTensor parameters whose dim 0 does not divide over their mesh: FSDP2 pads
    those shards, and megatron describes every shard as 1/size of dim 0 (core/utils.py:1026),
    a geometry that is then not the parameter's."""
    out = []
    for name, p in named_params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and local_shard(p) is not p and p.shape[0] % mesh.size():
            out.append(f"{name} {tuple(p.shape)} over {mesh.size()}")
    return out
