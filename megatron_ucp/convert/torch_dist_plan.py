"""The plan of a torch_dist checkpoint's conversion: every atomic tensor mapped to the
checkpoint's chunks, with the manifest's head; from the DCP metadata and small objects only.

What maps a checkpoint key to an atomic tensor is megatron itself: the model is built from the
checkpoint's stored arguments on the meta device (no memory), in a single-process layout
(TP = PP = EP = 1), where every parameter is whole. Its `sharded_state_dict()` gives each
parameter's checkpoint key and global offset (stacked layers, experts, SwiGLU halves), and
model_map gives the atomic name, the same one a direct universal save uses; how the source
layout split each tensor over TP is read from the chunks the checkpoint saved (_source_rule).
The optimizer state is found by its sharding: in the model's coordinates (none,
`fully_reshardable`), or in bucket tensors (`dp_reshardable`, torch_dist_buckets.py).
"""

import re
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

from megatron_ucp.convert.buffer_layout import EMBEDDING
from megatron_ucp.convert.dcp_reader import DcpReader, read_common, unwrap_object
from megatron_ucp.convert.megatron_args import plain_args
from megatron_ucp.convert.source_model import (argv_from_args, checked_source, meta_model, single_process_megatron,
                                               source_args, stored_world, typed_stored_args)
from megatron_ucp.convert.torch_dist_buckets import DIST_PREFIX, check_bucket_layout, map_buckets, object_key
from megatron_ucp.convert.torch_dist_sources import Atomic, Box
from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError, LayoutError
from megatron_ucp.format import manifest as mf
from megatron_ucp.format.layout import Rule, infer_rule
from megatron_ucp.format.tensor_entry import STATES
from megatron_ucp.mcore.optimizer_state import plain_groups, saved_steps


@dataclass
class Plan:
    iteration: int
    sharding: str  # 'none', 'fully_reshardable' or 'dp_reshardable'
    atomics: Dict[str, Atomic]
    head: mf.Manifest  # the manifest without its tensors
    rng: Dict[int, dict]


def _source_args(iter_dir: str, common: dict, extra_argv, nproc, reader: DcpReader):
    """The source run's arguments (stored args, overridden by flags), validated for its world,
    typed and checked against the checkpoint's tensors before anything is built from them."""
    origin = os.path.join(iter_dir, "common.pt")
    stored = plain_args(common.get("args") or {}, origin)  # a dict or a Namespace, nesting bounded
    if not stored and not extra_argv:
        raise ConfigError(f"{iter_dir}: stores no training arguments; pass the model and layout flags after "
                          "'--' (e.g. --num-layers ... --tensor-model-parallel-size ...)")
    world = nproc or stored_world(stored, origin)
    if world < 1:
        raise ConfigError(f"{iter_dir}: the checkpoint does not store its world size: pass --nproc")
    typed_stored_args(stored, origin)
    source = source_args(argv_from_args(stored) + list(extra_argv) + ["--cpu"], world, origin)
    checked_source(source, {k: reader.shape(k) for k in reader.keys() if reader.has_tensor(k)}, origin, extra_argv)
    return stored, source, world


def _sharded_by_tensor(gpt) -> dict:
    """id(parameter or buffer) -> megatron's ShardedTensors of it (factories built)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: dict = {}
    for v in nested_values(gpt.sharded_state_dict()):
        if isinstance(v, ShardedTensorFactory):
            out.setdefault(id(v.data), []).extend(
                t for t in nested_values(v.build()) if isinstance(t, ShardedTensor))
        elif isinstance(v, ShardedTensor):
            out.setdefault(id(v.data), []).append(v)
    return out


def _boxes(name: str, tensor, sharded, reader: DcpReader) -> List[Box]:
    """Where each part of a whole parameter lies in the checkpoint, checked against its metadata."""
    if not sharded:
        raise FormatError(f"{name}: megatron gives no checkpoint key for it")
    boxes, total = [], 0
    for st in sharded:
        if getattr(st, "flattened_range", None) is not None or not st.data.is_contiguous():
            raise LayoutError(f"{name}: checkpoint key {st.key!r} maps a non-contiguous part; not supported")
        sizes = (1,) * st.prepend_axis_num + tuple(st.local_shape)
        if not reader.has_tensor(st.key):
            raise IncompleteCheckpointError(f"{reader.dir}: no tensor {st.key!r} (for {name})")
        if reader.shape(st.key) != tuple(st.global_shape):
            raise LayoutError(f"{reader.dir}: {st.key!r} has shape {list(reader.shape(st.key))}, the model built "
                              f"from the stored arguments has {list(st.global_shape)}")
        dest = st.data.storage_offset() - tensor.storage_offset()
        boxes.append(Box(st.key, tuple(st.global_offset), sizes, dest, st.data.numel()))
        total += st.data.numel()
    if total != tensor.numel():
        raise LayoutError(f"{name}: checkpoint keys cover {total} of its {tensor.numel()} elements")
    return boxes


def _source_rule(reader: DcpReader, t, boxes: List[Box]) -> Rule:
    """How the source layout split the tensor over tensor parallelism: the shape of the chunk
    the checkpoint saved where the tensor starts, against the tensor's (layout.infer_rule)."""
    b = boxes[0]
    n = len(b.sizes) - len(t.atomic_shape)
    for c in reader.tensor(b.key).chunks:
        if all(o <= x < o + size for o, size, x in zip(c.offsets, c.sizes, b.offsets)):
            if any(size != 1 for size in c.sizes[:n]):
                raise LayoutError(f"{reader.dir}: {b.key!r}: a chunk spans several layers or experts "
                                  f"({list(c.sizes[:n])}); not streamed, convert with --via-megatron")
            return infer_rule(t.atomic_shape, tuple(c.sizes[n:]), len(boxes) > 1, t.padded_rows is not None)
    raise IncompleteCheckpointError(f"{reader.dir}: no saved chunk of {b.key!r} at {list(b.offsets)} ({t.name})")


def _optimizer_parts(common: dict) -> list:
    """The common part of each optimizer: one, or one per chained optimizer (MoE: dense, experts)."""
    opt = common.get("optimizer")
    if isinstance(opt, dict) and opt and all(isinstance(k, int) for k in opt):
        return [opt[k] for k in sorted(opt)]
    return [opt] if isinstance(opt, dict) else []


_STATE_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.state\.exp_avg\.")


def _sharding(common: dict, reader: DcpReader) -> str:
    kinds = {p.get("param_state_sharding_type") for p in _optimizer_parts(common)} - {None}
    if any(DIST_PREFIX in k for k in reader.keys()):
        if kinds - {"dp_reshardable"} or not any(".gbuf_idx_" in k for k in reader.keys()):
            raise FormatError(f"{reader.dir}: distributed-optimizer sharding {sorted(kinds)} is not streamed; "
                              "convert with --via-megatron")
        return "dp_reshardable"
    if any(_STATE_KEY.match(k) for k in reader.keys()):
        return "fully_reshardable" if "fully_reshardable" in kinds else "none"
    raise FormatError(f"{reader.dir}: no optimizer state (optimizer.state.* or {DIST_PREFIX}*); "
                      "a model-only checkpoint cannot resume training")


def _state_prefixes(reader: DcpReader) -> dict:
    """model key -> the optimizer prefixes holding its state ('optimizer.state.' or
    'chained_<i>.optimizer.state.'), from one pass over the checkpoint's keys."""
    out: dict = {}
    for k in reader.keys():
        m = _STATE_KEY.match(k)
        if m:
            out.setdefault(k[m.end():], []).append(m.group(0)[:-len("exp_avg.")])
    return out


def plan_conversion(iter_dir: str, extra_argv=(), nproc=None, common: Optional[dict] = None) -> Plan:
    """Map every atomic tensor to the checkpoint's chunks; reads metadata and small objects only."""
    from megatron_ucp.mcore.model_map import local_tensors

    if common is None:
        common = read_common(iter_dir)
    reader = DcpReader(iter_dir)
    stored, source, world = _source_args(iter_dir, common, extra_argv, nproc, reader)
    sharding = _sharding(common, reader)
    padded = reader.shape(EMBEDDING)[0] if reader.has_tensor(EMBEDDING) else source.padded_vocab_size
    if padded < source.vocab_size:
        raise LayoutError(f"{reader.dir}: {EMBEDDING} has {padded} rows, fewer than --vocab-size {source.vocab_size}")
    with single_process_megatron():
        gpt = meta_model(source, padded)
        sharded = _sharded_by_tensor(gpt)
        tensors = local_tensors([gpt], None, source.vocab_size)
        architecture = mf.architecture(gpt, source.vocab_size)
    atomics = {}
    holders = _state_prefixes(reader) if sharding != "dp_reshardable" else {}
    for t in tensors:
        if not t.writes:
            continue
        if t.write_back:
            raise LayoutError(f"{t.name}: legacy grouped-GEMM experts are not streamed; convert with --via-megatron")
        states = ("param",) if t.stateless else STATES
        boxes = _boxes(t.name, t.param, sharded.get(id(t.param)), reader)
        entry = Atomic(t.name, _source_rule(reader, t, boxes), tuple(t.atomic_shape), t.padded_rows, states,
                       t.stateless, boxes)
        if sharding != "dp_reshardable" and not t.stateless:
            entry.prefixes = _model_space_prefixes(reader, entry, holders)
        atomics[t.name] = entry
    _check_all_keys_used(reader, atomics)
    if sharding == "dp_reshardable":
        map_buckets(reader, source, world, tensors, atomics, stored)
        check_bucket_layout(reader, atomics, source)
    step, groups = _step_and_groups(common, reader, sharding)
    rng = _rng_states(reader, world)
    layout = mf.Layout(
        world_size=world if rng else None, tensor_model_parallel_size=source.tensor_model_parallel_size,
        pipeline_model_parallel_size=source.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=source.virtual_pipeline_model_parallel_size,
        data_parallel_size=source.data_parallel_size,
        expert_model_parallel_size=source.expert_model_parallel_size,
        expert_tensor_parallel_size=source.expert_tensor_parallel_size or source.tensor_model_parallel_size,
        use_distributed_optimizer=bool(source.use_distributed_optimizer), padded_vocab_size=padded)
    head = mf.head(iteration=common["iteration"], consumed_samples=common.get("consumed_samples") or 0,
                   architecture=architecture, layout=layout,
                   optimizer={"type": "adam", "step": step, "param_groups": groups},
                   scheduler=common.get("opt_param_scheduler"), args=stored)
    reader.close()
    return Plan(int(common["iteration"]), sharding, atomics, head, rng)


def _model_space_prefixes(reader: DcpReader, entry: "Atomic", holders: dict) -> dict:
    """state -> key prefix, for optimizer state kept in the model's coordinates. The weights come
    from the optimizer's fp32 copy where it keeps one ('param', 'fp32_param'), else the model."""
    key = entry.boxes[0].key
    found = holders.get(key, [])
    if len(found) != 1:
        raise IncompleteCheckpointError(f"{reader.dir}: {len(found)} optimizer states for {key!r} ({entry.name}), "
                                        "one expected")
    opt = found[0]
    param = ""
    for candidate in (opt + "param.", opt + "fp32_param."):
        if reader.has_tensor(candidate + key):
            param = candidate
            break
    return {"param": param, "exp_avg": opt + "exp_avg.", "exp_avg_sq": opt + "exp_avg_sq."}


def _check_all_keys_used(reader: DcpReader, atomics: dict) -> None:
    """Every model tensor of the checkpoint belongs to some atomic tensor (else the stored
    arguments describe another model)."""
    used = {b.key for a in atomics.values() for b in a.boxes}
    model_keys = {k for k in reader.keys()
                  if reader.has_tensor(k) and not k.startswith("optimizer.") and not k.startswith("chained_")}
    unknown = sorted(model_keys - used)
    if unknown:
        raise LayoutError(f"{reader.dir}: tensors the model built from the stored arguments does not have: "
                          f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''}")


def _step_and_groups(common: dict, reader: DcpReader, sharding: str):
    """Adam's step and the parameter groups' settings (of every chained optimizer, in order),
    wherever this sharding keeps them."""
    parts = _optimizer_parts(common)
    if sharding == "dp_reshardable":
        prefixes = ["chained_0.", "chained_1."] if any(k.startswith("chained_") for k in reader.keys()) else [""]
        parts = [unwrap_object(reader.read_object(object_key(reader, p, 0, "optimizer"))) for p in prefixes]
    groups, steps = [], set()
    for part in parts:
        inner = part.get("optimizer") if isinstance(part.get("optimizer"), dict) else part
        found = inner.get("param_groups") if isinstance(inner, dict) else None
        if not isinstance(found, list) or not found:
            raise FormatError(f"{reader.dir}: an optimizer without param_groups ({sorted(map(str, part))})")
        groups += found
        steps |= saved_steps(found)
        if "common_step" in (part.get("state") or {}):
            steps.add(int(float(part["state"]["common_step"])))
    if len(steps) != 1:
        raise FormatError(f"{reader.dir}: optimizer steps {sorted(steps)}, one expected")
    return int(steps.pop()), plain_groups(groups)


def _rng_states(reader: DcpReader, world: int) -> dict:
    """This project's RNG states per global rank (megatron's `rng_state` objects), or none."""
    out = {}
    for k in reader.keys():
        m = re.fullmatch(r"rng_state/shard_(\d+)_(\d+)", k)
        if not m or int(m.group(2)) != world:
            continue
        state = unwrap_object(reader.read_object(k))
        if not (isinstance(state, dict) and {"python", "numpy", "torch", "tracker"} <= set(state)):
            return {}
        out[int(m.group(1))] = state
    return out if len(out) == world else {}
