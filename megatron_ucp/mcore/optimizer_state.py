"""Adam state through megatron's own accessors, whichever Adam megatron-core built.

megatron-core builds torch's AdamW without apex and transformer-engine, and a FusedAdam (TE's,
else apex's) with either. The two keep different contracts, and a checkpoint must not care:

- the step count: per parameter (`state[p]["step"]`, a tensor) for torch's Adam, per param
  group (`group["step"]`, an int, absent before the first step) for the fused ones;
- per-parameter state: created by torch's Adam at its first step, by FusedAdam lazily too; a
  load needs it first, made the way megatron makes it before its own loads (the optimizer's
  `init_state_fn`);
- with megatron's precision-aware optimizer the moments (and master weights) live inside the
  fused optimizer in bf16/fp16/fp32, readable only as fp32 copies through
  `DistributedOptimizer._get_main_param_and_optimizer_states` and writable through its
  `_set_main_param_and_optimizer_states`.

Checkpoints hold fp32, unscaled states whatever the run keeps, so a checkpoint moves between a
run with bf16 moments and one with fp32 moments, and between the two Adams.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from megatron_ucp.errors import LayoutError
from megatron_ucp.format import host_memory
from megatron_ucp.mcore.fsdp2 import local_shard


@dataclass
class Fragment:
    """Flat elements [start, stop) of a local parameter whose optimizer state lives here."""

    start: int
    stop: int
    main: torch.Tensor  # fp32 master weight of those elements (1-D, all three)
    exp_avg: Optional[torch.Tensor]
    exp_avg_sq: Optional[torch.Tensor]
    main_is_model: bool  # the master weight is the model parameter itself (fp32, no copy)
    # Hands the three back to the optimizer after a load wrote them, where they are copies of
    # its own storage (the precision-aware optimizer); None where they are that storage.
    store: Optional[Callable[[], None]] = None


def inner_optimizers(optimizer) -> list:
    """The megatron optimizers behind `optimizer` (a chained one holds one per parameter kind)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def uses_distributed_optimizer(optimizer) -> bool:
    """Whether any optimizer behind `optimizer` shards its state over data parallelism."""
    return any(type(o).__name__ == "DistributedOptimizer" for o in inner_optimizers(optimizer))


def keeps_step_per_param(inner) -> bool:
    """torch's Adam/AdamW count steps per parameter; FusedAdam (TE, apex) per param group."""
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def _precision_aware(opt) -> bool:
    return bool(getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False))


def allocate(opt, for_load: bool) -> None:
    """Give every parameter of megatron optimizer `opt` its Adam state if it has none yet.

    torch's Adam gets step 0 and its moments (allocated, not zeroed, when a load is about to
    fill them all); any other Adam gets what megatron's own `init_state_fn` makes before a
    load (zero moments; FusedAdam's `initialize_state` for the precision-aware optimizer).
    """
    inner = opt.optimizer
    if keeps_step_per_param(inner):
        from megatron_ucp.mcore.compat import init_torch_adam_state

        init_torch_adam_state(inner, host_memory.empty_like if for_load else torch.zeros_like)
        return
    if all(len(inner.state[p]) for g in inner.param_groups for p in g["params"]):
        return
    init = getattr(opt, "init_state_fn", None)
    if init is not None:
        init(inner, opt.config)


def read_step(optimizer) -> int:
    """The number of Adam steps taken (0 before the first), in either convention."""
    steps = [0]
    for opt in inner_optimizers(optimizer):
        inner = opt.optimizer
        if inner is None:
            continue
        if keeps_step_per_param(inner):
            steps += [int(float(s["step"])) for s in inner.state.values() if "step" in s]
        else:  # TE does not count steps of empty groups
            steps += [int(g["step"]) for g in inner.param_groups if g["params"] and "step" in g]
    return max(steps)


def write_step(optimizer, step: int) -> None:
    """Set the step count in the optimizer's own convention (Adam's bias correction uses it)."""
    for opt in inner_optimizers(optimizer):
        inner = opt.optimizer
        if inner is None:
            continue
        if keeps_step_per_param(inner):
            for state in inner.state.values():  # one tensor each: torch increments them in place
                state["step"] = torch.tensor(float(step))
        else:
            for group in inner.param_groups:
                group["step"] = int(step)


def saved_steps(param_groups, param_states=()) -> set:
    """The step counts a saved torch optimizer state dict holds, in either convention: per
    parameter (torch's Adam) or per param group (FusedAdam; empty groups keep none, and groups
    whose `params` were stripped count)."""
    steps = {int(float(s["step"])) for s in param_states if isinstance(s, dict) and "step" in s}
    steps |= {int(float(g["step"])) for g in param_groups
              if g.get("step") is not None and g.get("params", True)}
    return steps


def plain_groups(param_groups) -> list:
    """The param groups' hyper-parameters as JSON values (the manifest's `param_groups`): every
    entry but `params` and `step` (the record's own, whichever convention kept it)."""
    scalar = (int, float, str, bool, tuple, list, type(None))
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
             if k not in ("params", "step") and isinstance(v, scalar)} for g in param_groups]


def _flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """1-D view of a state tensor (of its local shard for FSDP2's DTensors)."""
    return None if t is None else local_shard(t).view(-1)


def _distributed(opt, for_load: bool) -> Dict[torch.nn.Parameter, Fragment]:
    out = {}
    aware = _precision_aware(opt)
    for gbuf_range_maps in opt.gbuf_ranges:
        for per_bucket in gbuf_range_maps.values():
            for bucket in per_bucket:
                for model_param, ranges in bucket["param_map"].items():
                    r = ranges["param"]
                    t = opt._get_main_param_and_optimizer_states(model_param)
                    _need_fp32(t, model_param)
                    main, m, v = t["param"].view(-1), _flat(t.get("exp_avg")), _flat(t.get("exp_avg_sq"))
                    store = None
                    if aware and for_load:  # fp32 copies of the fused optimizer's own states
                        store = _setter(opt, model_param, {"param": main, "exp_avg": m, "exp_avg_sq": v})
                    out[model_param] = Fragment(r.start, r.end, main, m, v, False, store)
    return out


def _megatron_fsdp(opt) -> Dict[torch.nn.Parameter, Fragment]:
    """Megatron-FSDP's optimizer steps the main-weight shards (uneven DTensors whose
    `orig_param` is the module's parameter and `megatron_fsdp_slice` the flat elements of it
    they hold, param_and_grad_buffer.py:3296-3330 in 0.19.2); its moments are shaped alike."""
    inner, out = opt.optimizer, {}
    for group in inner.param_groups:
        for p in group["params"]:
            local = local_shard(p)
            where = getattr(p, "megatron_fsdp_slice", None) or slice(0, local.numel())
            state = inner.state[p]
            moments = {k: state.get(k) for k in ("exp_avg", "exp_avg_sq")}
            _need_fp32({"param": local, **{k: local_shard(v) if v is not None else None
                                            for k, v in moments.items()}}, p.orig_param)
            start = where.start if where.stop > where.start else 0
            out[p.orig_param] = Fragment(start, start + local.numel(), local.view(-1),
                                         _flat(moments["exp_avg"]), _flat(moments["exp_avg_sq"]), False)
    return out


def _megatron_fsdp_run(opt) -> bool:
    return bool(getattr(getattr(opt, "ddp_config", None), "use_megatron_fsdp", False))


def _need_fp32(tensors: dict, model_param) -> None:
    """TE's store_param_remainders keeps only the low 16 bits of each fp32 master (int16)."""
    for name, t in tensors.items():
        if t is not None and t.dtype != torch.float32:
            raise LayoutError(
                f"the optimizer returns {name} of a parameter of shape {list(model_param.shape)} as "
                f"{t.dtype}, not fp32 values (transformer-engine's store_param_remainders keeps only "
                "the low bits of the fp32 master weights): train with --no-store-param-remainders")


def _setter(opt, model_param, tensors: dict) -> Callable[[], None]:
    def store():
        opt._set_main_param_and_optimizer_states(model_param, tensors)

    return store


def _float16(opt) -> Dict[torch.nn.Parameter, Fragment]:
    inner, out, pairs = opt.optimizer, {}, []
    for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
        pairs += list(zip(model_group, main_group))
    for group in opt.fp32_from_fp32_groups:
        pairs += [(p, p) for p in group]
    for model_param, main in pairs:
        state = inner.state[main]
        out[local_shard(model_param)] = Fragment(0, local_shard(model_param).numel(), _flat(main),
                                                 _flat(state.get("exp_avg")), _flat(state.get("exp_avg_sq")),
                                                 main is model_param)
    return out


def _fp32(opt) -> Dict[torch.nn.Parameter, Fragment]:
    """FP32Optimizer and other wrappers whose inner params are the model params."""
    inner, out = opt.optimizer, {}
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state[p]
            local = local_shard(p)
            out[local] = Fragment(0, local.numel(), local.data.view(-1), _flat(state.get("exp_avg")),
                                  _flat(state.get("exp_avg_sq")), True)
    return out


def fragments(optimizer, for_load: bool = False) -> Dict[torch.nn.Parameter, Fragment]:
    """Map each model parameter to the fragment of it whose optimizer state this rank holds,
    as fp32 tensors; `for_load`: the caller will overwrite them, then call each `store`."""
    out = {}
    for opt in inner_optimizers(optimizer):
        if opt.optimizer is None:
            continue
        allocate(opt, for_load)
        kind = type(opt).__name__
        if kind == "DistributedOptimizer" and _megatron_fsdp_run(opt):
            found = _megatron_fsdp(opt)
        elif kind == "DistributedOptimizer":
            found = _distributed(opt, for_load)
        elif kind == "Float16OptimizerWithFloat16Params":
            found = _float16(opt)
        else:
            found = _fp32(opt)
        for param, f in found.items():
            if f.exp_avg is None or f.exp_avg_sq is None:
                raise LayoutError(f"{type(opt.optimizer).__name__} keeps no Adam moments (exp_avg, "
                                  f"exp_avg_sq) for a parameter of shape {list(param.shape)}: universal "
                                  "checkpoints hold Adam state")
        out.update(found)
    return out


def grad_scaler_state(optimizer) -> Optional[dict]:
    """The dynamic loss scaler's state (fp16 training), as JSON; None without one.

    Each optimizer of a chain has a scaler; the loss is scaled by the first one's
    (ChainedOptimizer.get_loss_scale), which is the one kept.
    """
    for opt in inner_optimizers(optimizer):
        scaler = getattr(opt, "grad_scaler", None)
        state = scaler.state_dict() if scaler is not None else {}
        if "scale" in state:
            return {"scale": float(state["scale"].float().view(-1)[0]),
                    "growth_tracker": int(state["growth_tracker"]),
                    "hysteresis_tracker": int(state["hysteresis_tracker"])}
    return None


def load_grad_scaler(optimizer, saved: dict) -> bool:
    """Restore the dynamic loss scaler of every optimizer of the chain; False if it has none."""
    loaded = False
    for opt in inner_optimizers(optimizer):
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is None or "scale" not in scaler.state_dict():
            continue
        device = scaler.scale.device
        scaler.load_state_dict({
            "scale": torch.tensor([float(saved["scale"])], dtype=torch.float32, device=device),
            "growth_tracker": int(saved["growth_tracker"]),
            "hysteresis_tracker": int(saved["hysteresis_tracker"])})
        loaded = True
    return loaded
