"""`dp_reshardable` optimizer state in a torch_dist checkpoint: where each parameter's TP-local
slice lies in the source ranks' bucket tensors, and the checks that the derived places are right.

megatron-core saves one flat tensor per (model-parallel rank, buffer, bucket), for the dense
distributed optimizer and, with MoE and expert parallelism, the experts' one chained after it.
Where a parameter lies in it is megatron's buffer layout (buffer_layout.bucket_layout), computed
per source rank and virtual stage from the meta model's parameter order. Three checks stop a
wrong derivation: each bucket's size against the saved `per_bucket_numel_unpadded`, every
parameter's ends against the saved chunks' boundaries, and (fp32) the weights found at the
derived places against the model's.
"""

import math
import re
from dataclasses import dataclass
from typing import List

import numpy as np

from megatron_ucp.convert.buffer_layout import EMBEDDING, OUTPUT, bucket_layout, shared_embedding
from megatron_ucp.convert.dcp_reader import DcpReader
from megatron_ucp.convert.torch_dist_sources import FlatSource, from_boxes, from_buckets
from megatron_ucp.errors import FormatError, IncompleteCheckpointError, LayoutError
from megatron_ucp.format.layout import layer_offset, local_shape

DIST_PREFIX = "optimizer.distributed.dp_group_idx_"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.experts\.(\d+)\.")


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


def map_buckets(reader: DcpReader, source, world: int, tensors, atomics: dict, stored: dict) -> None:
    """`dp_reshardable`: each atomic tensor's TP-local pieces inside the bucket tensors of the
    source's model-parallel ranks, for the dense optimizer and (MoE) the experts' one."""
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
            saved = reader.read_object(object_key(reader, d.prefix, group, "per_bucket_numel_unpadded"))
            if isinstance(saved, list) and len(saved) == 1 and isinstance(saved[0], list):
                saved = saved[0]  # the sharded object's own wrapping; then one entry per buffer
            for c in range((vpp or 1)):
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
                    items.append((t.name, numel, shared_embedding(t.name, c, vpp or 1, pp_rank, pp, tied)))
                # the tied embedding's last-stage copy: a parameter of that stage, marked shared
                if d.members != "experts" and shared_embedding(OUTPUT, c, vpp or 1, pp_rank, pp, tied):
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


def object_key(reader: DcpReader, prefix: str, group: int, what: str) -> str:
    """The key of a distributed-optimizer group's sharded object `what` (its saved bucket sizes,
    the optimizer's common state)."""
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
        model, buckets = from_boxes(e, reader, ""), from_buckets(e, reader, "param")
        for part, want in model.items():
            differ = int(np.count_nonzero(want.view(np.uint32) != buckets[part].view(np.uint32)))
            if differ:
                raise FormatError(f"{reader.dir}: {e.name}: the optimizer's fp32 weights at the derived places in "
                                  f"the buckets differ from the model's in {differ} of {want.size} elements: the "
                                  "derived buffer layout does not fit this checkpoint; convert with --via-megatron")
    return True
