"""Convert a megatron-core `torch_dist` checkpoint into a universal one, streaming.

No GPU and no process of the source layout: one process reads the checkpoint's DCP metadata
and, for each atomic tensor, only the chunks that hold it (`DcpReader.read_box`), assembles one
state at a time and writes it once (megatron_ucp/convert/writer.py). Memory holds a few atomic
tensors, never the checkpoint.

What maps a checkpoint key to an atomic tensor is megatron itself: the model is built from the
checkpoint's stored arguments on the meta device (no memory), in a single-process layout
(TP = PP = EP = 1), where every parameter is whole. Its `sharded_state_dict()` gives each
parameter's checkpoint key and global offset (stacked layers, experts, SwiGLU halves), and
model_map gives the atomic name, the same one a direct universal save uses; how the source
layout split each tensor over TP is read from the chunks the checkpoint saved (_source_rule).

Optimizer state, by megatron-core's distributed-optimizer sharding:
- none (plain optimizer) and `fully_reshardable`: `optimizer.state.<state>.<model key>`, in the
  model's coordinates, read like the weights;
- `dp_reshardable` (megatron's default): one flat tensor per (model-parallel rank, buffer,
  bucket), for the dense optimizer and, with MoE, the experts' one chained after it. Where each
  parameter lies is megatron's buffer layout, derived here by a pure function
  (legacy_convert.bucket_layout) and checked against what the checkpoint records: every bucket's
  size, every parameter's boundaries among the bucket's saved chunks, and (fp32) the weights
  found there against the model's.
"""

import math
import re
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from megatron_ucp.convert import writer as stream_write
from megatron_ucp.convert.dcp_reader import DcpReader, read_common, unwrap_object
from megatron_ucp.convert.source_model import argv_from_args, meta_model, single_process_megatron, source_args
from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError, LayoutError
from megatron_ucp.format import manifest as mf
from megatron_ucp.format.layout import PADDING, Rule, infer_rule, layer_offset, local_shape, pieces
from megatron_ucp.mcore.optimizer_state import plain_groups, saved_steps

DIST_PREFIX = "optimizer.distributed.dp_group_idx_"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"


# ---------------------------------------------------------------- the plan


@dataclass
class Box:
    """A piece of the whole (TP = 1) parameter: checkpoint key, global box, flat destination."""

    key: str
    offsets: tuple
    sizes: tuple
    dest: int
    numel: int


@dataclass
class FlatSource:
    """One source rank's TP-local parameter inside a `dp_reshardable` bucket tensor."""

    bucket: str  # the bucket's key without the state suffix
    offset: int
    numel: int
    tp_rank: int
    tp: int  # its TP size (expert TP for experts)


@dataclass
class Atomic:
    name: str
    rule: Rule
    shape: tuple
    padded_rows: Optional[int]  # vocabulary rows with padding (vocab rule), else None
    states: tuple
    buffer: bool
    boxes: List[Box] = field(default_factory=list)
    flat: List[FlatSource] = field(default_factory=list)
    prefixes: Dict[str, str] = field(default_factory=dict)  # model space: state -> key prefix

    @property
    def padding_rows(self) -> int:
        return (self.padded_rows - self.shape[0]) if self.padded_rows else 0


@dataclass
class Plan:
    iteration: int
    sharding: str  # 'none', 'fully_reshardable' or 'dp_reshardable'
    atomics: Dict[str, Atomic]
    head: dict  # the manifest without its tensors
    rng: Dict[int, dict]


def _source_args(iter_dir: str, common: dict, extra_argv, nproc):
    """The source run's arguments (stored args, overridden by flags), validated for its world."""
    stored = dict(common.get("args") or {})
    if not stored and not extra_argv:
        raise ConfigError(f"{iter_dir}: stores no training arguments; pass the model and layout flags after "
                          "'--' (e.g. --num-layers ... --tensor-model-parallel-size ...)")
    world = nproc or int(stored.get("world_size") or 0)
    if world < 1:
        raise ConfigError(f"{iter_dir}: the checkpoint does not store its world size: pass --nproc")
    source = source_args(argv_from_args(stored) + list(extra_argv) + ["--cpu"], world)
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
    stored, source, world = _source_args(iter_dir, common, extra_argv, nproc)
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
        states = ("param",) if t.stateless else mf.STATES
        boxes = _boxes(t.name, t.param, sharded.get(id(t.param)), reader)
        entry = Atomic(t.name, _source_rule(reader, t, boxes), tuple(t.atomic_shape), t.padded_rows, states,
                       t.stateless, boxes)
        if sharding != "dp_reshardable" and not t.stateless:
            entry.prefixes = _model_space_prefixes(reader, entry, holders)
        atomics[t.name] = entry
    _check_all_keys_used(reader, atomics)
    if sharding == "dp_reshardable":
        _map_buckets(reader, source, world, tensors, atomics, stored)
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


def _stage_members(name: str, num_layers: int, pp: int, pp_rank: int, vpp, c: int) -> bool:
    chunks = vpp or 1
    m = _LAYER.match(name)
    if m:
        first = layer_offset(num_layers, pp, pp_rank, vpp, c if vpp else None)
        return first <= int(m.group(1)) < first + num_layers // (pp * chunks)
    pre, post = pp_rank == 0 and c == 0, pp_rank == pp - 1 and c == chunks - 1
    if name.startswith("embedding."):
        return pre
    if name.startswith("decoder.final_") or name == OUTPUT:
        return post
    raise LayoutError(f"{name}: cannot tell which pipeline stage holds it")


def _bucket_key(reader: DcpReader, prefix: str, group: int, gbuf: int, bucket: int) -> str:
    """'[chained_<i>.]optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_(...).bucket_idx_K'."""
    head, tail = f"{prefix}{DIST_PREFIX}{group}.gbuf_idx_{gbuf}.dtype_", f".bucket_idx_{bucket}.exp_avg"
    found = sorted(k[: -len(".exp_avg")] for k in reader.keys() if k.startswith(head) and k.endswith(tail))
    if len(found) != 1:
        raise FormatError(f"{reader.dir}: {len(found)} tensors named {head}*{tail}, one expected")
    return found[0]


_EXPERT = re.compile(r"\.mlp\.experts\.experts\.(\d+)\.")


@dataclass
class _Domain:
    """One distributed optimizer: the dense one, or (MoE with EP > 1, chained second) the
    experts' one."""

    prefix: str  # '' or 'chained_<i>.'
    members: str  # 'all', 'dense' or 'experts'
    tp: int  # TP size of its parameters (expert TP for the experts' optimizer)
    dp: int  # its data-parallel size (the expert-data-parallel size for experts)
    ranks: list  # [(group index, pp_rank, tp_rank, ep_rank)]


def _domains(reader: DcpReader, source, world: int) -> List[_Domain]:
    """megatron-core's optimizers and their model-parallel ranks, in its default rank order:
    dense group index = tp_rank + TP x pp_rank (the tp-pp group), expert group index =
    etp_rank + ETP x (ep_rank + EP x pp_rank) (the expert tp-ep-pp group). Experts get an
    optimizer of their own only with expert parallelism (megatron marks them `allreduce=False`
    only then); with EP = 1 they sit in the dense buffers."""
    tp, pp = source.tensor_model_parallel_size, source.pipeline_model_parallel_size
    dense = [(t + tp * r, r, t, 0) for r in range(pp) for t in range(tp)]
    ep = source.expert_model_parallel_size if source.num_experts else 1
    etp = source.expert_tensor_parallel_size or tp
    if ep == 1:
        if source.num_experts and etp != tp:
            raise LayoutError(f"{reader.dir}: experts with expert TP {etp} != TP {tp} and no expert parallelism are "
                              "not streamed; convert with --via-megatron")
        return [_Domain("", "all", tp, world // (tp * pp), dense)]
    experts = [(t + etp * (e + ep * r), r, t, e) for r in range(pp) for e in range(ep) for t in range(etp)]
    return [_Domain("chained_0.", "dense", tp, world // (tp * pp), dense),
            _Domain("chained_1.", "experts", etp, world // (etp * ep * pp), experts)]


def _map_buckets(reader: DcpReader, source, world: int, tensors, atomics: dict, stored: dict) -> None:
    """`dp_reshardable`: each atomic tensor's TP-local pieces inside the bucket tensors of the
    source's model-parallel ranks, for the dense optimizer and (MoE) the experts' one."""
    from megatron_ucp.convert.legacy import bucket_layout

    pp, vpp = source.pipeline_model_parallel_size, source.virtual_pipeline_model_parallel_size
    if int(stored.get("context_parallel_size") or 1) != 1:
        raise LayoutError(f"{reader.dir}: context parallelism is not streamed; convert with --via-megatron")
    domains = _domains(reader, source, world)
    chained = re.compile(r"^(chained_\d+\.)?" + re.escape(DIST_PREFIX))
    seen = {m.group(1) or "" for k in reader.keys() if (m := chained.match(k))}
    if seen != {d.prefix for d in domains}:
        raise FormatError(f"{reader.dir}: distributed-optimizer state under {sorted(seen)}, the model's optimizers "
                          f"are {[d.prefix for d in domains]}")
    high_busbw = bool(stored.get("ddp_pad_buckets_for_high_nccl_busbw"))
    tied = not source.untie_embeddings_and_output_weights
    order = [t for t in tensors if t.writes and not t.stateless]  # megatron's parameter order
    num_local = (source.num_experts // source.expert_model_parallel_size) if source.num_experts else 0
    for d in domains:
        pattern = re.compile(re.escape(d.prefix + DIST_PREFIX) + r"(\d+)\.")
        groups = {int(m.group(1)) for k in reader.keys() if (m := pattern.match(k))}
        if groups != {g for g, *_ in d.ranks}:
            raise FormatError(f"{reader.dir}: {d.prefix}distributed-optimizer groups {sorted(groups)}, the layout "
                              f"gives {len(d.ranks)}")
        bucket_size = None
        if stored.get("overlap_grad_reduce"):
            bucket_size = stored.get("ddp_bucket_size") or max(40000000, 1000000 * d.dp)
        for group, pp_rank, tp_rank, ep_rank in d.ranks:
            saved = reader.read_object(_object_key(reader, d.prefix, group, "per_bucket_numel_unpadded"))
            if isinstance(saved, list) and len(saved) == 1 and isinstance(saved[0], list):
                saved = saved[0]  # the sharded object's own wrapping; then one entry per buffer
            for c in range((vpp or 1)):
                pre, post = pp_rank == 0 and c == 0, pp_rank == pp - 1 and c == (vpp or 1) - 1
                items = []
                for t in order:
                    expert = _EXPERT.search(t.name)
                    if d.members != "all" and bool(expert) != (d.members == "experts"):
                        continue
                    if not _stage_members(t.name, source.num_layers, pp, pp_rank, vpp, c):
                        continue
                    if expert and int(expert.group(1)) // num_local != ep_rank:
                        continue
                    entry = atomics[t.name]
                    numel = math.prod(local_shape(entry.rule, entry.shape, d.tp, entry.padded_rows))
                    items.append((t.name, numel, tied and t.name == EMBEDDING and not post))
                if tied and post and not pre and d.members != "experts":  # the tied embedding's last-stage copy
                    emb = atomics[EMBEDDING]
                    items.append((OUTPUT, math.prod(local_shape(emb.rule, emb.shape, d.tp, emb.padded_rows)), True))
                index, buckets = bucket_layout(items, d.dp, bucket_size if c == 0 else None, high_busbw)
                where = f"{d.prefix}rank group {group} buffer {c}"
                want = _bucket_numels(saved, c, reader, where)
                if want != buckets:
                    raise FormatError(f"{reader.dir}: {where}: the checkpoint's buckets hold {want} elements, the "
                                      f"model's parameters lay out to {buckets} (different bucket size? pass "
                                      "--ddp-bucket-size)")
                keys = [_bucket_key(reader, d.prefix, group, c, b) for b in range(len(buckets))]
                for name, (b, offset, numel) in index.items():
                    if name == OUTPUT and tied:
                        continue
                    bounds = reader.chunk_bounds(keys[b] + ".exp_avg")
                    if offset not in bounds or offset + numel not in bounds:
                        raise FormatError(f"{reader.dir}: {name} at {offset}..{offset + numel} of {keys[b]} does not "
                                          "fall on the saved chunks' boundaries: the derived buffer layout is wrong")
                    entry = atomics[name]
                    if entry.rule.kind == "replicated" and tp_rank != 0:
                        continue
                    entry.flat.append(FlatSource(keys[b], offset, numel, tp_rank, d.tp))
    for entry in atomics.values():
        if not entry.buffer and not entry.flat:
            raise IncompleteCheckpointError(f"{reader.dir}: no optimizer state found for {entry.name}")


def _object_key(reader: DcpReader, prefix: str, group: int, what: str) -> str:
    head = f"{prefix}{DIST_PREFIX}{group}.{what}/"
    found = [k for k in reader.keys() if k.startswith(head)]
    if len(found) != 1:
        raise FormatError(f"{reader.dir}: {len(found)} objects named {head}*, one expected")
    return found[0]


def _bucket_numels(saved, gbuf: int, reader, where: str) -> list:
    try:
        (numels,) = saved[gbuf].values()
        return [int(n) for n in numels]
    except (IndexError, KeyError, TypeError, ValueError, AttributeError):
        raise FormatError(f"{reader.dir}: {where}: per_bucket_numel_unpadded is {saved!r}, expected "
                          "one {dtype: [numel, ...]} per buffer") from None


def _step_and_groups(common: dict, reader: DcpReader, sharding: str):
    """Adam's step and the parameter groups' settings (of every chained optimizer, in order),
    wherever this sharding keeps them."""
    parts = _optimizer_parts(common)
    if sharding == "dp_reshardable":
        prefixes = ["chained_0.", "chained_1."] if any(k.startswith("chained_") for k in reader.keys()) else [""]
        parts = [unwrap_object(reader.read_object(_object_key(reader, p, 0, "optimizer"))) for p in prefixes]
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


# ---------------------------------------------------------------- one atomic tensor


def assemble(entry: Atomic, plan: Plan, reader: DcpReader, state: str) -> Dict[str, np.ndarray]:
    """One state of one atomic tensor as {part: array}."""
    if plan.sharding == "dp_reshardable" and not entry.buffer:
        return _from_buckets(entry, reader, state)
    return _from_boxes(entry, reader, entry.prefixes.get(state, ""))


def _from_buckets(entry: Atomic, reader: DcpReader, state: str) -> Dict[str, np.ndarray]:
    parts = {"": np.empty(entry.shape, dtype=np.float32)}
    if entry.padding_rows:
        parts[PADDING] = np.empty((entry.padding_rows,) + tuple(entry.shape[1:]), dtype=np.float32)
    for src in entry.flat:
        flat = reader.read_box(f"{src.bucket}.{state}", (src.offset,), (src.numel,))
        for p in pieces(entry.rule, entry.shape, src.tp, src.tp_rank, entry.padded_rows):
            box = tuple(slice(o, o + n) for o, n in zip(p.offset, p.shape))
            parts[p.part][box] = flat[p.local_start:p.local_start + p.numel].reshape(p.shape)
    return parts


def _from_boxes(entry: Atomic, reader: DcpReader, prefix: str) -> Dict[str, np.ndarray]:
    """The whole (TP = 1) tensor from its boxes under `prefix`, split into tensor and padding."""
    rows = entry.padded_rows or (entry.shape[0] if entry.shape else None)
    full_shape = ((rows,) + tuple(entry.shape[1:])) if entry.shape else ()
    if len(entry.boxes) == 1:  # one box holds the whole parameter: use it as read
        b = entry.boxes[0]
        whole = reader.read_box(prefix + b.key, b.offsets, b.sizes).reshape(full_shape)
    else:
        whole = np.empty(full_shape, dtype=np.float32)
        flat = whole.reshape(-1)
        for b in entry.boxes:
            flat[b.dest:b.dest + b.numel] = reader.read_box(prefix + b.key, b.offsets, b.sizes).reshape(-1)
    if not entry.padding_rows:
        return {"": whole}
    return {"": whole[:entry.shape[0]], PADDING: whole[entry.shape[0]:]}


def check_bucket_layout(reader: DcpReader, atomics: dict, source) -> bool:
    """`dp_reshardable`: the fp32 weights found in the buckets at the derived places must be the
    model's weights, bit for bit. Two parameters of one size in swapped places would pass the
    size and boundary checks; their values do not. Probed on every tensor outside the layers and
    on the first layer of every pipeline chunk (the derivation repeats per layer). Returns False,
    checking nothing, when the model's weights are not fp32 (then they are a rounded copy)."""
    import torch

    pp, vpp = source.pipeline_model_parallel_size, source.virtual_pipeline_model_parallel_size
    firsts = {layer_offset(source.num_layers, pp, r, vpp, c if vpp else None)
              for r in range(pp) for c in range(vpp or 1)}
    probes = [e for e in atomics.values() if not e.buffer and (
        not (m := _LAYER.match(e.name)) or int(m.group(1)) in firsts)]
    if any(reader.tensor(e.boxes[0].key).properties.dtype != torch.float32 for e in probes):
        return False
    for e in probes:
        model, buckets = _from_boxes(e, reader, ""), _from_buckets(e, reader, "param")
        for part, want in model.items():
            differ = int(np.count_nonzero(want.view(np.uint32) != buckets[part].view(np.uint32)))
            if differ:
                raise FormatError(f"{reader.dir}: {e.name}: the optimizer's fp32 weights at the derived places in "
                                  f"the buckets differ from the model's in {differ} of {want.size} elements: the "
                                  "derived buffer layout does not fit this checkpoint; convert with --via-megatron")
    return True


def convert(iter_dir: str, output_dir: str, extra_argv=(), nproc=None, workers: int = 1,
            progress: bool = True) -> dict:
    """Convert one torch_dist `iter_XXXXXXX` folder into `output_dir`; returns the summary."""
    started = time.perf_counter()
    plan = plan_conversion(iter_dir, extra_argv, nproc)
    reader = DcpReader(iter_dir)
    metas = {n: mf.tensor_entry(n, e.shape, e.padded_rows is not None, e.padding_rows, e.states, e.buffer)
             for n, e in plan.atomics.items()}

    def opener(name):
        entry = plan.atomics[name]
        return lambda state: assemble(entry, plan, reader, state)

    try:
        return stream_write.write_checkpoint(output_dir, plan.iteration, metas, opener, plan.head, plan.rng,
                                             workers, progress, started)
    finally:
        reader.close()
