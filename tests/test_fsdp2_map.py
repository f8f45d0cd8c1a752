"""torch FSDP2's DTensor parameters in the mapping (mcore/fsdp2.py): the local shard is what
megatron describes, and shards FSDP2 pads (dim 0 not dividing over the mesh) are refused,
since megatron describes every shard as an even part."""

import types

import torch

from megatron_ucp.mcore.fsdp2 import local_shard, unevenly_sharded


def _dtensor_like(shape, mesh_size):
    """The two attributes of a DTensor the mapping reads: its local tensor and its mesh."""
    local = torch.zeros((-(-shape[0] // mesh_size),) + tuple(shape[1:]))
    p = types.SimpleNamespace(_local_tensor=local, device_mesh=types.SimpleNamespace(size=lambda: mesh_size),
                              shape=torch.Size(shape))
    return p, local


def test_local_shard_is_the_dtensors_local_tensor_and_a_plain_tensor_itself():
    p, local = _dtensor_like((8, 4), 2)
    assert local_shard(p) is local
    t = torch.zeros(3)
    assert local_shard(t) is t


def test_only_padded_shards_are_named():
    even, _ = _dtensor_like((8, 4), 2)
    odd, _ = _dtensor_like((9, 4), 2)
    names = unevenly_sharded([("even", even), ("odd", odd), ("plain", torch.nn.Parameter(torch.zeros(9)))])
    assert names == ["odd (9, 4) over 2"]
