"""CPU/gloo mode for Megatron-Bridge's trainer (tests, demos): what megatron-bridge 0.6.2
assumes of CUDA, answered for CPU processes, on top of the project's CPU mode for megatron-core
(mcore/cpu_mode.py) and the pieces of Megatron-LM's (megatron_lm/cpu.py) that Bridge shares
(megatron-core's rerun state machine, the CUDA generator, the FusedAdam stand-in). Each patch
names the Bridge line it answers. Enabled only by `megatron_ucp.bridge.install(cpu=True)`; a GPU
run never imports this module.
"""

import importlib

from megatron_ucp.mcore import cpu_mode
from megatron_ucp.megatron_lm import cpu as trainer_cpu

# Bridge modules that make tensors with a literal device="cuda" on the training path.
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.bridge.training.setup",  # start-time all-reduce (281)
    "megatron.bridge.training.train",  # exit-duration flag (1461)
    "megatron.bridge.training.eval",  # exit-duration flag (314)
    "megatron.bridge.training.checkpointing",  # iteration check across ranks (326)
    "megatron.bridge.training.utils.train_utils",  # grad norms (381-486), loss dicts (769/1210)
    "megatron.bridge.data.loaders",  # do_train/valid/test flags broadcast (250/406)
    "megatron.core.rerun_state_machine",  # result validation, every step (megatron-core 264/268)
)


def enable() -> None:
    """Turn Bridge's CPU mode on in this process (idempotent through cpu_mode)."""
    if cpu_mode.is_enabled():
        return
    cpu_mode.enable()
    for name in _MODULES_WITH_CUDA_LITERALS:
        importlib.import_module(name).torch = cpu_mode._TorchOnCpu()
    initialize = importlib.import_module("megatron.bridge.training.initialize")
    # initialize.py:91 asserts torch.cuda.is_available(); 706 and 869 skip set_device and the
    # model-parallel RNG tracker (the CPU one, cpu_mode) when device_count() is 0.
    initialize.torch = trainer_cpu._InitializeTorch()
    # initialize.py:311 -> 886-973: the JIT warm-up of the fused bias-GeLU/SwiGLU/dropout kernels
    # makes its inputs on "cuda" (898-944).
    initialize._warmup_jit_function = lambda *a, **k: None
    trainer_cpu._no_cuda_generator()
    trainer_cpu._stand_in_optimizer()
