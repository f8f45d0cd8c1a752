"""CPU/gloo mode: let unmodified megatron-core models train on CPU processes over gloo.

megatron-core assumes CUDA in a handful of places. Each accommodation below has a one-line
reason. Nothing here runs unless `enable()` is called (by `--cpu` and by the tests); the GPU
path never imports this module. Patches are process-wide and idempotent.
"""

import contextlib
import functools
import importlib

import torch

_ENABLED = False

# megatron-core modules that create tensors with a literal device='cuda' on our training path.
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens counter
    "megatron.core.optimizer.optimizer",  # found_inf / overflow buffers, constant scale
    "megatron.core.optimizer.distrib_optimizer",  # shard buffers during state gather/scatter
    "megatron.core.optimizer.clip_grads",  # total-norm all-reduce buffer
    "megatron.core.optimizer.grad_scaler",  # loss-scale tensors
    "megatron.core.distributed.param_and_grad_buffer",  # warm-up tensor, bucket buffers
    "megatron.core.utils",  # norm and hash helpers
    "megatron.core.tensor_parallel.data",  # broadcast_data size buffers
    "megatron.core.models.gpt.gpt_model",  # MTP / loss helper buffers
    "megatron.core.transformer.utils",  # default causal attention mask
    "megatron.core.transformer.moe.moe_utils",  # MoE load-balancing trackers
)


def is_enabled() -> bool:
    return _ENABLED


def _to_cpu_device(device):
    """Map any CUDA device spec (string, index or torch.device) to the CPU."""
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


class _TorchOnCpu:
    """Stands in for `torch` inside one megatron module: factories asked for 'cuda' get the CPU."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like")

    def __init__(self):
        for name in self._FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


class _DummyStream:
    """CPU ops are synchronous: a stream that orders nothing is exact."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return None


def _patch_torch_cuda():
    """CUDA queries that megatron-core calls unconditionally, answered for a CPU process."""
    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")  # used as `device=` in ~30 places
    cuda.synchronize = lambda *a, **k: None  # CPU work is synchronous
    cuda.empty_cache = lambda *a, **k: None  # no caching allocator on CPU
    cuda.Stream = _DummyStream  # DDP's communication stream, MoE dispatcher streams
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.current_stream = lambda *a, **k: _DummyStream()
    cuda.default_stream = lambda *a, **k: _DummyStream()
    cuda.manual_seed = lambda seed: None  # the CPU generator is seeded by our tracker
    cuda.set_device = lambda *a, **k: None  # one CPU "device" per process
    torch.Tensor.cuda = lambda self, *a, **k: self  # the CPU is this process's device


@contextlib.contextmanager
def _cpu_tensors_named_as_cuda():
    """megatron-core's optimizers classify params by `tensor.type()` == 'torch.cuda.*Tensor'."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cpu_tensors_named_as_cuda():
            return fn(*args, **kwargs)

    return wrapper


class CpuRNGStatesTracker:
    """Megatron's named RNG states (data-parallel, tensor-parallel, expert) kept as CPU generator states.

    `fork(name)` swaps the named state into torch's default CPU generator for the duration of the
    block, exactly as megatron's CUDA tracker does with the CUDA generator.
    """

    def __init__(self, *args, **kwargs):
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self):
        return bool(self.states_)

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states):
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name, seed):
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} is not added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def _patch_rng_tracker():
    """Megatron's tracker drives CUDA generators; ours drives the CPU one with the same seeds."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random.CudaRNGStatesTracker = CpuRNGStatesTracker
    random.initialize_rng_tracker(force_reset=True)


def _patch_modules():
    for name in _MODULES_WITH_CUDA_LITERALS:
        importlib.import_module(name).torch = _TorchOnCpu()

    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    distrib = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    # Parameter classification by tensor.type() in the optimizers' constructors.
    distrib.DistributedOptimizer.__init__ = _with_cuda_type_names(
        distrib.DistributedOptimizer.__init__
    )
    optimizer.Float16OptimizerWithFloat16Params.__init__ = _with_cuda_type_names(
        optimizer.Float16OptimizerWithFloat16Params.__init__
    )
    # clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor'.
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = clip
    optimizer.clip_grad_by_total_norm_fp32 = clip


def _fork_checkpoint_queue():
    """megatron's torch_dist writer starts its results-queue Manager with 'spawn', which
    re-imports the main module in a fresh interpreter (tens of seconds per rank on a small CPU
    machine); without CUDA in the process, 'fork' is safe and immediate."""
    import multiprocessing

    fs_async = importlib.import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")

    def results_queue():
        if fs_async._results_queue is None:
            fs_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        return fs_async._results_queue

    fs_async._get_write_results_queue = results_queue


def enable() -> None:
    """Turn on CPU mode in this process (idempotent). Call before building models."""
    global _ENABLED
    if _ENABLED:
        return
    _patch_torch_cuda()
    _patch_modules()
    _patch_rng_tracker()
    _fork_checkpoint_queue()
    _ENABLED = True
