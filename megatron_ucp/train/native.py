"""Megatron-core's own `torch_dist` checkpoints, written and read as Megatron-LM does.

Kept so that users can compare against (and convert from) the format they already have. Such a
checkpoint resumes only on layouts that megatron-core itself can reshard to.
"""

import os

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_ucp.convert import safe_pickle
from megatron_ucp.errors import IncompleteCheckpointError
from megatron_ucp.format import safe_files
from megatron_ucp.mcore import rng
from megatron_ucp.mcore.model_map import unwrap


def _model_key(model, i: int) -> str:
    """Megatron-LM's names: 'model', or 'model0', 'model1'... with virtual pipeline stages."""
    return "model" if len(model) == 1 else f"model{i}"


def _model_sharded_state_dict(model):
    return {_model_key(model, i): unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def _content_metadata(args, optim_format=None) -> dict:
    """What Megatron-LM records of a checkpoint's content (`content_metadata` in common.pt): how
    the distributed optimizer's state is sharded, so that a load need not be told."""
    return {"distrib_optim_sharding_type": optim_format or args.dist_ckpt_optim_format}


def _sharded_state_dict(args, state, iteration, consumed, is_loading, optimizer=True, metadata=None):
    """What megatron saves or loads. Without `optimizer`, the optimizer is not asked at all: asked
    for a loading state dict, megatron's optimizers create Adam's moments (and no 'step'), which
    the first step after a --no-load-optim load then trips over."""
    sd = _model_sharded_state_dict(state.model)
    model_sd = {}
    for value in sd.values():
        model_sd.update(value)
    metadata = metadata or _content_metadata(args)
    if optimizer:
        sd["optimizer"] = state.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                             metadata=metadata)
    sd["opt_param_scheduler"] = state.scheduler.state_dict()
    sd["iteration"] = iteration
    sd["consumed_samples"] = consumed
    world, rank = dist.get_world_size(), dist.get_rank()
    sd["rng_state"] = ShardedObject("rng_state", rng.capture(), (world,), (rank,), replica_id=0)
    sd["checkpoint_version"] = 3.0
    # The arguments, as plain values (common.pt loads with weights_only): what a converter needs.
    sd["args"] = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}
    return sd


def save(args, state, iteration, consumed, directory: str) -> None:
    sd = _sharded_state_dict(args, state, iteration, consumed, is_loading=False)
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, directory, content_metadata=_content_metadata(args))


MAX_CONFIG_BYTES = 2**20  # metadata.json: a few keys


def check_folder(directory: str) -> None:
    """Before megatron reads a torch_dist folder: every file in it a regular file inside it (no
    FIFO, device or symlink out), `metadata.json` small, `common.pt` naming only allowed classes
    (megatron's loader reads these two itself)."""
    for entry in sorted(os.listdir(directory)):
        path = os.path.join(directory, entry)
        known = entry in (".metadata", "common.pt", "metadata.json") or entry.endswith(".distcp")
        if known or os.path.islink(path) or not os.path.isdir(path):
            os.close(safe_files.open_regular(path, "torch_dist checkpoint file", directory))
    config = os.path.join(directory, "metadata.json")
    if os.path.lexists(config):
        safe_files.read_bounded(config, "torch_dist config", MAX_CONFIG_BYTES, directory)
    common = os.path.join(directory, "common.pt")
    if os.path.lexists(common):
        safe_pickle.check_torch_file(common, "torch_dist common state", directory)


def load(args, state, directory: str):
    """Restore model, optimizer, scheduler and RNG; return (iteration, consumed_samples)."""
    if not os.path.isdir(directory):
        raise IncompleteCheckpointError(f"{directory}: no torch_dist checkpoint folder")
    check_folder(directory)
    with safe_pickle.megatron_reader():  # DCP metadata and objects unpickled restrictedly
        # The sharding the checkpoint was saved with (checkpoints without the record: the flag's).
        saved = dist_checkpointing.load_content_metadata(directory) or {}
        metadata = _content_metadata(args, saved.get("distrib_optim_sharding_type"))
        sd = _sharded_state_dict(args, state, 0, 0, is_loading=True, optimizer=not args.no_load_optim,
                                 metadata=metadata)
        if args.no_load_rng:
            sd.pop("rng_state")
        loaded = dist_checkpointing.load(sd, directory)
    for i, chunk in enumerate(state.model):
        unwrap(chunk).load_state_dict(loaded[_model_key(state.model, i)])
    if not args.no_load_optim:
        state.optimizer.load_state_dict(loaded["optimizer"])
        if not args.no_load_scheduler:
            state.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if not args.no_load_rng:
        rng.restore(rng.checked(loaded["rng_state"], f"{directory} (rng_state)"))
    return int(loaded["iteration"]), int(loaded["consumed_samples"])
