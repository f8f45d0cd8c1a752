"""The one mapping from a megatron-core model to atomic tensors: megatron's sharded_state_dict.

megatron-core describes every tensor it checkpoints, for its own `torch_dist` format, on every
spec it builds (transformer-engine or local, MLA, MTP, uneven pipelines, experts): a
`ShardedTensor` with a key, the global shape, where this rank's data sits in it, axes prepended
for stacked layers and experts, `allow_shape_mismatch` on the padded vocabulary. This module
reads that description, once per model (it does not change between saves), and turns each
parameter and persistent buffer this rank holds into a `LocalTensor`:

- name: megatron's key with the prepended coordinates made global, spelled as megatron spells
  them itself with `singleton_local_shards` (`decoder.layers.<L>.`, `experts.experts.<E>.`);
  the two SwiGLU halves it splits one parameter into stay one atomic tensor;
- boxes: where each ShardedTensor's data sits in the parameter (its storage offset) and which
  box of the global tensor it holds; the true vocabulary rows are the atomic tensor, the
  padding rows its second part (layout.box_pieces);
- fragment: the distributed optimizer's share, from its own range map (optimizer_state.py).

Two names of one tensor are made one: the local spec keeps a MoE layer's pre-MLP norm under
`mlp.linear_fc1.layer_norm_*` (its keys map), transformer-engine's spec under
`pre_mlp_layernorm.*`; the atomic name is the latter (docs/FORMAT.md).
"""

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state

from megatron_ucp.errors import LayoutError
from megatron_ucp.format.layout import Box, Rule, atomic_shape_from_local, box_pieces, boxes_of
from megatron_ucp.mcore import megatron_fsdp
from megatron_ucp.mcore.fsdp2 import local_shard, unevenly_sharded
from megatron_ucp.mcore.optimizer_state import Fragment, fragments as optimizer_fragments

_SWIGLU_HALF = re.compile(r"_[wv]$")  # megatron's singleton spelling of the two SwiGLU halves
_MOE_NORM = re.compile(r"^(.*\.)mlp\.linear_fc1\.layer_norm_(weight|bias)$")


@dataclass
class LocalTensor:
    name: str  # atomic tensor name (global layer number, global expert id)
    param: torch.Tensor  # the parameter (or persistent buffer) this rank holds
    atomic_shape: tuple
    boxes: Tuple[Box, ...]  # which parts of the global (padded) tensor it holds, and where
    padded_rows: Optional[int]  # vocabulary tensors: rows with padding; else None
    writes: bool  # False for a copy of a tensor another stage owns (the tied output layer)
    fragment: Optional[Fragment]
    stateless: bool = False  # a persistent buffer (e.g. the router's expert bias): no optimizer state
    write_back: Optional[list] = None  # (canonical copy, model tensor) pairs to copy back after a load
    # An expert parameter (megatron's `allreduce = False`): replicated over the expert
    # data-parallel group, where other parameters are over the data-parallel (and context) one.
    expert: bool = False

    def pieces(self, padding_rows_held: Optional[int] = None):
        """Its pieces of the atomic tensor (and of the vocabulary padding, `padding_rows_held`
        rows of it on load)."""
        return box_pieces(self.boxes, self.atomic_shape, self.padded_rows, padding_rows_held)

    @property
    def padding_rows(self) -> int:
        return self.padded_rows - self.atomic_shape[0] if self.padded_rows is not None else 0

    def apply_write_back(self) -> None:
        for canonical, target in self.write_back or ():
            with torch.no_grad():
                target.copy_(canonical.t())


@dataclass(frozen=True)
class _Geometry:
    """What the mapping knows of one model tensor: layout-dependent, fixed for a model."""

    name: str
    tensor: torch.Tensor
    atomic_shape: tuple
    boxes: Tuple[Box, ...]
    padded_rows: Optional[int]
    writes: bool
    stateless: bool


def _sharded_tensors(gpt, metadata) -> Dict[int, tuple]:
    """id(tensor) -> (the model's tensor, its ShardedTensors), factories built."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    # Megatron-LM passes the data-parallel group; megatron's MTP stage needs it.
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True), **metadata}
    out: dict = {}
    for v in nested_values(gpt.sharded_state_dict(metadata=metadata)):
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            found = [built] if isinstance(built, ShardedTensor) else [
                t for t in nested_values(built) if isinstance(t, ShardedTensor)]
        elif isinstance(v, ShardedTensor):
            found = [v]
        else:
            continue
        out.setdefault(id(v.data), (v.data, []))[1].extend(found)
    return out


def _global_name(default_key: str, singleton: list, where: str) -> str:
    """The one name megatron's singleton spelling gives a tensor (its SwiGLU halves' `_w` and
    `_v` suffixes dropped)."""
    names = {(_SWIGLU_HALF.sub("", st.key) if not _SWIGLU_HALF.search(default_key) else st.key)
             for st in singleton}
    if len(names) != 1:
        raise LayoutError(f"{where}: megatron names it {sorted(names)} with global numbering; one name expected")
    return names.pop()


def _boxes(tensor: torch.Tensor, sharded: list, where: str) -> Tuple[Box, ...]:
    """Each ShardedTensor as a box of the global tensor at its offset in `tensor`'s elements;
    together they must cover the tensor once."""
    if not tensor.is_contiguous():
        raise LayoutError(f"{where}: the model tensor is not contiguous")
    boxes = []
    for st in sharded:
        data, n = st.data, st.prepend_axis_num
        if getattr(st, "flattened_range", None) is not None or not data.is_contiguous():
            raise LayoutError(f"{where}: megatron maps a non-contiguous part of it ({st.key!r}); universal "
                              "checkpoints map contiguous parts only")
        if data.device.type != "meta" and data.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
            raise LayoutError(f"{where}: megatron's sharded tensor {st.key!r} is a copy, not a view of it")
        start = data.storage_offset() - tensor.storage_offset()
        if start < 0 or start + data.numel() > tensor.numel():
            raise LayoutError(f"{where}: {st.key!r} lies outside it")
        boxes.append(Box(start, tuple(st.global_offset[n:]), tuple(st.local_shape)))
    covered = 0
    for b in sorted(boxes, key=lambda b: b.local_start):
        if b.local_start != covered:
            raise LayoutError(f"{where}: megatron's sharded tensors cover its elements "
                              f"{'twice' if b.local_start < covered else 'with a gap'} at {covered}")
        covered += b.numel
    if covered != tensor.numel():
        raise LayoutError(f"{where}: megatron's sharded tensors cover {covered} of its {tensor.numel()} elements")
    return tuple(boxes)


def _geometry(gpt, vocab_size: int, params: set, singleton: dict, grouped: set) -> List[_Geometry]:
    """Every tensor megatron checkpoints for this model chunk but the legacy grouped experts
    (`grouped`: their ids), mapped (see module docstring); `singleton`: megatron's global names."""
    default = _sharded_tensors(gpt, {})
    out = []
    for key, (tensor, sharded) in default.items():
        if key in grouped:
            continue
        first = sharded[0]
        where = f"{first.key} ({tuple(tensor.shape)})"
        if key not in singleton:
            raise LayoutError(f"{where}: megatron names it only without global numbering")
        if {st.key for st in sharded} != {first.key}:
            raise LayoutError(f"{where}: megatron maps one tensor to several keys {sorted({st.key for st in sharded})}")
        if not tensor.is_floating_point():
            raise LayoutError(f"{where}: a {tensor.dtype} tensor; universal checkpoints hold floating-point tensors")
        global_shape = tuple(first.global_shape[first.prepend_axis_num:])
        if any(tuple(st.global_shape[st.prepend_axis_num:]) != global_shape for st in sharded):
            raise LayoutError(f"{where}: its sharded tensors disagree on the global shape")
        padded = None
        atomic = global_shape
        if first.allow_shape_mismatch:  # megatron's mark of the padded vocabulary
            padded = global_shape[0]
            if padded < vocab_size:
                raise LayoutError(f"{where}: {padded} vocabulary rows, fewer than the vocabulary ({vocab_size})")
            atomic = (vocab_size,) + global_shape[1:]
        replica = first.replica_id
        writes = (replica[0] if isinstance(replica, tuple) else 0) == 0  # 1: a copy of another stage's
        out.append(_Geometry(_global_name(first.key, singleton[key][1], where), tensor, atomic,
                             _boxes(tensor, sharded, where), padded, writes, key not in params))
    names = {g.name for g in out}
    return [_canonical(g, names) for g in out]


def _canonical(g: _Geometry, names: set) -> _Geometry:
    """The local spec's name of a MoE layer's pre-MLP norm becomes transformer-engine's."""
    m = _MOE_NORM.match(g.name)
    if m and f"{m.group(1)}mlp.linear_fc1.weight" not in names:
        return _Geometry(f"{m.group(1)}pre_mlp_layernorm.{m.group(2)}", g.tensor, g.atomic_shape, g.boxes,
                         g.padded_rows, g.writes, g.stateless)
    return g


def _legacy_grouped_weights(gpt, singleton: dict) -> list:
    """megatron's legacy GroupedMLP weights: (which, parameter, its experts' names, local experts).

    Its sharded state dict holds copies (transposed experts), not views, so its geometry is the
    oracle's (legacy_grouped_tensors); the names are megatron's (singleton spelling).
    megatron-core 0.18 removed GroupedMLP (TE's grouped experts are its only grouped layout)."""
    import megatron.core.transformer.moe.experts as experts

    GroupedMLP = getattr(experts, "GroupedMLP", None)
    if GroupedMLP is None:
        return []

    out = []
    for m in gpt.modules():
        if isinstance(m, GroupedMLP):
            for which, param in (("1", m.weight1), ("2", m.weight2)):
                names = list(dict.fromkeys(_SWIGLU_HALF.sub("", st.key) for st in singleton[id(param)][1]))
                out.append((which, param, names, m.num_local_experts))
    return out


def _mapping(gpt, vocab_size: int, chunk=None) -> tuple:
    """(geometry, legacy grouped weights) of one model chunk, computed once: megatron's
    description of a model does not change while it trains. `chunk`: the wrapped chunk, whose
    Megatron-FSDP puts the module's own parameters in place for megatron to describe."""
    cached = getattr(gpt, "_ucp_geometry", None)
    if cached is not None and cached[0] == vocab_size:
        return cached[1], cached[2]
    with megatron_fsdp.module_parameters(chunk) as own:
        found, grouped = _described(gpt, vocab_size)
    if own:  # Megatron-FSDP: the geometry of its own parameters, described through their twins
        if grouped:
            raise LayoutError("Megatron-FSDP with megatron's legacy grouped-GEMM experts is not mapped; use "
                              "the sequential or transformer-engine grouped experts")
        found = [dataclasses.replace(g, tensor=own.get(id(g.tensor), g.tensor)) for g in found]
    gpt.__dict__["_ucp_geometry"] = (vocab_size, found, grouped)
    return found, grouped


def _described(gpt, vocab_size: int) -> tuple:
    uneven = unevenly_sharded(gpt.named_parameters())
    if uneven:
        raise LayoutError(f"torch FSDP2 pads the shards of {uneven[:3]}, which megatron's sharded state dict "
                          "describes as even: choose sizes that divide over the data-parallel group")
    singleton = _sharded_tensors(gpt, {"singleton_local_shards": True})
    grouped = _legacy_grouped_weights(gpt, singleton)
    grouped_ids = {id(param) for _, param, _, _ in grouped}
    found = _geometry(gpt, vocab_size, {id(local_shard(p)) for p in gpt.parameters()}, singleton, grouped_ids)
    mapped = {id(g.tensor) for g in found} | grouped_ids
    missing = [n for n, p in gpt.named_parameters() if id(local_shard(p)) not in mapped]
    if missing:
        raise LayoutError(f"megatron's sharded state dict does not describe parameters {missing[:5]}")
    return found, grouped


def geometry(gpt, vocab_size: int) -> List[_Geometry]:
    """megatron's description of every tensor of one model chunk (but legacy grouped experts)."""
    return _mapping(gpt, vocab_size)[0]


def legacy_grouped_tensors(names: List[str], which: str, param, fragment, gated: bool,
                           num_local: int) -> List[LocalTensor]:
    """One LocalTensor per local expert of a legacy grouped weight (`names`: theirs, in order)."""
    if len(names) != num_local:
        raise LayoutError(f"{names[:1]}: {len(names)} expert names for {num_local} local experts")
    if fragment is not None and (fragment.start, fragment.stop) != (0, param.numel()):
        raise LayoutError(
            f"{names[0]}: the distributed optimizer cuts megatron's legacy grouped-GEMM expert weights "
            f"across transposed experts, which universal checkpoints do not map; use the "
            f"sequential or transformer-engine grouped experts (moe_use_legacy_grouped_gemm=False)")
    tp, tp_rank = (parallel_state.get_expert_tensor_parallel_world_size(),
                   parallel_state.get_expert_tensor_parallel_rank())
    hidden = param.shape[0] if which == "1" else param.shape[1]
    rule = (Rule("gated") if gated else Rule("split", 0)) if which == "1" else Rule("split", 1)
    out = []
    for i, name in enumerate(names):
        def block(flat):
            per = flat.numel() // num_local
            b = flat.view(-1)[i * per:(i + 1) * per]
            return b.view(hidden, -1) if which == "1" else b.view(-1, hidden)

        target = block(param.data)
        canonical = target.t().contiguous()
        pairs = [(canonical, target)]
        frag = None
        if fragment is not None:
            main = canonical if fragment.main_is_model else block(fragment.main).t().contiguous()
            if not fragment.main_is_model:
                pairs.append((main, block(fragment.main)))
            moments = []
            for moment in (fragment.exp_avg, fragment.exp_avg_sq):
                copy = None if moment is None else block(moment).t().contiguous()
                if copy is not None:
                    pairs.append((copy, block(moment)))
                moments.append(None if copy is None else copy.view(-1))
            frag = Fragment(0, canonical.numel(), main.view(-1), moments[0], moments[1],
                            fragment.main_is_model, fragment.store)
        atomic = atomic_shape_from_local(rule, tuple(canonical.shape), tp)
        out.append(LocalTensor(name, canonical, atomic, tuple(boxes_of(rule, atomic, tp, tp_rank)), None,
                               True, frag, write_back=pairs, expert=not getattr(param, "allreduce", True)))
    return out


def _held_part(t: LocalTensor, shard) -> LocalTensor:
    """A Megatron-FSDP parameter as this rank holds it: the model weights of its shard (rows
    [start, stop) of the parameter, megatron's boxes cut to them, its optimizer fragment
    rebased), or all of them where the weights are not sharded (the fragment as is)."""
    param = t.param
    if not shard.sharded_weights:
        return LocalTensor(t.name, shard.weights.view(param.shape), t.atomic_shape, t.boxes, t.padded_rows,
                           t.writes, t.fragment, t.stateless, expert=t.expert)
    row = math.prod(param.shape[1:])  # from the shape: the storage may be freed
    rows = (shard.stop - shard.start) // row
    f = t.fragment
    if f is not None:
        if (f.start, f.stop) != (shard.start, shard.stop):
            raise LayoutError(f"{t.name}: Megatron-FSDP's optimizer holds elements [{f.start}, {f.stop}) of it, "
                              f"its weight buffer [{shard.start}, {shard.stop})")
        f = Fragment(0, f.stop - f.start, f.main, f.exp_avg, f.exp_avg_sq, f.main_is_model, f.store)
    return LocalTensor(t.name, shard.weights.view((rows,) + tuple(param.shape[1:])), t.atomic_shape,
                       megatron_fsdp.restrict(t.boxes, row, shard.start, shard.stop), t.padded_rows, t.writes, f,
                       t.stateless, expert=t.expert)


def unwrap(chunk: torch.nn.Module):
    """The GPTModel inside megatron's DDP and Float16Module wrappers."""
    from megatron.core.models.gpt import GPTModel

    while not isinstance(chunk, GPTModel):
        chunk = chunk.module
    return chunk


def padded_vocab(model_chunks) -> Optional[int]:
    """The padded vocabulary the model was built with (GPTModel's vocab_size, on every pipeline
    stage), or None where a model does not say."""
    size = getattr(unwrap(model_chunks[0]), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def local_tensors(model_chunks, optimizer, vocab_size: int, for_load: bool = False) -> List[LocalTensor]:
    """Every parameter (and persistent buffer) this rank holds, named and mapped; `vocab_size`
    is the true vocabulary. `for_load`: the optimizer state is about to be overwritten."""
    fragments = optimizer_fragments(optimizer, for_load) if optimizer is not None else {}
    out = []
    for chunk in model_chunks:
        gpt = unwrap(chunk)
        found, grouped = _mapping(gpt, vocab_size, chunk)
        held = megatron_fsdp.shards(chunk)
        for g in found:
            t = LocalTensor(g.name, g.tensor, g.atomic_shape, g.boxes, g.padded_rows, g.writes,
                            None if g.stateless else fragments.get(g.tensor), g.stateless,
                            expert=not getattr(g.tensor, "allreduce", True))
            out.append(_held_part(t, held[id(g.tensor)]) if id(g.tensor) in held else t)
        gated = bool(gpt.config.gated_linear_unit)
        for which, param, names, num_local in grouped:
            out += legacy_grouped_tensors(names, which, param, fragments.get(param), gated, num_local)
    return out
