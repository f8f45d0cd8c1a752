"""Megatron glue: name every local parameter as an atomic tensor and find its optimizer state.

This is the only module that knows megatron-core's parameter names and attributes (the
optimizer's side is optimizer_state.py). It turns (model chunks, optimizer) into a list of
`LocalTensor`s: for each parameter this rank holds, the atomic tensor it belongs to, its layout
rule and TP coordinates, and the contiguous fragment of its flattened local tensor whose fp32
master weight and Adam moments live on this rank (the whole tensor without the distributed
optimizer).
"""

import re
from dataclasses import dataclass
from typing import List, Optional

import torch
from megatron.core import parallel_state

from megatron_ucp.errors import LayoutError
from megatron_ucp.layout import Rule, atomic_shape_from_local, layer_offset
from megatron_ucp.optimizer_state import Fragment, fragments as optimizer_fragments

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
# transformer-engine's grouped GEMM keeps one parameter per local expert: weight0, weight1, ...
_TE_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
# megatron's legacy GroupedMLP fuses all local experts, transposed, in one tensor.
_LEGACY_GROUPED = re.compile(r"^mlp\.experts\.weight([12])$")


@dataclass
class LocalTensor:
    name: str  # atomic tensor name (global layer number, global expert id)
    param: torch.nn.Parameter
    rule: Rule
    tp: int
    tp_rank: int
    atomic_shape: tuple
    padded_rows: Optional[int]
    writes: bool  # False for the tied output-layer copy of the embedding
    fragment: Optional[Fragment]
    stateless: bool = False  # a persistent buffer (e.g. the router's expert bias): no optimizer state
    write_back: Optional[list] = None  # (canonical copy, model tensor) pairs to copy back after a load

    def apply_write_back(self) -> None:
        for canonical, target in self.write_back or ():
            with torch.no_grad():
                target.copy_(canonical.t())


def _expert_rule(name: str, gated: bool) -> Rule:
    """Routed experts are column (fc1) / row (fc2) parallel over expert-TP, by name: grouped
    layouts do their own communication and do not mark their parameters."""
    if re.search(r"\.linear_fc1\.(weight|bias)$", name):
        return Rule("gated") if gated else Rule("split", 0)
    if name.endswith(".linear_fc2.weight"):
        return Rule("split", 1)
    return Rule("replicated")


def _rule_for(local_name: str, param, gated: bool) -> Rule:
    if local_name in (EMBEDDING, OUTPUT):
        return Rule("vocab")
    if _is_expert(local_name):
        return _expert_rule(local_name, gated)
    if not getattr(param, "tensor_model_parallel", False):
        return Rule("replicated")
    dim = int(getattr(param, "partition_dim", 0))
    if gated and re.search(r"(^|\.)linear_fc1\.(weight|bias)$", local_name) and dim == 0:
        return Rule("gated")
    return Rule("split", dim)


def _is_expert(local_name: str) -> bool:
    """Routed-expert params (not shared experts) are sharded over the expert-TP group.

    By name: megatron's `allreduce=False` marker is only set when expert parallelism is on.
    """
    return ".mlp.experts." in local_name


def _tp_coords(local_name: str):
    if _is_expert(local_name):
        return (parallel_state.get_expert_tensor_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_rank())
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank())


def expert_name(rest: str, num_local: int, ep_rank: int) -> Optional[str]:
    """The layout-free name of a routed-expert parameter (`rest` is the name inside its layer).

    Sequential experts (`local_experts.<i>`) and transformer-engine's grouped experts
    (`linear_fc1.weight<i>`) both map to `mlp.experts.local_experts.<global id>.<...>`; the
    global id is ep_rank x num_local + i. Returns None for any other name.
    """
    e = _EXPERT.match(rest)
    if e:
        local, tail = int(e.group(1)), e.group(2)
    else:
        g = _TE_GROUPED.match(rest)
        if not g:
            return None
        local, tail = int(g.group(3)), f"{g.group(1)}.{g.group(2)}"
    if not 0 <= local < num_local:
        raise LayoutError(f"{rest}: local expert {local} outside 0..{num_local - 1}")
    return f"mlp.experts.local_experts.{ep_rank * num_local + local}.{tail}"


def _global_layer(gpt, local_name: str, vp_stage: Optional[int], pp_rank: int, pp: int,
                  vpp: Optional[int]):
    """(global layer index, the rest of the name, the layer module), or None outside layers."""
    m = _LAYER.match(local_name)
    if not m:
        return None
    local_index, rest = int(m.group(1)), m.group(2)
    layer = gpt.decoder.layers[local_index]
    global_index = layer.layer_number - 1
    expected = layer_offset(gpt.config.num_layers, pp, pp_rank, vpp, vp_stage) + local_index
    if global_index != expected:
        raise LayoutError(
            f"{local_name}: megatron numbers this layer {global_index}, the even pipeline split "
            f"gives {expected}; uneven pipeline splits are not supported"
        )
    return global_index, rest, layer


def _global_name(gpt, local_name, vp_stage, pp_rank, pp, vpp) -> str:
    """The atomic name: global layer number, global expert id, sequential-expert spelling."""
    where = _global_layer(gpt, local_name, vp_stage, pp_rank, pp, vpp)
    if where is None:
        return local_name
    global_index, rest, layer = where
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is not None:
        rest = expert_name(rest, experts.num_local_experts,
                           parallel_state.get_expert_model_parallel_rank()) or rest
    return f"decoder.layers.{global_index}.{rest}"


def _persistent_buffers(gpt):
    """Floating-point buffers that megatron saves with the model (e.g. the router's expert bias)."""
    for module_name, module in gpt.named_modules():
        for name, buf in module._buffers.items():
            if (buf is not None and buf.is_floating_point()
                    and name not in module._non_persistent_buffers_set):
                yield f"{module_name}.{name}" if module_name else name, buf


def _legacy_grouped(name, which: str, param, fragment, gated: bool, num_local: int) -> List["LocalTensor"]:
    """Megatron's legacy GroupedMLP: `weight1` holds each local expert's fc1 as a contiguous,
    transposed [hidden, fc1 rows] block (`weight2`: fc2 as [fc2 columns, hidden]). Each expert
    becomes a LocalTensor over a transposed copy, copied back after a load. `name` is the global
    name of `weight<which>`."""
    prefix = name[: -len(f".weight{which}")]
    if fragment is not None and (fragment.start, fragment.stop) != (0, param.numel()):
        raise LayoutError(
            f"{name}: the distributed optimizer cuts megatron's legacy grouped-GEMM expert weights "
            f"across transposed experts, which universal checkpoints do not map; use the "
            f"sequential or transformer-engine grouped experts (moe_use_legacy_grouped_gemm=False)")
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    tp, tp_rank = (parallel_state.get_expert_tensor_parallel_world_size(),
                   parallel_state.get_expert_tensor_parallel_rank())
    hidden = param.shape[0] if which == "1" else param.shape[1]
    out = []
    for i in range(num_local):
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
        atomic_name = f"{prefix}.local_experts.{ep_rank * num_local + i}.linear_fc{which}.weight"
        rule = _expert_rule(atomic_name, gated)
        atomic = atomic_shape_from_local(rule, tuple(canonical.shape), tp)
        out.append(LocalTensor(atomic_name, canonical, rule, tp, tp_rank, atomic, None, True, frag,
                               write_back=pairs))
    return out


def local_tensors(model_chunks, optimizer, vocab_size: int, for_load: bool = False) -> List[LocalTensor]:
    """Every parameter (and persistent buffer) this rank holds, named and mapped; `vocab_size`
    is the true vocabulary. `for_load`: the optimizer state is about to be overwritten."""
    from megatron_ucp.train.model import unwrap

    fragments = optimizer_fragments(optimizer, for_load) if optimizer is not None else {}
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    out = []
    for stage, chunk in enumerate(model_chunks):
        gpt = unwrap(chunk)
        vp_stage = stage if vpp else None
        gated = bool(gpt.config.gated_linear_unit)
        tied = bool(gpt.share_embeddings_and_output_weights)
        for local_name, param in gpt.named_parameters():
            name = _global_name(gpt, local_name, vp_stage, pp_rank, pp, vpp)
            in_layer = _LAYER.match(local_name)
            grouped = in_layer and _LEGACY_GROUPED.match(in_layer.group(2))
            if grouped:
                experts = gpt.decoder.layers[int(in_layer.group(1))].mlp.experts
                out += _legacy_grouped(name, grouped.group(1), param, fragments.get(param), gated,
                                       experts.num_local_experts)
                continue
            rule = _rule_for(name, param, gated)
            tp, tp_rank = _tp_coords(name)
            writes = True
            if local_name == OUTPUT and tied:
                name, writes = EMBEDDING, False  # the last stage's copy of the tied embedding
            padded = param.shape[0] * tp if rule.kind == "vocab" else None
            atomic = atomic_shape_from_local(rule, tuple(param.shape), tp, vocab_size)
            out.append(LocalTensor(name, param, rule, tp, tp_rank, atomic, padded, writes,
                                   fragments.get(param)))
        for local_name, buf in _persistent_buffers(gpt):
            name = _global_name(gpt, local_name, vp_stage, pp_rank, pp, vpp)
            out.append(LocalTensor(name, buf, Rule("replicated"), 1, 0, tuple(buf.shape), None,
                                   True, None, stateless=True))
    return out
