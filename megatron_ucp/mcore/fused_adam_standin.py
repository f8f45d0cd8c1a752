"""A CPU stand-in for transformer-engine's FusedAdam: its state contract, torch's AdamW arithmetic.

GPU users train with `transformer_engine.pytorch.optimizers.FusedAdam` (megatron-core picks it
whenever TE is installed); our CPU tests would otherwise only ever see `torch.optim.AdamW`, whose
state is laid out differently. This class keeps FusedAdam's contract, read from TE's own
`fused_adam.py`, so that the checkpoint code is proven against it without a GPU:

- the step count lives in `param_groups[i]["step"]` (an int, created at the first step and
  incremented once per step), never in per-parameter state; empty groups are skipped and keep
  no step;
- per-parameter state is created lazily at the first step (`initialize_state`): zero `exp_avg`,
  `exp_avg_sq`, and with `master_weights` a `master_param` copied from the parameter;
- `exp_avg_dtype` / `exp_avg_sq_dtype` / `master_weight_dtype` choose how states are kept: fp32
  as is, bf16 by plain rounding, fp16 scaled by a per-state fp32 factor (absmax / (fp16 max / 2));
  `get_unscaled_state(param, name)` returns fp32 values (the stored tensor itself when fp32) and
  `set_scaled_state(param, name, fp32)` stores them, creating the state when absent;
- `use_decoupled_grad` reads `param.decoupled_grad` instead of `param.grad`;
- `state_dict()` hands out unscaled fp32 states; `load_state_dict()` stores them back scaled;
- `adam_w_mode` (decoupled weight decay) and `bias_correction` as in TE.

Not reproduced: fp8 (uint8) states, `store_param_remainders`, `capturable`; asking for them
raises. The update itself is torch's single-tensor Adam(W) on the unscaled fp32 values, so an
fp32 run with this class computes bit for bit what `torch.optim.AdamW` does, and losses of the
two can be compared; TE's CUDA kernel rounds differently (see the GPU check).
"""

import contextlib
import importlib
from typing import Iterable

import torch
from torch.optim.adam import adam as _adam

_SCALED_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0}
_STATES = ("exp_avg", "exp_avg_sq", "master_param")


class FusedAdamStandIn(torch.optim.Optimizer):
    """FusedAdam's state contract on any device (see the module docstring)."""

    def __init__(self, params: Iterable, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, bias_correction=True, adam_w_mode=True, capturable=False,
                 master_weights=False, master_weight_dtype=torch.float32,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False):
        if amsgrad or capturable or store_param_remainders:
            raise RuntimeError("FusedAdamStandIn: amsgrad, capturable and store_param_remainders "
                               "are not reproduced")
        for name, dtype in (("master_weight_dtype", master_weight_dtype),
                            ("exp_avg_dtype", exp_avg_dtype), ("exp_avg_sq_dtype", exp_avg_sq_dtype)):
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise RuntimeError(f"FusedAdamStandIn: {name} {dtype} (fp8 states are not reproduced)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)
        self.master_weights = bool(master_weights)
        self.use_decoupled_grad = bool(use_decoupled_grad)
        self.name_to_dtype_map = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype,
                                  "master_param": master_weight_dtype}
        self._scales = {}  # param -> {state name: fp32 scale}, for fp16 states

    # -- the state accessors megatron's DistributedOptimizer calls --

    def _initialize_state(self, param, name: str, zero: bool) -> None:
        dtype = self.name_to_dtype_map[name]
        data = torch.empty_like(param, dtype=dtype)
        if zero:
            data.zero_()
        self.state[param][name] = data
        if dtype != torch.float32:
            self._scales.setdefault(param, {})[name] = torch.ones(1, dtype=torch.float32,
                                                                  device=param.device)

    def initialize_state(self, param, store_param_remainders=False) -> None:
        self._initialize_state(param, "exp_avg", zero=True)
        self._initialize_state(param, "exp_avg_sq", zero=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero=False)
            self.set_scaled_state(param, "master_param", param.detach().clone().float())

    def get_unscaled_state(self, param, name: str) -> torch.Tensor:
        stored = self.state[param][name]
        if stored.dtype == torch.float32:
            return stored
        unscaled = stored.float()
        if stored.dtype == torch.float16:
            unscaled.mul_(self._scales[param][name])
        return unscaled

    def set_scaled_state(self, param, name: str, unscaled: torch.Tensor) -> None:
        if unscaled.dtype != torch.float32:
            raise TypeError(f"set_scaled_state({name!r}) takes fp32 values, not {unscaled.dtype}")
        if name not in self.state[param]:
            self._initialize_state(param, name, zero=False)
        stored = self.state[param][name]
        if stored.dtype == torch.float16:
            scale = self._scales[param][name]
            absmax = unscaled.abs().max().view(1) if unscaled.numel() else torch.zeros(1)
            torch.div(absmax.to(scale), _SCALED_RANGE[torch.float16], out=scale)
            rscale = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
            stored.copy_(unscaled * rscale.to(unscaled.device))
        else:
            stored.copy_(unscaled)

    def state_dict(self):
        out = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for index, state in out["state"].items():
            out["state"][index] = {k: self.get_unscaled_state(params[index], k) for k in state}
        return out

    def load_state_dict(self, state_dict):
        """As TE's: the saved groups' parameter ids (indices, or the parameter names megatron's
        Megatron-FSDP optimizer keeps, distrib_optimizer.py:916) name this optimizer's
        parameters in order; their states are stored back scaled."""
        super().load_state_dict(state_dict)
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = dict(zip(saved, (p for g in self.param_groups for p in g["params"])))
        for index, state in state_dict["state"].items():
            param = params[index]
            self.state[param] = {}
            for name, value in state.items():
                if value is not None:
                    self.set_scaled_state(param, name, value.float())

    # -- the update --

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            for p in group["params"]:
                if len(self.state[p]) == 0:
                    self.initialize_state(p)
                grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
                if grad is None:
                    continue
                self._update(p, grad, group)
        return loss

    def _update(self, p, grad, group) -> None:
        """One Adam(W) step of one parameter on fp32 values, through torch's own kernel."""
        states = {k: self.get_unscaled_state(p, k) for k in _STATES if k in self.state[p]}
        master = states.get("master_param")
        weights = master if master is not None else p
        if weights.dtype != torch.float32:
            raise RuntimeError("FusedAdamStandIn: low-precision parameters need master_weights")
        if not group["bias_correction"]:
            raise RuntimeError("FusedAdamStandIn: bias_correction=False is not reproduced")
        beta1, beta2 = group["betas"]
        step = torch.tensor(float(group["step"] - 1))  # torch's kernel increments it first
        _adam([weights], [grad.float()], [states["exp_avg"]], [states["exp_avg_sq"]], [], [step],
              foreach=False, decoupled_weight_decay=self.adam_w_mode, amsgrad=False, beta1=beta1,
              beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
              maximize=False)
        for name, value in states.items():
            if value is not self.state[p][name]:
                self.set_scaled_state(p, name, value)
        if master is not None:
            p.copy_(master)


def precision_aware(config, exp_avg_dtype, exp_avg_sq_dtype, main_params_dtype=torch.float32):
    """Turn on megatron's precision-aware optimizer on an OptimizerConfig built without it.

    megatron's OptimizerConfig refuses the option unless it can import TE's FusedAdam; with the
    stand-in installed in its place, set the fields that check would have accepted.
    """
    config.use_precision_aware_optimizer = True
    config.exp_avg_dtype, config.exp_avg_sq_dtype = exp_avg_dtype, exp_avg_sq_dtype
    config.main_params_dtype = main_params_dtype
    config.store_param_remainders = False
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    return config


@contextlib.contextmanager
def installed():
    """Put the stand-in where megatron-core puts FusedAdam when TE is installed, for the block.

    The same module flags megatron sets after importing TE's FusedAdam: the optimizer factory
    builds `Adam(adam_w_mode=...)` and the distributed optimizer keeps the step in the groups.
    """
    factory = importlib.import_module("megatron.core.optimizer")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    patches = [
        (factory, "Adam", FusedAdamStandIn),
        (factory, "USING_PYTORCH_OPTIMIZER", False),
        (factory, "is_te_min_version", lambda version, check_equality=True: True),
        (distrib, "Adam", FusedAdamStandIn),
        (distrib, "HAVE_APEX_OR_TE", True),
        (distrib, "USING_TE_OPTIMIZER", True),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
