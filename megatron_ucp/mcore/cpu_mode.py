"""CPU/gloo mode: let unmodified megatron-core models train on CPU processes over gloo.

megatron-core assumes CUDA in a handful of places. Each accommodation below has a one-line
reason. Nothing here runs unless `enable()` is called (by `--cpu` and by the tests); the GPU
path never imports this module. Patches are process-wide and idempotent.
"""

import contextlib
import functools
import importlib

import torch

from megatron_ucp.mcore import cpu_fsdp

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
    "megatron.core.models.common.embeddings.rope_utils",  # CP chunk index, pin_memory (0.19.2: 62)
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


class _DoneEvent:
    """An event on a CPU 'stream': the work before it is done when it is recorded."""

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def record(self, *args, **kwargs):
        pass


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
        return _DoneEvent()  # Megatron-FSDP waits on them (param_and_grad_buffer.py:3945/4251)


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

    from megatron_ucp.mcore.compat import core_version

    fs_async = importlib.import_module("megatron.core.dist_checkpointing.strategies.filesystem_async")

    def results_queue(*args, **kwargs):
        if fs_async._results_queue is None:
            fs_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        return fs_async._results_queue

    # 0.19 made it public, with the context as an argument (default still 'spawn'); its
    # callers import it from the module at call time.
    name = "get_write_results_queue" if core_version() >= (0, 19) else "_get_write_results_queue"
    setattr(fs_async, name, results_queue)


class _SharedKeyChannelsGrad(torch.autograd.Function):
    """Identity forward; backward completes the grad of key channels that every head shares.

    MLA's rotary key (the last qk_pos_emb_head_dim channels) is one vector for all heads, split
    off a gathered ColumnParallelLinear output in megatron-core 0.16.1's local spec; its grad then
    holds only this rank's heads (the gather's backward takes a slice, sums nothing). Adding the
    other TP ranks' head sums here makes the grad the whole model's, as transformer-engine's
    spec gets it.
    """

    @staticmethod
    def forward(ctx, key, channels, group):
        ctx.channels, ctx.group = channels, group
        return key.view_as(key)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.clone()
        shared = grad[..., -ctx.channels:]  # [s, b, local heads, channels]
        local = shared.sum(dim=2, keepdim=True)
        total = local.clone()
        dist.all_reduce(total, group=ctx.group)
        grad[..., -ctx.channels:] = shared + (total - local) / shared.shape[2]
        return grad, None, None


class CpuCoreAttention(torch.nn.Module):
    """Causal softmax attention in plain torch whose key and value heads may differ in size.

    Reason: megatron-core's local DotProductAttention has one head size and refuses MLA's
    `k_channels`/`v_channels`; transformer-engine's attention (the GPU path) takes them.
    Follows DotProductAttention otherwise: query/key/value [s, b, heads, dim] with TP-local
    heads (query groups repeated), the softmax scale MLA passes, megatron's mask fill value,
    softmax in fp32, attention dropout under the tensor-parallel RNG; returns [s, b, heads x v_dim].
    With MLA on TP > 1 it also completes the shared rotary key's grad (_SharedKeyChannelsGrad).
    With context parallelism (megatron's DotProductAttention refuses it,
    dot_product_attention.py:58 in 0.19.2) it all-gathers key and value in megatron's
    load-balanced chunk order (mcore/context_parallel.py) and masks by global position.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None):
        super().__init__()
        from megatron.core import parallel_state

        self.config = config
        self.cp_group = (pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp")
                         else parallel_state.get_context_parallel_group()) \
            if config.context_parallel_size > 1 else None
        self.attn_mask_type = attn_mask_type
        self.tp_group = pg_collection.tp if pg_collection is not None else \
            parallel_state.get_tensor_model_parallel_group()
        tp = self.tp_group.size()
        self.shared_key_channels = config.qk_pos_emb_head_dim \
            if getattr(config, "multi_latent_attention", False) and tp > 1 else 0
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        # megatron's query-key layer scaling divides by the layer number and multiplies back
        # inside its fp32 softmax: the same scale.
        self.softmax_scale = softmax_scale if softmax_scale is not None else k_channels ** -0.5
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None
                                        else attention_dropout)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core import tensor_parallel
        from megatron.core.transformer.enums import AttnMaskType

        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("CpuCoreAttention: packed sequences and attention bias are not supported")
        if self.shared_key_channels and key.requires_grad:
            key = _SharedKeyChannelsGrad.apply(key, self.shared_key_channels, self.tp_group)
        queries_at = None
        if self.cp_group is not None:
            from megatron_ucp.mcore import context_parallel

            key = context_parallel.GatherSequence.apply(key, self.cp_group)
            value = context_parallel.GatherSequence.apply(value, self.cp_group)
            queries_at = torch.tensor(context_parallel.positions_of_rank(
                self.cp_group.size(), self.cp_group.rank(), query.shape[0]), device=query.device)
        if self.heads != self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) * self.softmax_scale
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        if attention_mask is None and causal:
            sq, sk = scores.shape[-2:]
            if queries_at is None:
                queries_at = torch.arange(sq, device=scores.device)
            attention_mask = torch.arange(sk, device=scores.device)[None, :] > queries_at[:, None]
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask, -10000.0)  # megatron's attention_mask_func
        probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
        if self.config.sequence_parallel:
            probs = self.dropout(probs)
        else:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.dropout(probs)
        context = torch.einsum("bhst,tbhd->sbhd", probs, value)
        return context.reshape(context.shape[0], context.shape[1], self.heads * self.v_channels)


class LocalOrContextParallelAttention:
    """The local spec's core attention in CPU mode: megatron's own DotProductAttention, or
    CpuCoreAttention where that refuses the layer and transformer-engine's attention (the GPU
    path) takes it: context parallelism (dot_product_attention.py:58 in 0.19.2) and MLA's
    separate key and value head sizes (multi_latent_attention.py:214, `k_channels`/`v_channels`,
    which DotProductAttention does not take)."""

    def __new__(cls, *args, **kwargs):
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        config = kwargs["config"] if "config" in kwargs else args[0]
        own_head_sizes = kwargs.get("k_channels") is not None or kwargs.get("v_channels") is not None
        chosen = CpuCoreAttention if config.context_parallel_size > 1 or own_head_sizes else DotProductAttention
        return chosen(*args, **kwargs)


def _patch_local_attention():
    """backends.py:129 (0.19.2) names the local spec's core attention; the spec functions ask it."""
    backends = importlib.import_module("megatron.core.models.backends")
    backends.LocalSpecProvider.core_attention = lambda self: LocalOrContextParallelAttention


class _CpuDeviceMesh:
    """torch's DeviceMesh, whose meshes asked for 'cuda' are CPU meshes (gloo's)."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group, "cpu" if device_type.startswith("cuda") else device_type,
                                     *args, **kwargs)

    def __getattr__(self, name):
        from torch.distributed.device_mesh import DeviceMesh

        return getattr(DeviceMesh, name)


def _patch_fsdp2_mesh():
    """torch_fully_sharded_data_parallel.py:81 (0.19.2) builds FSDP2's mesh on 'cuda'."""
    try:
        fsdp2 = importlib.import_module("megatron.core.distributed.torch_fully_sharded_data_parallel")
    except ImportError:
        return
    if hasattr(fsdp2, "DeviceMesh"):
        fsdp2.DeviceMesh = _CpuDeviceMesh


# megatron-core modules that imported torch's `_coalescing_manager` by name.
_MODULES_COALESCING = (
    "megatron.core.distributed.param_and_grad_buffer",  # DDP buckets with --overlap-param-gather
    "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",  # Megatron-FSDP gathers
)


def _synchronous(coalescing_manager):
    """`coalescing_manager` with its collectives always run to completion before it exits: the
    handle it yields then holds no work and its wait() returns at once."""
    if getattr(coalescing_manager, "ucp_synchronous", False):
        return coalescing_manager

    @functools.wraps(coalescing_manager)
    def synchronous(group=None, device=None, async_ops=False):
        return coalescing_manager(group, device, async_ops=False)

    synchronous.ucp_synchronous = True
    return synchronous


def _patch_coalescing():
    """gloo's asynchronous coalesced all-gather (`all_gather_into_tensor` inside
    `_coalescing_manager(async_ops=True)`, ProcessGroupGloo's allgather_into_tensor_coalesced)
    corrupts the heap now and then, torch 2.13 and 2.14 alike: "malloc(): unaligned tcache chunk
    detected" or SIGSEGV in its worker thread; the synchronous form, plain asynchronous
    all-gathers and coalesced reduce-scatters do not (benchmarks/gloo_coalesced_allgather.py, no
    megatron). Megatron-FSDP gathers every parameter bucket that way
    (megatron_fsdp/param_and_grad_buffer.py:4561, 0.19.2), megatron's DDP its buckets with
    --overlap-param-gather (distributed/param_and_grad_buffer.py:504 in 0.19.2, 274 in 0.16.1),
    and generalized tensor parallelism looks it up on torch.distributed
    (generalized_tensor_parallelism.py:1584/2016, 0.19.2); on CPU they all run synchronously."""
    import torch.distributed as dist

    dist._coalescing_manager = _synchronous(dist._coalescing_manager)  # callers that look it up
    for name in _MODULES_COALESCING:
        try:
            module = importlib.import_module(name)
        except ImportError:  # Megatron-FSDP without einops: megatron says so if asked for it
            continue
        module._coalescing_manager = _synchronous(module._coalescing_manager)


def _split_sizes_as_numpy():
    """The alltoall MoE dispatcher takes its split sizes as numpy arrays from
    moe_utils.maybe_move_tensor_to_cpu(as_numpy=True) (token_dispatcher.py:927-943 in 0.19.2,
    876-892 in 0.16.1), which converts CUDA tensors only (moe_utils.py:1184; 1093): on CPU they
    stay tensors, which gloo's all_to_all_single refuses (TypeError: it takes lists of ints). A
    CPU tensor asked for as numpy is given as numpy, as the GPU path gets it."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "ucp_cpu_numpy", False):
        return

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy, record_stream)

    maybe_move_tensor_to_cpu.ucp_cpu_numpy = True
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    if getattr(dispatcher, "maybe_move_tensor_to_cpu", None) is original:  # imported by name
        dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def enable() -> None:
    """Turn on CPU mode in this process (idempotent). Call before building models."""
    global _ENABLED
    if _ENABLED:
        return
    _patch_torch_cuda()
    _patch_modules()
    _patch_rng_tracker()
    _patch_local_attention()
    _patch_fsdp2_mesh()
    _patch_coalescing()
    _split_sizes_as_numpy()
    cpu_fsdp.enable(_TorchOnCpu, _CpuDeviceMesh)
    _fork_checkpoint_queue()
    _ENABLED = True
