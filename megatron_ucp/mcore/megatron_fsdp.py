"""Megatron-FSDP (`--use-megatron-fsdp`): where each rank's part of every parameter lives.

Megatron-FSDP keeps a model chunk's parameters in flat per-group buffers cut into one shard per
data-parallel rank: model weights (`model_weight_buffer`, sharded under the default
`optim_grads_params`) and fp32 main weights (`main_weight_buffer`), whose shards are the
optimizer's parameters (uneven `DTensor`s of whole rows). A shard holds rows [a, b) of each
parameter it meets, possibly none. The module's own parameters are the unsharded copies it
gathers for compute (megatron_fsdp.py, param_and_grad_buffer.py in 0.19.2): megatron's
`sharded_state_dict()` describes those, so the geometry of a parameter is megatron's, cut to
the rows this rank holds (`restrict`). Its `optimizer.sharded_state_dict()` does not serve
universal checkpoints (its `fsdp_dtensor` format is keyed by module path), so the optimizer
state is mapped by us (optimizer_state.py).
"""

import contextlib
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from megatron_ucp.errors import LayoutError
from megatron_ucp.format.layout import Box


@dataclass(frozen=True)
class Shard:
    """This rank's part of one parameter: flat elements [start, stop) of it."""

    start: int
    stop: int
    weights: torch.Tensor  # the model weights this rank holds (1-D): [start, stop), or all of it
    sharded_weights: bool  # the weights are the shard only (else the whole parameter)


def megatron_fsdp_module(chunk) -> Optional[torch.nn.Module]:
    """The MegatronFSDP module inside a model chunk (megatron's adapter wraps it), or None."""
    while chunk is not None:
        if hasattr(chunk, "param_and_grad_buffer") and hasattr(chunk, "param_to_name"):
            return chunk
        chunk = getattr(chunk, "module", None)
    return None


def _set_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    module.get_submodule(owner)._parameters[leaf] = param


def _meta_twin(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """A meta-device parameter of p's shape, strides and megatron attributes."""
    twin = torch.nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta"),
                              requires_grad=p.requires_grad)
    twin.__dict__.update(p.__dict__)
    return twin


@contextlib.contextmanager
def module_parameters(chunk):
    """Yields {id(stand-in): module parameter}: for the block, the module's parameters are
    meta-device twins of its own (unsharded) ones, for megatron to describe. Megatron-FSDP
    swaps them for the optimizer's main-weight shards after each step and before any
    `state_dict()` (megatron_fsdp.py:1145, 1375), which megatron describes as even shards of
    the whole tensor, which they are not; and it frees their storage between uses, which
    megatron's SwiGLU description reads (mlp.py:477). Its flag is held, so its hook leaves them."""
    fsdp = megatron_fsdp_module(chunk)
    if fsdp is None:
        yield {}
        return
    was_distributed = fsdp.is_param_fsdp_distributed
    fsdp._replace_param_with_raw_if_needed()
    raw = dict(fsdp.module.named_parameters())
    twins = {name: _meta_twin(p) for name, p in raw.items()}
    for name, twin in twins.items():
        _set_parameter(fsdp.module, name, twin)
    fsdp.is_param_fsdp_distributed = True  # the state_dict pre-hook's "already done"
    try:
        yield {id(twins[name]): p for name, p in raw.items()}
    finally:
        for name, p in raw.items():
            _set_parameter(fsdp.module, name, p)
        fsdp.is_param_fsdp_distributed = False
        if was_distributed:
            fsdp._replace_param_with_distributed_if_needed()


def shards(chunk) -> Dict[int, Shard]:
    """id(module parameter) -> this rank's Shard of it; empty for a chunk without Megatron-FSDP."""
    fsdp = megatron_fsdp_module(chunk)
    if fsdp is None:
        return {}
    out = {}
    for group in fsdp.param_and_grad_buffer.parameter_groups:
        weights, main = group.model_weight_buffer, group.main_weight_buffer
        sharded = weights if weights is not None and weights.is_data_distributed else main
        for item_id, param in enumerate(group.params):
            if sharded is None:
                start, stop = 0, param.numel()
            else:
                start, stop = sharded._get_item_slice_in_shard(item_id)
                if start >= stop:
                    start = stop = 0
            if weights is None:  # 'no_shard' without main weights: the module's parameter is all of it
                out[id(param)] = Shard(start, stop, param.data.view(-1), False)
            else:
                out[id(param)] = Shard(start, stop, weights.get_item(item_id), bool(weights.is_data_distributed))
    return out


def restrict(boxes: Tuple[Box, ...], row: int, start: int, stop: int) -> Tuple[Box, ...]:
    """The parts of `boxes` (a local tensor's, rows of `row` elements) within its flat elements
    [start, stop), rebased to start; both ends and every box whole rows."""
    if start % row or stop % row:
        raise LayoutError(f"a Megatron-FSDP shard [{start}, {stop}) cuts rows of {row} elements")
    out = []
    for b in sorted(boxes, key=lambda b: b.local_start):
        box_row = 1
        for n in b.shape[1:]:
            box_row *= n
        if box_row != row or b.local_start % row:
            raise LayoutError(f"megatron's box {b} is not whole rows of {row} elements")
        first = b.local_start // row
        lo, hi = max(first, start // row), min(first + b.shape[0], stop // row)
        if lo < hi:
            out.append(Box(lo * row - start, (b.offset[0] + lo - first,) + tuple(b.offset[1:]),
                           (hi - lo,) + tuple(b.shape[1:])))
    return tuple(out)


def main_from_model(chunk) -> bool:
    """Copy the model weights into Megatron-FSDP's main weights (a load without optimizer state:
    --finetune, --no-load-optim), which megatron does not (`_copy_model_params_to_main_params`
    raises for Megatron-FSDP, distrib_optimizer.py:3079 in 0.19.2); False without Megatron-FSDP."""
    fsdp = megatron_fsdp_module(chunk)
    if fsdp is None:
        return False
    with torch.no_grad():
        for group in fsdp.param_and_grad_buffer.parameter_groups:
            weights, main = group.model_weight_buffer, group.main_weight_buffer
            if weights is None or main is None:
                continue  # the weights are the main weights
            for item_id in range(len(group.params)):
                target = main.get_item(item_id)
                source = weights.get_item(item_id)
                if not weights.is_data_distributed:  # whole weights, sharded main weights
                    start, stop = main._get_item_slice_in_shard(item_id)
                    source = source[start:stop] if stop > start else source[:0]
                target.copy_(source)
    return True

