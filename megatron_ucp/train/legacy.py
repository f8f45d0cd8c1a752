"""Megatron-LM's legacy per-rank `torch` checkpoints (`--ckpt-format torch`), written and read.

The layout is Megatron-LM's `megatron/training/checkpointing.py` (legacy path):

    iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt   # DP rank 0 of each (TP, PP) rank
    iter_XXXXXXX/mp_rank_TT[_PPP]/distrib_optim.pt     # distributed optimizer only

`model_optim_rng.pt` holds `model` (or `model0`, `model1`... with virtual stages: each chunk's
TP-local state dict, local layer numbers), `optimizer` (the megatron optimizer's `state_dict()`:
the whole torch Adam state without the distributed optimizer, only its param groups and step
with it), `opt_param_scheduler`, `iteration`, `checkpoint_version` 3.0, `rng_state` (one entry
per data-parallel rank) and `args`. `distrib_optim.pt` is megatron-core's own
`save_parameter_state` output: per model-chunk buffer and dtype, the flat fp32 `param`,
`exp_avg`, `exp_avg_sq` gathered over data parallelism.

Such a checkpoint resumes only on the layout that wrote it (same TP, PP and DP); the converter
(`megatron_ucp/convert/legacy.py`) turns it into a universal one.
"""

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ucp.convert import safe_pickle
from megatron_ucp.convert.legacy_files import MODEL_FILE, OPTIM_FILE, rank_dir_name
from megatron_ucp.errors import FormatError, IncompleteCheckpointError
from megatron_ucp.mcore import rng
from megatron_ucp.mcore.model_map import unwrap
from megatron_ucp.mcore.optimizer_state import uses_distributed_optimizer

CHECKPOINT_VERSION = 3.0


def _model_key(n_chunks: int, i: int) -> str:
    return "model" if n_chunks == 1 else f"model{i}"


def plain_args(args) -> dict:
    """The arguments as plain values, so that the file loads with weights_only=True."""
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}


def _my_dir(directory: str) -> str:
    ps = parallel_state
    return os.path.join(directory, rank_dir_name(ps.get_tensor_model_parallel_rank(),
                                                 ps.get_pipeline_model_parallel_rank(),
                                                 ps.get_pipeline_model_parallel_world_size()))


def save(args, state, iteration: int, consumed: int, directory: str) -> None:
    """Collective: DP rank 0 of each (TP, PP) rank writes its folder, as Megatron-LM does."""
    dp_group = parallel_state.get_data_parallel_group()
    dp_rank = parallel_state.get_data_parallel_rank()
    rng_states = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(rng_states, rng.capture(), group=dp_group)
    rank_dir = _my_dir(directory)
    if dp_rank == 0:
        os.makedirs(rank_dir, exist_ok=True)
    dist.barrier()
    if uses_distributed_optimizer(state.optimizer):  # megatron-core's own writer (gathers over DP: collective)
        state.optimizer.save_parameter_state(os.path.join(rank_dir, OPTIM_FILE))
    if dp_rank == 0:
        sd = {_model_key(len(state.model), i): unwrap(c).state_dict() for i, c in enumerate(state.model)}
        sd["optimizer"] = state.optimizer.state_dict()
        sd["opt_param_scheduler"] = state.scheduler.state_dict()
        sd["iteration"] = iteration
        sd["checkpoint_version"] = CHECKPOINT_VERSION
        sd["rng_state"] = rng_states
        stored = plain_args(args)
        stored["consumed_train_samples"] = consumed  # where Megatron-LM keeps it
        stored["iteration"] = iteration
        sd["args"] = stored
        path = os.path.join(rank_dir, MODEL_FILE)
        torch.save(sd, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def load(args, state, directory: str):
    """Restore this rank's part (same layout only); returns (iteration, consumed_samples)."""
    rank_dir = _my_dir(directory)
    path = os.path.join(rank_dir, MODEL_FILE)
    if not os.path.lexists(path):
        raise IncompleteCheckpointError(
            f"{path}: missing; a legacy torch checkpoint resumes only on the layout that wrote it "
            "(convert it with `megatron-ucp convert` to change layout)")
    sd = safe_pickle.load_file(path, "legacy checkpoint file", root=directory, tensor_data_on_disk=True)
    for i, chunk in enumerate(state.model):
        key = _model_key(len(state.model), i)
        if key not in sd:
            raise FormatError(f"{path}: no {key!r} (has {sorted(k for k in sd if k.startswith('model'))}); "
                              "was it saved with another virtual pipeline layout?")
        unwrap(chunk).load_state_dict(sd[key], strict=not args.no_strict_load)
    if not args.no_load_optim:
        state.optimizer.load_state_dict(sd["optimizer"])
        if uses_distributed_optimizer(state.optimizer):
            optim_path = os.path.join(rank_dir, OPTIM_FILE)
            if not os.path.lexists(optim_path):
                raise IncompleteCheckpointError(f"{optim_path}: missing (saved without the distributed optimizer?)")
            # megatron's loader torch.loads it: vetted first (a regular file; allowed classes only)
            safe_pickle.check_torch_file(optim_path, "legacy optimizer file", root=directory, tensor_data_on_disk=True)
            state.optimizer.load_parameter_state(optim_path)
        if not args.no_load_scheduler:
            state.scheduler.load_state_dict(sd["opt_param_scheduler"])
    if not args.no_load_rng:
        states = sd["rng_state"]
        dp_rank = parallel_state.get_data_parallel_rank()
        if len(states) != parallel_state.get_data_parallel_world_size():
            raise FormatError(f"{path}: RNG states of {len(states)} data-parallel ranks, this job has "
                              f"{parallel_state.get_data_parallel_world_size()} (pass --no-load-rng)")
        rng.restore(rng.checked(states[dp_rank], f"{path} (rng_state[{dp_rank}])"))
    stored = sd.get("args") or {}
    return int(sd["iteration"]), int(stored.get("consumed_train_samples", 0))
