"""The keys of a Megatron-FSDP `fsdp_dtensor` checkpoint, as pure functions (no torch, no megatron).

Megatron-LM (megatron/training/checkpointing.py, `preprocess_fsdp_dtensor_state_dict`) saves
a flat torch DCP state dict:

- `model.<wrappers><path>`: one global tensor per module parameter, `<path>` the parameter's
  own module path (`decoder.layers.0.input_layernorm.weight`), tensor parallelism already
  concatenated (a DTensor's Shard placement), rows cut over data parallelism in chunks;
- `optimizer.state.<wrappers><path>.exp_avg` / `.exp_avg_sq`: Adam's moments, same shapes;
- `optimizer.param_to_group_meta.<wrappers><path>.<field>`: the parameter's group settings
  (`step`, `lr`, `weight_decay`, `wd_mult`...), one small object each.

`<wrappers>` is one `module.` per wrapper around the model (Megatron-FSDP's, and in 16-bit
runs its Float16Module's): the same for every key under one root, found once here. With
SwiGLU, `handle_swiglu_in_state_dict` stores each gated fc1 parameter as two tensors, `<path>_w`
and `<path>_v`: the first and second halves of every tensor-parallel rank's rows, concatenated
over the ranks, which are the two halves of the tensor in one-rank (TP = 1) coordinates.
"""

import re
from typing import Dict, List, Optional

from megatron_ucp.errors import FormatError, IncompleteCheckpointError, LayoutError

MODEL = "model."
STATE = "optimizer.state."
GROUP_META = "optimizer.param_to_group_meta."
SCHEDULER = "opt_param_scheduler."
MOMENTS = ("exp_avg", "exp_avg_sq")
HALVES = ("_w", "_v")  # handle_swiglu_in_state_dict's suffixes, in row order

_WRAPPERS = re.compile(r"(?:module\.)+")


def wrapped_root(keys, root: str, where: str) -> Optional[str]:
    """`root` with the checkpoint's wrapper prefixes (`model.module.`): the one prefix every
    key under `root` starts with; None when no key is under `root`."""
    found = set()
    for k in keys:
        if k.startswith(root):
            m = _WRAPPERS.match(k, len(root))
            found.add(root + (m.group(0) if m else ""))
    if len(found) > 1:
        raise FormatError(f"{where}: keys under {root!r} have different wrapper prefixes {sorted(found)}; "
                          "one model wrapper expected")
    return found.pop() if found else None


def box_keys(path: str, shape: tuple, gated: bool, shapes: Dict[str, tuple], root: str, where: str) -> List[tuple]:
    """(key, rows, first row) for each stored tensor of the parameter at module path `path`
    of (padded) `shape`, checked against the checkpoint's `shapes` (key -> global shape, less
    `root`, which the messages name). `gated`: the model describes it as SwiGLU's two halves."""
    if gated:
        if path in shapes:
            raise LayoutError(f"{where}: {root + path!r} is stored whole; the model built from the stored arguments "
                              f"has it as SwiGLU halves ({path}_w, {path}_v)")
        half = (shape[0] // 2,) + tuple(shape[1:])
        out = []
        for i, suffix in enumerate(HALVES):
            key = path + suffix
            if key not in shapes:
                raise IncompleteCheckpointError(f"{where}: no tensor {root + key!r} (the SwiGLU half of {path})")
            _same_shape(root + key, shapes[key], half, where)
            out.append((key, half[0], i * half[0]))
        return out
    if path not in shapes:
        if all(path + s in shapes for s in HALVES):
            raise LayoutError(f"{where}: {root + path!r} is stored as SwiGLU halves; the stored arguments describe "
                              "no --swiglu model")
        raise IncompleteCheckpointError(f"{where}: no tensor {root + path!r}")
    _same_shape(root + path, shapes[path], tuple(shape), where)
    return [(path, shape[0] if shape else None, 0)]


def _same_shape(key: str, stored: tuple, wanted: tuple, where: str) -> None:
    if tuple(stored) != tuple(wanted):
        raise LayoutError(f"{where}: {key!r} has shape {list(stored)}, the model built from the stored "
                          f"arguments has {list(wanted)}")


MAX_STEP = 2**62


def step_count(value, where: str) -> int:
    """An optimizer step as saved (an int, an integral float, a one-element tensor), as an int
    0..MAX_STEP; anything else (text, NaN, infinity, a fraction, negative) is refused."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or not 0 <= value <= MAX_STEP:
        raise FormatError(f"{where} is {value!r:.60}, expected an integer step 0..{MAX_STEP}")
    return value


def param_groups(metas: Dict[str, dict], where: str):
    """(Adam's step, param groups) from each parameter's group settings, in model order: one
    group per distinct setting set, in order of first appearance (megatron builds its groups
    from the parameters in model order), each without `step` and `params`."""
    steps, groups = set(), []
    for path, meta in metas.items():
        if "step" not in meta:
            raise FormatError(f"{where}: the group settings of {path} have no 'step' (fields {sorted(meta)})")
        steps.add(step_count(meta["step"], f"{where}: {GROUP_META}{path}.step"))
        settings = {k: v for k, v in meta.items() if k not in ("step", "params")}
        if settings not in groups:
            groups.append(settings)
    if len(steps) != 1:
        raise FormatError(f"{where}: the parameters' optimizer steps are {sorted(steps)}, one expected")
    return steps.pop(), groups
