"""Megatron-FSDP (`--use-megatron-fsdp`) in CPU mode: its CUDA assumptions answered for CPU
processes over gloo, each naming the megatron-core 0.19.2 line it answers. Part of cpu_mode;
GPU runs never import it."""

import importlib

import torch

_FSDP = "megatron.core.distributed.fsdp"
_MODULES = (f"{_FSDP}.mcore_fsdp_adapter", f"{_FSDP}.src.megatron_fsdp.megatron_fsdp",
            f"{_FSDP}.src.megatron_fsdp.param_and_grad_buffer", f"{_FSDP}.src.megatron_fsdp.mixed_precision",
            f"{_FSDP}.src.megatron_fsdp.uneven_dtensor", f"{_FSDP}.src.megatron_fsdp.fully_shard",
            f"{_FSDP}.src.megatron_fsdp.utils")


def _cpu_device(*args, **kwargs):
    """torch.device as Megatron-FSDP builds it: 'cuda' and f'cuda:{current_device()}' (which is
    'cuda:cpu' here; mcore_fsdp_adapter.py:156, megatron_fsdp.py:232/234) name the CPU."""
    if args and isinstance(args[0], str) and args[0].startswith("cuda"):
        return torch.device("cpu")
    return torch.device(*args, **kwargs)


class _DeviceMeta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, torch.device)


class _Device(metaclass=_DeviceMeta):
    """`torch.device` inside Megatron-FSDP's modules: constructs as _cpu_device, checks as torch.device."""

    def __new__(cls, *args, **kwargs):
        return _cpu_device(*args, **kwargs)


def enable(torch_on_cpu, device_mesh) -> None:
    """`torch_on_cpu`: cpu_mode's module-level torch stand-in class; `device_mesh`: its CPU
    DeviceMesh (the adapter's meshes ask 'cuda', mcore_fsdp_adapter.py:409-449)."""
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # no einops: megatron says so when the flag asks for it
            return
        stand_in = torch_on_cpu()
        stand_in.device = _Device
        module.torch = stand_in
        if hasattr(module, "DeviceMesh"):
            module.DeviceMesh = device_mesh
