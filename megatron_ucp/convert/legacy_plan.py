"""The plan of a legacy checkpoint's conversion: for every atomic tensor, the TP ranks' files
and keys that hold it, how the source split it, and where its optimizer state lies; read from
the small parts of every rank's file, no tensor data.

The state dicts use local layer numbers per pipeline stage and virtual stage (`model0`,
`model1`...); `global_name` makes them the whole model's module names, which lead to megatron's
description of each parameter in a meta-device model built from the stored arguments
(`model_geometry`: atomic name, packed halves, vocabulary rows). How the source split a tensor
over TP follows from its saved local shape (`layout.infer_rule`). What the stored arguments lack
is a ConfigError naming the flag to pass after '--'; nothing is guessed.
"""

import argparse
import os
import re
from dataclasses import dataclass, field

from megatron_ucp.convert.buffer_layout import EMBEDDING, OUTPUT
from megatron_ucp.convert.legacy_files import MODEL_FILE, parse_rank_dir, torch_load
from megatron_ucp.convert.legacy_optimizer import buffer_places, optimizer_indices, step_and_groups
from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError, LayoutError
from megatron_ucp.format import manifest as mf
from megatron_ucp.format.layout import Rule, atomic_shape_from_local, infer_rule, layer_offset, local_shape

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def model_geometry(a: dict, world: int, vocab: int, padded: int, origin: str = "the stored arguments"):
    """Module name in the whole model (global layer numbers) -> megatron's description of that
    parameter (model_map): its atomic name, shape, packed halves and vocabulary rows; and the
    model's architecture record (manifest.architecture). The model
    is built from the checkpoint's arguments on the meta device, in one process (TP = PP = 1);
    how the source layout split each tensor follows from the saved local shapes (infer_rule)."""
    from megatron_ucp.convert.source_model import (argv_from_args, meta_model, single_process_megatron,
                                                   source_args)
    from megatron_ucp.mcore.model_map import geometry

    source = source_args(argv_from_args(a) + ["--cpu"], world, origin)
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


def global_rank(tp_rank: int, dp_rank: int, pp_rank: int, tp: int, dp: int) -> int:
    """megatron-core's default rank order (tp-cp-ep-dp-pp) without context parallelism."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


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
    first = torch_load(os.path.join(rank_dirs[min(rank_dirs)], MODEL_FILE))
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
        sd = first if (tp_rank, pp_rank) == min(rank_dirs) else torch_load(path)
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
        indices = optimizer_indices(sd, path, chunk_params, dist_opt)
        offsets = {}
        if dist_opt:
            offsets = buffer_places(rank_dir, chunk_params, pp_rank, pp, vpp, tied, int(dp or 1), bucket_size,
                                    bool(a.get("ddp_pad_buckets_for_high_nccl_busbw")))
        s, groups = step_and_groups(sd, path, dist_opt)
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
                    described, architecture = model_geometry(a, tp * pp * int(dp or 1), vocab, padded, path)
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


def _rng_states(rank_dirs, tp, dp, first) -> dict:
    """RNG files for a same-layout resume, when the states are in this project's JSON form."""
    out = {}
    for (tp_rank, pp_rank), rank_dir in rank_dirs.items():
        sd = first if rank_dir == rank_dirs[min(rank_dirs)] else torch_load(os.path.join(rank_dir, MODEL_FILE))
        states = sd.get("rng_state")
        if not isinstance(states, list) or len(states) != dp or not all(
                isinstance(s, dict) and {"python", "numpy", "torch", "tracker"} <= set(s) for s in states):
            return {}
        for dp_rank, s in enumerate(states):
            out[global_rank(tp_rank, dp_rank, pp_rank, tp, dp)] = s
    return out
