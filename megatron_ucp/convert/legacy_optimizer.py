"""Where each parameter's optimizer state lies in a legacy checkpoint, and Adam's step and
parameter groups.

megatron keeps the places implicit; they are derived here, each checked against the files:
- plain optimizer: `optimizer` is torch Adam's state dict, keyed by index. megatron numbers the
  parameters by group (weight decay, then none for biases and 1-D tensors), each in model order
  over the chunks (`optimizer_indices`, checked against every group's size and every moment's
  shape);
- distributed optimizer: offsets in `distrib_optim.pt`'s flat buffers (`buffer_places`: the
  buffer layout of buffer_layout.py, checked against every buffer's stored `numel_unpadded`).
"""

import fnmatch
import math
import os

from megatron_ucp.convert.buffer_layout import buffer_offsets, shared_embedding
from megatron_ucp.convert.legacy_files import OPTIM_FILE, torch_load
from megatron_ucp.errors import FormatError
from megatron_ucp.mcore.optimizer_state import plain_groups, saved_steps


def no_weight_decay(name: str, shape) -> bool:
    """megatron-core's standard override: biases and 1-D parameters get wd_mult 0."""
    return len(shape) == 1 or fnmatch.fnmatch(name, "*.bias")


def optimizer_indices(sd, path, chunk_params, dist_opt) -> dict:
    """(chunk, local name) -> index of its state in the torch optimizer (plain optimizer)."""
    if dist_opt:
        return {}
    opt = sd.get("optimizer")
    if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt:
        kind = "a chained optimizer's list" if isinstance(opt, list) else (
            "fp32_from_fp16_params (bf16)" if isinstance(opt, dict) and "fp32_from_fp16_params" in opt else
            type(opt).__name__)
        raise FormatError(f"{path}: 'optimizer' is not a plain torch optimizer state dict ({kind}); "
                          "only fp32 training without the distributed optimizer is mapped")
    groups = opt["param_groups"]
    wd = [g for g in groups if float(g.get("wd_mult", 1.0)) != 0.0]
    nowd = [g for g in groups if float(g.get("wd_mult", 1.0)) == 0.0]
    if len(wd) > 1 or len(nowd) > 1:
        raise FormatError(f"{path}: {len(groups)} optimizer parameter groups; the converter maps megatron's "
                          "standard two (weight decay, no weight decay) only")
    members = {id(g): [] for g in groups}
    for c, params in enumerate(chunk_params):
        for n, shape in params:
            target = nowd if no_weight_decay(n, shape) else wd
            if not target:
                raise FormatError(f"{path}: no optimizer group for {n}")
            members[id(target[0])].append((c, n, shape))
    out = {}
    for g in groups:
        if len(g["params"]) != len(members[id(g)]):
            raise FormatError(f"{path}: optimizer group with wd_mult {g.get('wd_mult')} holds "
                              f"{len(g['params'])} parameters, the model has {len(members[id(g)])}")
        for index, (c, n, shape) in zip(g["params"], members[id(g)]):
            state = opt["state"].get(index, {})
            if "exp_avg" not in state or tuple(state["exp_avg"].shape) != shape:
                raise FormatError(f"{path}: optimizer state {index} does not fit {n} {list(shape)}")
            out[(c, n)] = index
    return out


def buffer_places(rank_dir, chunk_params, pp_rank, pp, vpp, tied, dp, bucket_size, high_busbw) -> dict:
    """(chunk, local name) -> (buffer, offset, numel) of its state in `distrib_optim.pt`'s flat
    buffers (distributed optimizer), each buffer's layout checked against its `numel_unpadded`."""
    path = os.path.join(rank_dir, OPTIM_FILE)
    state = torch_load(path)
    if isinstance(state, list):
        raise FormatError(f"{path}: several chained optimizers' states; not supported")
    buffers = sorted(k for k in state if isinstance(k, int))
    if len(buffers) != len(chunk_params):
        raise FormatError(f"{path}: {len(buffers)} buffers, the model has {len(chunk_params)} chunks")
    out = {}
    for c, params in enumerate(chunk_params):
        per_dtype = state[buffers[c]]
        if len(per_dtype) != 1:
            raise FormatError(f"{path}: buffer {c} has {len(per_dtype)} dtypes, one expected")
        (saved,) = per_dtype.values()
        items = [(n, math.prod(s), shared_embedding(n, c, len(chunk_params), pp_rank, pp, tied))
                 for n, s in params]
        offsets, numel = buffer_offsets(items, dp, bucket_size if c == 0 else None, high_busbw)
        if int(saved["numel_unpadded"]) != numel:
            raise FormatError(f"{path}: buffer {c} holds {int(saved['numel_unpadded'])} elements, the model's "
                              f"parameters lay out to {numel} (different DP size or bucket size? pass "
                              "--data-parallel-size / --ddp-bucket-size)")
        for n, (offset, size) in offsets.items():
            out[(c, n)] = (buffers[c], offset, size)
    del state
    return out


def step_and_groups(sd, path, dist_opt):
    """Adam's step (one for all parameters) and the parameter groups' settings of a rank's file."""
    opt = sd.get("optimizer")
    # torch's Adam keeps the step per parameter, FusedAdam per param group (optimizer_state.py)
    groups = opt["optimizer"]["param_groups"] if dist_opt else opt["param_groups"]
    steps = saved_steps(groups, () if dist_opt else opt["state"].values())
    if len(steps) > 1:
        raise FormatError(f"{path}: optimizer holds steps {sorted(steps)}, one expected")
    step = steps.pop() if steps else 0
    return int(float(step or 0)), plain_groups(groups)
