"""Convert Megatron-LM's legacy per-rank `torch` checkpoint into a universal one, streaming.

No GPU and no process group: each `mp_rank_TT[_PPP]/model_optim_rng.pt` holds whole TP-local
tensors (and `distrib_optim.pt` the distributed optimizer's state gathered over data
parallelism), so every atomic tensor is assembled from the TP ranks' files of one pipeline stage
and written once. Its name, packed halves and vocabulary rows are megatron's description of the
model (model_map, on a meta-device model built from the stored arguments); how the source split
it over TP follows from the saved local shapes (`layout.infer_rule`). Files are opened
with `torch.load(mmap=True)` for each atomic tensor and closed after it, so memory holds a few
atomic tensors, not the checkpoint. `workers` processes convert tensors in parallel.

What megatron keeps implicit is derived here by pure functions, each checked against what the
checkpoint records: the parameter order of megatron's optimizer groups (checked against the
stored groups' sizes and every moment's shape) and the distributed optimizer's buffer layout
(checked against the stored `numel_unpadded` of every buffer).
"""

import argparse
import fnmatch
import math
import os
import re
import time
from dataclasses import dataclass, field

import numpy as np

from megatron_ucp.convert import writer as stream_write
from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError, LayoutError
from megatron_ucp.format import manifest as mf
from megatron_ucp.format.layout import (PADDING, Rule, atomic_shape_from_local, infer_rule, layer_offset,
                                        local_shape, pieces)
from megatron_ucp.mcore.optimizer_state import plain_groups, saved_steps

MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


# ---------------------------------------------------------------- pure rules


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """Megatron-LM's per-rank folder: mp_rank_TT, or mp_rank_TT_PPP with pipeline parallelism."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def is_legacy(directory: str) -> bool:
    """An iteration folder of Megatron-LM's legacy per-rank format."""
    return os.path.isdir(directory) and any(
        _RANK_DIR.match(n) and os.path.isdir(os.path.join(directory, n)) for n in os.listdir(directory))


def parse_rank_dir(name: str):
    """'mp_rank_01_002' -> (tp_rank 1, pp_rank 2); expert-parallel folders are refused."""
    m = _RANK_DIR.match(name)
    if not m:
        return None
    if m.group(3) is not None:
        raise LayoutError(f"{name}: expert-parallel legacy checkpoints (mp_rank_TT_PPP_EEE) are not supported")
    return int(m.group(1)), int(m.group(2) or 0)


def model_geometry(a: dict, world: int, vocab: int, padded: int):
    """Module name in the whole model (global layer numbers) -> megatron's description of that
    parameter (model_map): its atomic name, shape, packed halves and vocabulary rows; and the
    model's architecture record (manifest.architecture). The model
    is built from the checkpoint's arguments on the meta device, in one process (TP = PP = 1);
    how the source layout split each tensor follows from the saved local shapes (infer_rule)."""
    from megatron_ucp.convert.source_model import (argv_from_args, meta_model, single_process_megatron,
                                                   source_args)
    from megatron_ucp.mcore.model_map import geometry

    source = source_args(argv_from_args(a) + ["--cpu"], world)
    with single_process_megatron():
        gpt = meta_model(source, padded)
        found = {id(g.tensor): g for g in geometry(gpt, vocab)}
        described = {n: found[id(p)] for n, p in gpt.named_parameters() if id(p) in found}
        return described, mf.architecture(gpt, vocab)


def global_name(local_name: str, num_layers: int, pp: int, pp_rank: int, vpp: int | None,
                vp_stage: int | None, layers_in_chunk: int) -> str:
    """Local layer index of (pp_rank, vp_stage) -> global layer number (the whole model's
    module name)."""
    m = _LAYER.match(local_name)
    if not m:
        return local_name
    per_chunk = num_layers // (pp * (vpp or 1))
    if layers_in_chunk != per_chunk:
        raise LayoutError(f"pipeline rank {pp_rank} stage {vp_stage}: {layers_in_chunk} layers, the even "
                          f"split of {num_layers} layers gives {per_chunk}; uneven splits are not supported")
    index = int(m.group(1))
    return f"decoder.layers.{layer_offset(num_layers, pp, pp_rank, vpp, vp_stage) + index}.{m.group(2)}"


def no_weight_decay(name: str, shape) -> bool:
    """megatron-core's standard override: biases and 1-D parameters get wd_mult 0."""
    return len(shape) == 1 or fnmatch.fnmatch(name, "*.bias")


def bucket_layout(params, dp: int, bucket_size: int | None, pad_for_high_busbw: bool = False):
    """Where each parameter lies in the distributed optimizer's buckets of one buffer.

    params: [(name, numel, shared_embedding)] in the model's parameter order. Mirrors
    megatron-core 0.16's `_ParamAndGradBuffer` (distributed optimizer; the same rules moved to
    `DistributedOptimizer._compute_per_buffer_param_layout` and `optimizer/param_layout.py` in
    0.19): parameters in reverse
    order, each start padded to 64 elements, bucket ends padded to lcm(dp, 128) (and 2^16 with
    `pad_buckets_for_high_nccl_busbw`), the shared embedding in a bucket of its own. Returns
    ({name: (bucket, offset in the bucket, numel)}, [each bucket's numel without its end padding]).
    """
    divisor = math.lcm(dp, 128, 2**16) if pad_for_high_busbw else math.lcm(dp, 128)

    def pad(n, d):
        return -(-n // d) * d

    index, buckets = {}, []
    bucket_start, start, in_bucket = 0, 0, 0
    end = 0

    def close(end_index):
        nonlocal bucket_start, in_bucket
        buckets.append(end_index - bucket_start)
        bucket_start, in_bucket = pad(end_index, divisor), 0
        return bucket_start

    for name, numel, shared in reversed(list(params)):
        start = pad(start, 64)
        if shared and in_bucket:
            start = close(start)
        end = start + numel
        index[name] = (len(buckets), start - bucket_start, numel)
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    return index, buckets


def buffer_offsets(params, dp: int, bucket_size: int | None, pad_for_high_busbw: bool = False):
    """Offsets of each parameter in the distributed optimizer's saved flat state of one buffer
    (megatron's `get_parameter_state_dp_zero`: the buckets concatenated without their end
    padding). Returns ({name: (offset, numel)}, numel_unpadded)."""
    index, buckets = bucket_layout(params, dp, bucket_size, pad_for_high_busbw)
    starts = [sum(buckets[:b]) for b in range(len(buckets))]
    return {name: (starts[b] + offset, numel) for name, (b, offset, numel) in index.items()}, sum(buckets)


def global_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    """megatron-core's default rank order (tp-cp-ep-dp-pp) without context parallelism."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


# ---------------------------------------------------------------- reading


_LOADED: dict = {}  # path -> the file's objects, tensors mmap'ed (per process)


def _torch_load(path: str):
    """torch.load(mmap=True, weights_only=True), once per file and process: tensor data stays
    on disk until read, and `_release` gives the pages back after use."""
    from megatron_ucp.convert.safe_pickle import load_file

    if path in _LOADED:
        return _LOADED[path]
    if not os.path.lexists(path):
        raise IncompleteCheckpointError(f"{path}: missing")
    obj = load_file(path, "legacy checkpoint file", mmap=True)  # weights_only: no code runs from it
    _LOADED[path] = obj
    return obj


_PAGE = os.sysconf("SC_PAGE_SIZE")
_MADV_DONTNEED = 4


def _release(t) -> None:
    """Drop the resident pages of an mmap'ed tensor (read-only private mapping: they are
    re-read from the file if touched again), so memory stays bounded by the tensors in flight."""
    import ctypes

    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    start = t.data_ptr() // _PAGE * _PAGE
    length = -(-(t.data_ptr() + nbytes - start) // _PAGE) * _PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED)


def _plain(args) -> dict:
    if isinstance(args, argparse.Namespace):
        return vars(args)
    return dict(args) if isinstance(args, dict) else {}


@dataclass
class Source:
    """Where one TP rank's slice of an atomic tensor lives."""

    tp_rank: int
    rank_dir: str
    chunk_key: str  # 'model', 'model0', ...
    chunk: int
    local_name: str
    opt_index: int | None = None  # plain optimizer: index into the torch state
    flat: tuple | None = None  # distributed optimizer: (buffer index, offset, numel)


@dataclass
class Atomic:
    name: str
    rule: Rule
    shape: tuple
    padding_rows: int
    local_shape: tuple
    sources: list = field(default_factory=list)


@dataclass
class Plan:
    """Everything the workers need (picklable, small)."""

    iteration: int
    args: dict
    tp: int
    pp: int
    vpp: int | None
    dp: int | None
    dist_opt: bool
    atomics: dict
    step: int
    param_groups: list
    scheduler: dict | None
    consumed: int
    rng: dict  # global rank -> RNG state in our JSON form (empty when not ours)
    architecture: dict  # manifest.architecture of the model the stored arguments build


_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "tensor_model_parallel_size",
             "pipeline_model_parallel_size", "vocab_size")


def _setting(args: dict, overrides: dict, key: str):
    return overrides[key] if key in overrides else args.get(key)


def plan_conversion(iter_dir: str, overrides: dict | None = None) -> Plan:
    """Read the small parts of every rank's file (mmap) and map every tensor; no tensor data."""
    overrides = dict(overrides or {})
    rank_dirs = {}
    for name in sorted(os.listdir(iter_dir)):
        coords = parse_rank_dir(name)
        if coords is not None:
            rank_dirs[coords] = os.path.join(iter_dir, name)
    if not rank_dirs:
        raise IncompleteCheckpointError(f"{iter_dir}: no mp_rank_* folders; not a legacy torch checkpoint")
    first = _torch_load(os.path.join(rank_dirs[min(rank_dirs)], MODEL_FILE))
    args = _plain(first.get("args"))
    missing = [k for k in _REQUIRED if _setting(args, overrides, k) is None]
    if missing:
        flags = " ".join(f"--{k.replace('_', '-')}" for k in missing)
        raise ConfigError(f"{iter_dir}: the checkpoint's stored args lack {', '.join(missing)}; pass {flags} "
                          "after '--'")
    a = {**args, **overrides}
    tp, pp = int(a["tensor_model_parallel_size"]), int(a["pipeline_model_parallel_size"])
    vpp = a.get("virtual_pipeline_model_parallel_size") or None
    if a.get("num_experts"):
        raise LayoutError(f"{iter_dir}: MoE models are not supported by the legacy converter")
    if int(a.get("context_parallel_size") or 1) != 1:
        raise LayoutError(f"{iter_dir}: context parallelism is not supported by the legacy converter")
    expected = {(t, p) for t in range(tp) for p in range(pp)}
    if set(rank_dirs) != expected:
        raise IncompleteCheckpointError(
            f"{iter_dir}: TP {tp} x PP {pp} needs folders for {sorted(expected)}, found {sorted(rank_dirs)}")
    dist_opt = bool(a.get("use_distributed_optimizer"))
    dp = a.get("data_parallel_size")
    if dp is None and a.get("world_size"):
        dp = int(a["world_size"]) // (tp * pp)
    if dist_opt and a.get("overlap_grad_reduce") and not a.get("ddp_bucket_size") and not dp:
        raise ConfigError(f"{iter_dir}: the distributed optimizer's default bucket size depends on the "
                          "data-parallel size, which the stored args lack; pass --data-parallel-size "
                          "or --ddp-bucket-size after '--'")
    tied = not a.get("untie_embeddings_and_output_weights")
    vocab = int(a["vocab_size"])
    described = architecture = None  # megatron's description of the model, once the padded vocabulary is known
    num_layers = int(a["num_layers"])
    bucket_size = None
    if a.get("overlap_grad_reduce"):
        bucket_size = a.get("ddp_bucket_size") or max(40000000, 1000000 * int(dp or 1))
    atomics: dict = {}
    step, param_groups, scheduler = None, [], first.get("opt_param_scheduler")
    for (tp_rank, pp_rank), rank_dir in sorted(rank_dirs.items()):
        path = os.path.join(rank_dir, MODEL_FILE)
        sd = first if (tp_rank, pp_rank) == min(rank_dirs) else _torch_load(path)
        chunk_keys = ["model"] if "model" in sd else sorted(
            (k for k in sd if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
        if len(chunk_keys) != (vpp or 1):
            raise FormatError(f"{path}: {len(chunk_keys)} model chunks, the args say {vpp or 1} virtual stages")
        # Parameters of every chunk in megatron's order (state dict order, no _extra_state).
        chunk_params = []
        for c, key in enumerate(chunk_keys):
            params = [(n, tuple(t.shape)) for n, t in sd[key].items()
                      if not n.endswith("_extra_state") and hasattr(t, "shape")]
            chunk_params.append(params)
        indices = _optimizer_indices(sd, path, chunk_params, dist_opt)
        offsets = {}
        if dist_opt:
            offsets = _buffer_layout(rank_dir, chunk_params, pp_rank, pp, vpp, tied, int(dp or 1), bucket_size,
                                     bool(a.get("ddp_pad_buckets_for_high_nccl_busbw")))
        s, groups = _step_and_groups(sd, path, dist_opt)
        if step is None:
            step, param_groups = s, groups
        elif s != step:
            raise FormatError(f"{path}: optimizer step {s}, other ranks' {step}")
        for c, params in enumerate(chunk_params):
            vp_stage = c if vpp else None
            layers = {int(m.group(1)) for n, _ in params if (m := _LAYER.match(n))}
            for n, shape in params:
                if n == OUTPUT and tied:
                    continue  # the last stage's copy of the tied embedding
                if described is None:
                    padded = _padded_vocab(sd, chunk_keys, tp, path)
                    if padded < vocab:
                        raise LayoutError(f"{path}: {padded} vocabulary rows over TP {tp}, fewer than --vocab-size "
                                          f"{vocab}")
                    described, architecture = model_geometry(a, tp * pp * int(dp or 1), vocab, padded)
                where = global_name(n, num_layers, pp, pp_rank, vpp, vp_stage, len(layers))
                g = described.get(where)
                if g is None:
                    raise LayoutError(f"{path}: {n} ({where}): the model built from the stored arguments has no "
                                      "such parameter")
                rule = infer_rule(g.atomic_shape, shape, len(g.boxes) > 1, g.padded_rows is not None)
                padded = shape[0] * tp if rule.kind == "vocab" else None
                atomic_shape = atomic_shape_from_local(rule, shape, tp, vocab)
                gname = g.name
                entry = atomics.setdefault(gname, Atomic(gname, rule, atomic_shape,
                                                         (padded - vocab) if padded else 0, shape))
                if entry.shape != atomic_shape or entry.local_shape != shape:
                    raise LayoutError(f"{path}: {n} has local shape {list(shape)}, other TP ranks give "
                                      f"{list(entry.local_shape)}")
                if local_shape(rule, atomic_shape, tp, padded) != shape:
                    raise LayoutError(f"{path}: {n}: local shape {list(shape)} does not split as {rule}")
                entry.sources.append(Source(tp_rank, rank_dir, chunk_keys[c], c, n,
                                            opt_index=indices.get((c, n)), flat=offsets.get((c, n))))
        if sd is not first:
            del sd
    for entry in atomics.values():
        ranks = sorted(s.tp_rank for s in entry.sources)
        want = [0] if entry.rule.kind == "replicated" else list(range(tp))
        if entry.rule.kind == "replicated":
            entry.sources = [s for s in entry.sources if s.tp_rank == 0]
            ranks = [s.tp_rank for s in entry.sources]
        if ranks != want:
            raise IncompleteCheckpointError(f"{entry.name}: held by TP ranks {ranks}, expected {want}")
    consumed = _setting(args, overrides, "consumed_train_samples")
    if consumed is None:
        raise ConfigError(f"{iter_dir}: the stored args lack consumed_train_samples; pass "
                          "--consumed-train-samples after '--'")
    if dp is None and isinstance(first.get("rng_state"), list):
        dp = len(first["rng_state"])  # Megatron-LM keeps one RNG state per data-parallel rank
    rng = _rng_states(rank_dirs, tp, int(dp), first) if dp else {}
    return Plan(int(first["iteration"]), a, tp, pp, vpp, int(dp) if dp else None, dist_opt, atomics, int(step or 0),
                param_groups, scheduler, int(consumed), rng, architecture)


def _padded_vocab(sd, chunk_keys, tp: int, path: str) -> int:
    """The padded vocabulary: TP x the rows of a rank's word embedding or output layer."""
    for key in chunk_keys:
        for name in (EMBEDDING, OUTPUT):
            t = sd[key].get(name)
            if t is not None and hasattr(t, "shape"):
                return int(t.shape[0]) * tp
    raise FormatError(f"{path}: neither {EMBEDDING} nor {OUTPUT} in the first rank's model")


def _optimizer_indices(sd, path, chunk_params, dist_opt) -> dict:
    """(chunk, local name) -> index of its state in the torch optimizer (plain optimizer)."""
    if dist_opt:
        return {}
    opt = sd.get("optimizer")
    if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt:
        kind = "a chained optimizer's list" if isinstance(opt, list) else (
            "fp32_from_fp16_params (bf16)" if isinstance(opt, dict) and "fp32_from_fp16_params" in opt else
            type(opt).__name__)
        raise FormatError(f"{path}: 'optimizer' is not a plain torch optimizer state dict ({kind}); "
                          "only fp32 training without the distributed optimizer is mapped")
    groups = opt["param_groups"]
    wd = [g for g in groups if float(g.get("wd_mult", 1.0)) != 0.0]
    nowd = [g for g in groups if float(g.get("wd_mult", 1.0)) == 0.0]
    if len(wd) > 1 or len(nowd) > 1:
        raise FormatError(f"{path}: {len(groups)} optimizer parameter groups; the converter maps megatron's "
                          "standard two (weight decay, no weight decay) only")
    members = {id(g): [] for g in groups}
    for c, params in enumerate(chunk_params):
        for n, shape in params:
            target = nowd if no_weight_decay(n, shape) else wd
            if not target:
                raise FormatError(f"{path}: no optimizer group for {n}")
            members[id(target[0])].append((c, n, shape))
    out = {}
    for g in groups:
        if len(g["params"]) != len(members[id(g)]):
            raise FormatError(f"{path}: optimizer group with wd_mult {g.get('wd_mult')} holds "
                              f"{len(g['params'])} parameters, the model has {len(members[id(g)])}")
        for index, (c, n, shape) in zip(g["params"], members[id(g)]):
            state = opt["state"].get(index, {})
            if "exp_avg" not in state or tuple(state["exp_avg"].shape) != shape:
                raise FormatError(f"{path}: optimizer state {index} does not fit {n} {list(shape)}")
            out[(c, n)] = index
    return out


def _shared_embedding(name, chunk, n_chunks, pp_rank, pp, tied) -> bool:
    """megatron's `shared_embedding` mark (a bucket of its own): tied embeddings split over stages."""
    if not tied or pp == 1:
        return False
    pre = pp_rank == 0 and chunk == 0
    post = pp_rank == pp - 1 and chunk == n_chunks - 1
    return (name == EMBEDDING and pre and not post) or (name == OUTPUT and post and not pre)


def _buffer_layout(rank_dir, chunk_params, pp_rank, pp, vpp, tied, dp, bucket_size, high_busbw) -> dict:
    path = os.path.join(rank_dir, OPTIM_FILE)
    state = _torch_load(path)
    if isinstance(state, list):
        raise FormatError(f"{path}: several chained optimizers' states; not supported")
    buffers = sorted(k for k in state if isinstance(k, int))
    if len(buffers) != len(chunk_params):
        raise FormatError(f"{path}: {len(buffers)} buffers, the model has {len(chunk_params)} chunks")
    out = {}
    for c, params in enumerate(chunk_params):
        per_dtype = state[buffers[c]]
        if len(per_dtype) != 1:
            raise FormatError(f"{path}: buffer {c} has {len(per_dtype)} dtypes, one expected")
        (saved,) = per_dtype.values()
        items = [(n, math.prod(s), _shared_embedding(n, c, len(chunk_params), pp_rank, pp, tied))
                 for n, s in params]
        offsets, numel = buffer_offsets(items, dp, bucket_size if c == 0 else None, high_busbw)
        if int(saved["numel_unpadded"]) != numel:
            raise FormatError(f"{path}: buffer {c} holds {int(saved['numel_unpadded'])} elements, the model's "
                              f"parameters lay out to {numel} (different DP size or bucket size? pass "
                              "--data-parallel-size / --ddp-bucket-size)")
        for n, (offset, size) in offsets.items():
            out[(c, n)] = (buffers[c], offset, size)
    del state
    return out


def _step_and_groups(sd, path, dist_opt):
    opt = sd.get("optimizer")
    # torch's Adam keeps the step per parameter, FusedAdam per param group (optimizer_state.py)
    groups = opt["optimizer"]["param_groups"] if dist_opt else opt["param_groups"]
    steps = saved_steps(groups, () if dist_opt else opt["state"].values())
    if len(steps) > 1:
        raise FormatError(f"{path}: optimizer holds steps {sorted(steps)}, one expected")
    step = steps.pop() if steps else 0
    return int(float(step or 0)), plain_groups(groups)


def _rng_states(rank_dirs, tp, dp, first) -> dict:
    """RNG files for a same-layout resume, when the states are in this project's JSON form."""
    out = {}
    for (tp_rank, pp_rank), rank_dir in rank_dirs.items():
        sd = first if rank_dir == rank_dirs[min(rank_dirs)] else _torch_load(os.path.join(rank_dir, MODEL_FILE))
        states = sd.get("rng_state")
        if not isinstance(states, list) or len(states) != dp or not all(
                isinstance(s, dict) and {"python", "numpy", "torch", "tracker"} <= set(s) for s in states):
            return {}
        for dp_rank, s in enumerate(states):
            out[global_rank(tp_rank, dp_rank, pp_rank, tp, dp)] = s
    return out


# ---------------------------------------------------------------- one atomic tensor


def _local_states(source: Source, plan: Plan, states) -> dict:
    """The TP-local flat tensors of one source: views of the mmap'ed files, nothing read yet."""
    out = {}
    if plan.dist_opt and "exp_avg" in states:
        buffers = _torch_load(os.path.join(source.rank_dir, OPTIM_FILE))
        b, offset, numel = source.flat
        (saved,) = buffers[b].values()
        for s in states:
            out[s] = saved[s][offset:offset + numel]
    else:
        sd = _torch_load(os.path.join(source.rank_dir, MODEL_FILE))
        out["param"] = sd[source.chunk_key][source.local_name].reshape(-1)
        if "exp_avg" in states:
            st = sd["optimizer"]["state"][source.opt_index]
            out["exp_avg"], out["exp_avg_sq"] = st["exp_avg"].reshape(-1), st["exp_avg_sq"].reshape(-1)
    return out


def _state_parts(entry: Atomic, plan: Plan, sources: dict, state: str) -> dict:
    """One state of one atomic tensor: {part: array}, pages of the sources released after use."""
    import torch

    parts = {"": np.empty(entry.shape, dtype=np.float32)}
    if entry.padding_rows:
        parts[PADDING] = np.empty((entry.padding_rows,) + tuple(entry.shape[1:]), dtype=np.float32)
    padded = entry.shape[0] + entry.padding_rows if entry.rule.kind == "vocab" else None
    for source in entry.sources:
        local = sources[id(source)][state]
        if local.dtype != torch.float32:
            raise FormatError(f"{source.rank_dir}: {source.local_name} {state} is {local.dtype}; "
                              "the converter reads fp32 state only")
        flat = local.numpy()
        for p in pieces(entry.rule, entry.shape, plan.tp, source.tp_rank, padded):
            box = tuple(slice(o, o + n) for o, n in zip(p.offset, p.shape))
            parts[p.part][box] = flat[p.local_start:p.local_start + p.numel].reshape(p.shape)
        _release(local)
    return parts


def convert(iter_dir: str, output_dir: str, overrides: dict | None = None, workers: int = 1,
            progress: bool = True) -> dict:
    """Convert one legacy `iter_XXXXXXX` folder into `output_dir`; returns the summary."""
    started = time.perf_counter()
    plan = plan_conversion(iter_dir, overrides)
    metas = {n: mf.tensor_entry(n, e.shape, e.rule.kind == "vocab", e.padding_rows, mf.STATES)
             for n, e in plan.atomics.items()}

    def opener(name):
        entry = plan.atomics[name]
        sources = {id(s): _local_states(s, plan, mf.STATES) for s in entry.sources}
        return lambda state: _state_parts(entry, plan, sources, state)

    try:
        return stream_write.write_checkpoint(output_dir, plan.iteration, metas, opener, _manifest(plan, metas),
                                             plan.rng, workers, progress, started)
    finally:
        _LOADED.clear()


def _manifest(plan: Plan, entries: dict) -> dict:
    """Everything in the manifest but the tensors' entries."""
    layout = mf.Layout(
        # Without RNG files the saving layout is recorded as unknown, so a loader reseeds.
        world_size=plan.tp * plan.pp * plan.dp if plan.rng and plan.dp else None, tensor_model_parallel_size=plan.tp,
        pipeline_model_parallel_size=plan.pp, virtual_pipeline_model_parallel_size=plan.vpp,
        data_parallel_size=plan.dp, expert_model_parallel_size=1, expert_tensor_parallel_size=plan.tp,
        use_distributed_optimizer=plan.dist_opt, padded_vocab_size=mf.padded_vocab_size(entries))
    return mf.head(iteration=plan.iteration, consumed_samples=plan.consumed, architecture=plan.architecture,
                   layout=layout, optimizer={"type": "adam", "step": plan.step, "param_groups": plan.param_groups},
                   scheduler=plan.scheduler, args=plan.args)
