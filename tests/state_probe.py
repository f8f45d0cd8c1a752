"""What one rank holds after a restore, as flat {key: value}, and the bitwise differences of two
such snapshots: the differential test of the local and the persistent tier (issue 46,
tests/test_local_differential.py) takes one after each restore, in one process group, on both
trainers (the own loop through tests/runner.py, Megatron-LM's trainer through
tests/mlm_restore_probe.py).

Held: every parameter of every model chunk (the weights), the optimizer's parameters (the main
params: fp32 masters where the model is 16-bit, the distributed optimizer's shards), every entry
of its state (Adam's moments and step), its param groups' settings (the learning rate the
scheduler set), the scheduler's state, the RNG states, and what the caller adds (iteration,
consumed samples, the next batch's tokens).
"""

import random

import numpy as np
import torch


def _inner_optimizers(optimizer):
    """The torch optimizers inside megatron's (chained for MoE: dense and expert parameters)."""
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None)
    return [o.optimizer for o in (chained if chained is not None else [optimizer])]


def _value(v):
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu").clone()
    if isinstance(v, (list, tuple)):
        return type(v)(_value(x) for x in v)
    if isinstance(v, dict):
        return {k: _value(x) for k, x in v.items()}
    if isinstance(v, np.ndarray):
        return v.copy()
    return v


def snapshot(model, optimizer, scheduler, **extra) -> dict:
    out = {}
    for i, chunk in enumerate(model):
        for name, p in chunk.named_parameters():
            out[f"model[{i}].{name}"] = _value(p)
    for j, inner in enumerate(_inner_optimizers(optimizer)):
        for g, group in enumerate(inner.param_groups):
            for k, v in group.items():
                if k != "params":
                    out[f"optimizer[{j}].group[{g}].{k}"] = _value(v)
            for n, p in enumerate(group["params"]):
                where = f"optimizer[{j}].group[{g}].param[{n}]"
                out[f"{where}.main"] = _value(p)
                state = inner.state.get(p, {})
                out[f"{where}.state_keys"] = sorted(state)
                for k, v in state.items():
                    out[f"{where}.{k}"] = _value(v)
    if scheduler is not None:
        for k, v in scheduler.state_dict().items():
            out[f"scheduler.{k}"] = _value(v)
    out["rng.torch"] = torch.get_rng_state()
    out["rng.numpy"] = _value(np.random.get_state())
    out["rng.python"] = random.getstate()
    try:
        from megatron.core import tensor_parallel

        for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items():
            out[f"rng.tracker.{k}"] = _value(v)
    except Exception:  # no tracker in this mode: the other states stand
        pass
    for k, v in extra.items():
        out[k] = _value(v)
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    return type(a) is type(b) and a == b


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype} {tuple(v.shape)}"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def differences(a: dict, b: dict, limit: int = 8) -> list:
    """The keys whose values differ (bitwise for tensors), or that only one snapshot holds."""
    out = [f"{k}: only in the first" for k in sorted(a.keys() - b.keys())]
    out += [f"{k}: only in the second" for k in sorted(b.keys() - a.keys())]
    for k in sorted(a.keys() & b.keys()):
        if not _same(a[k], b[k]):
            x, y = a[k], b[k]
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape \
                    and x.dtype == y.dtype and x.is_floating_point():
                diff = (x.double() - y.double()).abs()
                out.append(f"{k}: {int((diff != 0).sum())} of {x.numel()} elements differ, max {float(diff.max()):.3g}")
            else:
                out.append(f"{k}: {_describe(x)} vs {_describe(y)}")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])
