"""CPU/gloo mode for Megatron-LM's trainer (`--cpu`): what megatron.training assumes of CUDA,
answered for CPU processes. On top of megatron_ucp.mcore.cpu_mode (megatron-core's own
assumptions); each accommodation names the megatron-core 0.19.2 line it answers. Enabled only
by `python -m megatron_ucp.megatron_lm --cpu` (tests, demos); the GPU path never imports it.
"""

import functools
import importlib
import os
import types

import torch

from megatron_ucp.mcore import cpu_mode

_HELD = []  # context managers entered for the life of the process

# Trainer modules that make tensors with a literal device='cuda' on the training path.
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.training.training",  # start-time all-reduce (1131/1137), loss dict (2613/2884), exit-duration flag (3298)
    "megatron.core.rerun_state_machine",  # result validation, every step (264/268)
    "megatron.training.checkpointing",  # rank-count tensor (375)
    "megatron.training.utils",  # loss averaging and report buffers
)


class _InitializeTorch(cpu_mode._TorchOnCpu):
    """`torch` as megatron.training.initialize sees it: one CPU 'device' per process.

    initialize.py:66 asserts torch.cuda.is_available() (pretrain passes no allow_no_cuda), and
    270/352/447 skip the model-parallel groups and the RNG tracker when device_count() is 0.
    """

    def __init__(self):
        super().__init__()
        self.cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1)
        for name in ("set_device", "current_device", "synchronize", "empty_cache", "Stream",
                     "set_stream", "get_rng_state", "set_rng_state"):
            if hasattr(torch.cuda, name):
                setattr(self.cuda, name, getattr(torch.cuda, name))


def _no_cuda_generator():
    """A CPU process has no CUDA generator: megatron saves and restores one every step
    (rerun_state_machine.py:979/992) and in its checkpoints (checkpointing.py:417/2665/2677);
    an empty state stands for it. Activation recomputation saves and restores it around every
    recomputed chunk (tensor_parallel/random.py:528/538, through _get/_set_cuda_rng_state at
    104/135); the CPU generator, which a CPU process's dropout draws from, is saved beside it."""
    torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *a, **k: None
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    random._set_cuda_rng_state = lambda *a, **k: None


def _named(value) -> str:
    return getattr(value, "name", value)  # AttnBackend.fused -> 'fused'


# Flags a CPU process accepts and then ignores, where it builds the local spec (no
# transformer-engine): (attribute, whether the run asks for it, what happens instead). A run with
# them trains as without them (losses bit-identical), so each gets a line at start-up.
IGNORED_ON_CPU = (
    ("fp8", lambda v: v is not None,
     "--fp8-format: fp8 is transformer-engine's; the local spec computes in --bf16/--fp16/fp32"),
    ("fp4", lambda v: v is not None,
     "--fp4-format: fp4 is transformer-engine's; the local spec computes in --bf16/--fp16/fp32"),
    ("fp8_param_gather", bool, "--fp8-param-gather: no fp8 parameters without transformer-engine"),
    ("fp4_param_gather", bool, "--fp4-param-gather: no fp4 parameters without transformer-engine"),
    ("attention_backend", lambda v: _named(v) not in ("auto", "local"),
     "--attention-backend: the local spec's attention is megatron's DotProductAttention (or the CPU "
     "mode's own where that refuses the layer), whatever backend is named"),
    ("use_flash_attn", bool, "--use-flash-attn: flash attention is a CUDA kernel; the local spec's attention runs"),
)


def ignored_flags(args) -> list:
    """One line for each flag of `args` that the CPU mode's local spec accepts and ignores."""
    if getattr(args, "transformer_impl", "local") != "local":
        return []
    return [f"WARNING: --cpu ignores {words} ({_named(getattr(args, name))!s:.40} given)"
            for name, asked, words in IGNORED_ON_CPU if asked(getattr(args, name, None))]


def _stream_connections_as_flags_want(arguments):
    """arguments.py:1437 wants CUDA_DEVICE_MAX_CONNECTIONS=1 under TP or CP, and 1014 anything
    else under FSDP: CUDA stream settings, which a CPU process meets as whatever its flags ask.
    The same wrap says which given flags the CPU mode ignores (IGNORED_ON_CPU), on rank 0."""
    original = arguments.validate_args

    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        else:
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        result = original(args, *rest, **kwargs)
        if int(os.environ.get("RANK", "0")) == 0:
            for line in ignored_flags(args):
                print(line, flush=True)
        return result

    from megatron_ucp.megatron_lm.patching import replace_everywhere

    replace_everywhere(original, validate_args)


def _stand_in_optimizer():
    """megatron's distributed optimizer cannot load its torch_dist state into torch's AdamW
    (distrib_optimizer: `assert len(steps) == 1`, KeyError 'step'); GPU runs use TE's FusedAdam,
    whose contract the stand-in keeps (mcore/fused_adam_standin.py), for the whole process."""
    from megatron_ucp.mcore import fused_adam_standin

    # Held for the life of the process: a context manager left unreferenced is closed, and its
    # exit puts torch's AdamW back (the stand-in went unused in the trainer until this was held).
    _HELD.append(fused_adam_standin.installed())
    _HELD[-1].__enter__()


def enable() -> None:
    """Turn the trainer's CPU mode on in this process (idempotent through cpu_mode)."""
    if cpu_mode.is_enabled():
        return
    cpu_mode.enable()
    for name in _MODULES_WITH_CUDA_LITERALS:
        importlib.import_module(name).torch = cpu_mode._TorchOnCpu()
    initialize = importlib.import_module("megatron.training.initialize")
    initialize.torch = _InitializeTorch()
    # initialize.py:494-558: the JIT warm-up of the fused bias-GeLU/dropout kernels runs on 'cuda'.
    initialize._warmup_jit_function = lambda *a, **k: None
    # A Megatron-LM 0.16 clone's initialize.py:224/228 builds megatron/legacy's fused softmax
    # kernels with nvcc (fused_kernels.load: CUDA_HOME + "/bin/nvcc", a TypeError where there is
    # no CUDA); a CPU process uses none of them (0.17 and later no longer build them).
    if hasattr(initialize, "fused_kernels"):
        initialize.fused_kernels = types.SimpleNamespace(load=lambda *a, **k: None)
    # arguments.py:1414: get_device_arch_version() asks torch.cuda.get_device_properties; a CPU
    # process takes the pre-Blackwell answer, and with it 1437's demand for one CUDA stream
    # connection under TP, which a process without CUDA streams meets as set.
    arguments = importlib.import_module("megatron.training.arguments")
    arguments.get_device_arch_version = lambda: 0
    _stream_connections_as_flags_want(arguments)
    _no_cuda_generator()
    _stand_in_optimizer()
