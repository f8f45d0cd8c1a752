"""Gaps of megatron-core when neither NVIDIA apex nor transformer-engine is installed, and of
its local spec (which runs with them installed too).

These are not about the CPU: a GPU job without TE hits them too. Each patch has a one-line
reason and applies only when the component it replaces is absent and the installed
megatron-core has the gap (`core_version()`, tested where the patch is chosen; the tested
releases are 0.16.1 and 0.19.2). `apply()` is idempotent.
"""

import copy
import functools
import importlib

_APPLIED = False


@functools.lru_cache(maxsize=None)
def core_version() -> tuple:
    """The installed megatron-core's (major, minor, patch): the fixes that one release needs and
    another does not are chosen by it."""
    info = importlib.import_module("megatron.core.package_info")
    return (int(info.MAJOR), int(info.MINOR), int(info.PATCH))


def ships_megatron_lm() -> bool:
    """Whether the installed megatron-core wheel ships Megatron-LM's trainer (`megatron.training`,
    0.17 and later): there `pretrain_gpt_ucp.py` runs it with the plug-in, not the own loop."""
    return core_version() >= (0, 17)


def _have(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


def _torch_norm_with_sequence_parallel():
    """WrappedTorchNorm refuses sequence_parallel; build it without, then mark its params so
    that finalize_model_grads all-reduces their grads over TP (what TE/apex norms do)."""
    torch_norm = importlib.import_module("megatron.core.transformer.torch_norm")
    original_new = torch_norm.WrappedTorchNorm.__new__

    @functools.wraps(original_new)
    def new(cls, config, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        if sequence_parallel:
            config = copy.copy(config)
            config.sequence_parallel = False
        norm = original_new(cls, config, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def _zero_centered_norms():
    """WrappedTorchNorm (the local spec's norm without apex) refuses layernorm_zero_centered_gamma,
    Megatron-LM's --apply-layernorm-1p (torch_norm.py:44 in 0.19.2, 27 in 0.16.1); GPU jobs
    without apex too. Built as megatron's own FusedLayerNorm does it (fused_layer_norm.py:124/
    133): the weight stored as gamma - 1, initialised to zero, applied as 1 + weight."""
    import torch

    torch_norm = importlib.import_module("megatron.core.transformer.torch_norm")
    original_new = torch_norm.WrappedTorchNorm.__new__
    if getattr(original_new, "_ucp_zero_centered", False):
        return

    @functools.wraps(original_new)
    def new(cls, config, *args, **kwargs):
        if not getattr(config, "layernorm_zero_centered_gamma", False):
            return original_new(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.layernorm_zero_centered_gamma = False
        norm = original_new(cls, plain, *args, **kwargs)
        norm.__class__ = _ZERO_CENTERED[type(norm)]
        with torch.no_grad():
            norm.weight.zero_()
        return norm

    new._ucp_zero_centered = True
    torch_norm.WrappedTorchNorm.__new__ = new


def _zero_centered_classes() -> dict:
    """torch's LayerNorm and RMSNorm -> their zero-centered-gamma versions (1 + weight)."""
    import torch
    import torch.nn.functional as F

    class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)

    classes = {torch.nn.LayerNorm: ZeroCenteredLayerNorm}
    if hasattr(torch.nn, "RMSNorm"):
        class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
            def forward(self, x):
                return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)

        classes[torch.nn.RMSNorm] = ZeroCenteredRMSNorm
    return classes


_ZERO_CENTERED = {}


def _router_gemm_without_te():
    """moe_utils refers to `te_general_gemm` even when TE failed to import (NameError)."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _torch_adam_state_before_load():
    """With torch's Adam (no apex/TE), a never-stepped optimizer has no per-param 'step', and
    DistributedOptimizer.state_dict() asserts a unique one: give it the zero state Adam starts from."""
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    original = distrib.DistributedOptimizer.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        if is_loading:
            init_torch_adam_state(self.optimizer)
        return original(self, model_sharded_state_dict or {}, is_loading, *args, **kwargs)

    distrib.DistributedOptimizer.sharded_state_dict = sharded_state_dict


def _torch_adam_state_copy():
    """Copying loaded state into torch-Adam main params (leaf tensors that require grad) needs
    no_grad; torch Adam's per-param 'step' comes from the param groups (load_state_dict sets it
    just before), not from the per-parameter tensors, whose 'step' is absent or stale: skip it."""
    import torch

    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    original = distrib.DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destinations = {"param": main_param, **self.optimizer.state[main_param]}
        with torch.no_grad():
            for key, destination in destinations.items():
                if key != "step" and key in tensors:
                    destination.copy_(tensors[key])

    distrib.DistributedOptimizer._set_main_param_and_optimizer_states = set_states

    # load_state_dict hands every param the same 'step' tensor; torch Adam increments it in place
    # once per param, so after one step the count is wrong: give each param its own.
    original_load = distrib.DistributedOptimizer.load_state_dict

    @functools.wraps(original_load)
    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        for param_state in self.optimizer.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()

    distrib.DistributedOptimizer.load_state_dict = load_state_dict


def init_torch_adam_state(optimizer, alloc=None) -> None:
    """Create Adam's initial state (step 0, zero moments) for params that have none yet.

    `alloc` makes the moments (default torch.zeros_like; a loader that fills them all passes
    torch.empty_like and saves a pass over the memory).
    """
    import torch

    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    alloc = alloc or torch.zeros_like
    for group in optimizer.param_groups:
        for p in group["params"]:
            if len(optimizer.state[p]) == 0:
                optimizer.state[p]["step"] = torch.tensor(0.0)
                optimizer.state[p]["exp_avg"] = alloc(p.data)
                optimizer.state[p]["exp_avg_sq"] = alloc(p.data)


def _mla_without_te():
    """Without TE, megatron's TE extension module still imports (its TE classes are mocks), so
    MLA believes it has TE and `isinstance(linear_proj, TELinear)` raises TypeError."""
    mla = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    mla.HAVE_TE = False


def _expert_bias_out_of_place():
    """An expert MLP with biases adds its bias in place, scaled by the router's probabilities, to
    linear_fc2's output (mlp.py:354 in 0.19.2, 247 in 0.16.1): with the local spec at expert
    TP1 x EP1 that output is what _ReduceFromModelParallelRegion returned as-is, a view that
    autograd forbids to modify ("Output 0 of _ReduceFromModelParallelRegion is a view and is
    being modified inplace"); GPU jobs on the local spec fail the same. linear_fc2's output gets
    the scaled bias out of place instead (a forward hook for the call), and megatron's branch,
    seeing no bias left, skips the in-place add: the same sum, in the output's dtype."""
    mlp = importlib.import_module("megatron.core.transformer.mlp")
    original = mlp.MLP.forward
    if getattr(original, "_ucp_bias_out_of_place", False):
        return

    @functools.wraps(original)
    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is None:
            return original(self, hidden_states, per_token_scale, **kwargs)

        def add_bias(module, inputs, result):
            output, bias = result
            if bias is None:
                return result
            return (output + bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)).to(output.dtype), None

        handle = self.linear_fc2.register_forward_hook(add_bias)
        try:
            return original(self, hidden_states, per_token_scale, **kwargs)
        finally:
            handle.remove()

    forward._ucp_bias_out_of_place = True
    mlp.MLP.forward = forward


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    _expert_bias_out_of_place()  # the local spec's, which runs with TE installed too
    if not _have("apex.normalization"):  # the local spec's norm is then torch's
        _ZERO_CENTERED.update(_zero_centered_classes())
        _zero_centered_norms()
    if not _have("transformer_engine") and not _have("apex.normalization"):
        _torch_norm_with_sequence_parallel()
    if not _have("transformer_engine"):
        _router_gemm_without_te()
        _mla_without_te()
    if not _have("transformer_engine") and not _have("apex.optimizers"):
        _torch_adam_state_before_load()
        _torch_adam_state_copy()
    _APPLIED = True
