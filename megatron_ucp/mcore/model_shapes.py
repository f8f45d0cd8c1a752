"""What each rank of a megatron-core GPT job holds, from the model's shape and the layout alone.

The real save reads this from megatron (model_map.py); a simulation of thousands of ranks
(benchmarks/bench_scale.py) cannot build those models, so this module derives the same
description with pure functions: each rank's atomic tensors (megatron's names, local spec),
their boxes (layout.boxes_of, the rules' oracle) and the distributed optimizer's share of each
(megatron's gradient-buffer layout: parameters in reverse registration order, each start padded
to 64 elements, buckets padded to lcm(DP, 128) and split evenly over the data-parallel group).
tests/test_model_shapes.py checks the output against model_map on small real models, so the
simulation cannot drift from the real mapping.
"""

import bisect
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

from megatron_ucp.format.layout import Box, Rule, box_pieces, boxes_of, local_shape


@dataclass(frozen=True)
class MLA:
    """Multi-latent attention (DeepSeek-V2/V3) dimensions."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_groups: int
    vocab: int
    kv_channels: Optional[int] = None  # default hidden // heads
    make_vocab_size_divisible_by: int = 128
    gated: bool = True  # SwiGLU
    norm_bias: bool = False  # LayerNorm (True) or RMSNorm (False)
    linear_bias: bool = False
    tied: bool = False
    learned_positions: int = 0  # rows of learned absolute position embeddings (0: RoPE)
    num_experts: int = 0
    moe_ffn: Optional[int] = None
    shared_expert_ffn: Optional[int] = None
    moe_layers: Optional[Tuple[int, ...]] = None  # 1 where a layer is MoE (default: all, with experts)
    expert_bias: bool = False  # the router's aux-loss-free bias (a persistent buffer)
    mla: Optional[MLA] = None

    def is_moe(self, layer: int) -> bool:
        if not self.num_experts:
            return False
        return bool(self.moe_layers[layer]) if self.moe_layers is not None else True


@dataclass(frozen=True)
class Parallel:
    tp: int
    pp: int
    dp: int
    ep: int = 1
    etp: Optional[int] = None  # expert TP (default tp)
    distributed_optimizer: bool = True
    stage_layers: Optional[Tuple[int, ...]] = None  # layers per pipeline stage (default even)
    overlap_grad_reduce: bool = True  # buckets of max(40M, 1M x DP) elements, as megatron sizes them

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        n = self.tp * self.dp
        if n % (self.expert_tp * self.ep):
            raise ValueError(f"TP x DP = {n} is not divisible by expert TP x EP = {self.expert_tp * self.ep}")
        return n // (self.expert_tp * self.ep)


@dataclass(frozen=True)
class Range:
    start: int
    stop: int


@dataclass
class SimTensor:
    """What the save plan needs of one local tensor (model_map.LocalTensor's geometry)."""

    name: str
    atomic_shape: tuple
    boxes: Tuple[Box, ...]
    padded_rows: Optional[int]
    writes: bool
    stateless: bool = False
    expert: bool = False
    fragment: Optional["Range"] = None  # distributed optimizer's [start, stop) of the local flat tensor
    numel: int = 0  # elements of the local tensor

    @property
    def padding_rows(self) -> int:
        return self.padded_rows - self.atomic_shape[0] if self.padded_rows is not None else 0

    def pieces(self, padding_rows_held: Optional[int] = None):
        return box_pieces(self.boxes, self.atomic_shape, self.padded_rows, padding_rows_held)


@dataclass(frozen=True)
class Coord:
    """A rank's place: tensor, pipeline and data-parallel ranks, and its expert coordinates."""

    rank: int
    tp: int
    pp: int
    dp: int
    etp: int
    ep: int
    edp: int


def coord(par: Parallel, rank: int) -> Coord:
    """megatron's default order (tp-cp-ep-dp-pp): TP fastest, then DP, then PP; experts re-split
    a stage's TP x DP ranks as expert TP (fastest), EP, expert DP."""
    within, pp = rank % (par.tp * par.dp), rank // (par.tp * par.dp)
    etp = par.expert_tp
    return Coord(rank, within % par.tp, pp, within // par.tp, within % etp, (within // etp) % par.ep,
                 within // (etp * par.ep))


def stage_layers(shape: ModelShape, par: Parallel) -> List[range]:
    """The global layers of each pipeline stage."""
    counts = list(par.stage_layers) if par.stage_layers else None
    if counts is None:
        if shape.num_layers % par.pp:
            raise ValueError(f"{shape.num_layers} layers do not split evenly over {par.pp} stages; give stage_layers")
        counts = [shape.num_layers // par.pp] * par.pp
    if len(counts) != par.pp or sum(counts) != shape.num_layers:
        raise ValueError(f"stage_layers {counts} must give {par.pp} stages {shape.num_layers} layers")
    starts = [sum(counts[:i]) for i in range(par.pp)]
    return [range(s, s + n) for s, n in zip(starts, counts)]


def padded_vocab(shape: ModelShape, tp: int) -> int:
    m = shape.make_vocab_size_divisible_by * tp
    return -(-shape.vocab // m) * m


def _param(name, shape, rule, tp, tp_rank, writes=True, stateless=False, expert=False, padded=None):
    boxes = tuple(boxes_of(rule, shape, tp, tp_rank, padded))
    return SimTensor(name, tuple(shape), boxes, padded, writes, stateless, expert,
                     numel=math.prod(local_shape(rule, shape, tp, padded)))


def _layer(shape: ModelShape, par: Parallel, c: Coord, layer: int) -> List[SimTensor]:
    """One layer's tensors on rank `c`, in megatron's registration order (local spec)."""
    h, tp, t = shape.hidden, par.tp, c.tp
    p = f"decoder.layers.{layer}."
    rep, col, row = Rule("replicated"), Rule("split", 0), Rule("split", 1)
    fc1 = Rule("gated") if shape.gated else col
    out = []

    def norm(name, n, suffix=("weight", "bias")):
        out.append(_param(p + name + suffix[0], (n,), rep, tp, t))
        if shape.norm_bias:
            out.append(_param(p + name + suffix[1], (n,), rep, tp, t))

    # The local spec registers input_layernorm first and pre_mlp_layernorm before the MLP, but
    # names them as transformer-engine fuses them into the next linear (its keys map).
    fused = ("layer_norm_weight", "layer_norm_bias")
    if shape.mla is None:
        kv = shape.kv_channels or h // shape.heads
        qkv = (shape.heads + 2 * shape.kv_groups) * kv
        norm("self_attention.linear_qkv.", h, fused)
        out.append(_param(p + "self_attention.linear_proj.weight", (h, shape.heads * kv), row, tp, t))
        if shape.linear_bias:
            out.append(_param(p + "self_attention.linear_proj.bias", (h,), rep, tp, t))
        out.append(_param(p + "self_attention.linear_qkv.weight", (qkv, h), col, tp, t))
        if shape.linear_bias:
            out.append(_param(p + "self_attention.linear_qkv.bias", (qkv,), col, tp, t))
    else:  # not checked against a real model (tests/test_model_shapes.py builds no MLA)
        m = shape.mla
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        norm("input_layernorm.", h)
        out.append(_param(p + "self_attention.linear_proj.weight", (h, shape.heads * m.v_head_dim), row, tp, t))
        out.append(_param(p + "self_attention.linear_q_down_proj.weight", (m.q_lora_rank, h), rep, tp, t))
        out.append(_param(p + "self_attention.linear_q_up_proj.weight", (shape.heads * qk, m.q_lora_rank), col, tp, t))
        out.append(_param(p + "self_attention.linear_kv_down_proj.weight", (m.kv_lora_rank + m.qk_pos_emb_head_dim, h),
                          rep, tp, t))
        out.append(_param(p + "self_attention.linear_kv_up_proj.weight",
                          (shape.heads * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank), col, tp, t))
        out.append(_param(p + "self_attention.q_layernorm.weight", (m.q_lora_rank,), rep, tp, t))
        out.append(_param(p + "self_attention.kv_layernorm.weight", (m.kv_lora_rank,), rep, tp, t))
    if not shape.is_moe(layer):
        width = (2 if shape.gated else 1) * shape.ffn
        norm("mlp.linear_fc1.", h, fused)
        out.append(_param(p + "mlp.linear_fc1.weight", (width, h), fc1, tp, t))
        if shape.linear_bias:
            out.append(_param(p + "mlp.linear_fc1.bias", (width,), fc1, tp, t))
        out.append(_param(p + "mlp.linear_fc2.weight", (h, shape.ffn), row, tp, t))
        if shape.linear_bias:
            out.append(_param(p + "mlp.linear_fc2.bias", (h,), rep, tp, t))
        return out
    norm("pre_mlp_layernorm.", h)
    e = shape.num_experts
    out.append(_param(p + "mlp.router.weight", (e, h), rep, tp, t))
    if shape.expert_bias:
        out.append(_param(p + "mlp.router.expert_bias", (e,), rep, tp, t, stateless=True))
    per_rank = e // par.ep
    if e % par.ep:
        raise ValueError(f"{e} experts do not split over EP {par.ep}")
    ffn = shape.moe_ffn or shape.ffn
    for x in range(c.ep * per_rank, (c.ep + 1) * per_rank):
        q = f"{p}mlp.experts.experts.{x}."
        out.append(_param(q + "linear_fc1.weight", ((2 if shape.gated else 1) * ffn, h), fc1, par.expert_tp, c.etp,
                          expert=True))
        out.append(_param(q + "linear_fc2.weight", (h, ffn), row, par.expert_tp, c.etp, expert=True))
    if shape.shared_expert_ffn:
        s = shape.shared_expert_ffn
        out.append(_param(p + "mlp.shared_experts.linear_fc1.weight", ((2 if shape.gated else 1) * s, h), fc1, tp, t))
        out.append(_param(p + "mlp.shared_experts.linear_fc2.weight", (h, s), row, tp, t))
    return out


def registered(shape: ModelShape, par: Parallel, c: Coord) -> List[SimTensor]:
    """Rank `c`'s tensors in megatron's registration order, fragments not yet set."""
    stages = stage_layers(shape, par)
    first, last = c.pp == 0, c.pp == par.pp - 1
    padded = padded_vocab(shape, par.tp)
    vocab = Rule("vocab")
    out = []
    if first:
        out.append(_param("embedding.word_embeddings.weight", (shape.vocab, shape.hidden), vocab, par.tp, c.tp,
                          padded=padded))
        if shape.learned_positions:
            out.append(_param("embedding.position_embeddings.weight", (shape.learned_positions, shape.hidden),
                              Rule("replicated"), par.tp, c.tp))
    for layer in stages[c.pp]:
        out += _layer(shape, par, c, layer)
    if last:
        out.append(_param("decoder.final_layernorm.weight", (shape.hidden,), Rule("replicated"), par.tp, c.tp))
        if shape.norm_bias:
            out.append(_param("decoder.final_layernorm.bias", (shape.hidden,), Rule("replicated"), par.tp, c.tp))
        if not shape.tied or not first:
            # A tied output layer on the last stage is a copy of the first stage's embedding.
            name = "output_layer.weight" if not shape.tied else "embedding.word_embeddings.weight"
            out.append(_param(name, (shape.vocab, shape.hidden), vocab, par.tp, c.tp, writes=not shape.tied,
                              padded=padded))
    return out


def _bucket_size(par: Parallel, dp: int) -> Optional[int]:
    return max(40_000_000, 1_000_000 * dp) if par.overlap_grad_reduce else None


def buffer_shards(numels: List[Tuple[int, bool]], dp: int, bucket_size: Optional[int]) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    """megatron's gradient buffer over parameters given in registration order ((numel, its own
    bucket: the shared embedding)): each parameter's [start, end) in the buffer (in the given
    order) and each bucket's [start, end)."""
    def pad(n, d):
        return -(-n // d) * d

    divisor = math.lcm(dp, 128)
    where = [None] * len(numels)
    buckets, bucket_start, param_start, in_bucket = [], 0, 0, 0
    for i in range(len(numels) - 1, -1, -1):  # reverse order, as backprop meets them
        n, alone = numels[i]
        param_start = pad(param_start, 64)
        if alone and in_bucket:
            end = pad(param_start, divisor)
            buckets.append((bucket_start, end))
            bucket_start = param_start = end
            in_bucket = 0
        param_end = param_start + n
        where[i] = (param_start, param_end)
        in_bucket += 1
        if (bucket_size is not None and param_end - bucket_start >= bucket_size) or alone:
            end = pad(param_end, divisor)
            buckets.append((bucket_start, end))
            bucket_start = param_start = end
            in_bucket = 0
        else:
            param_start = param_end
    if in_bucket:
        buckets.append((bucket_start, pad(param_end, divisor)))
    return where, buckets


def buffers(tensors: List[SimTensor], shape: ModelShape, par: Parallel) -> list:
    """The distributed optimizer's gradient buffers of a rank's tensors (the same for every
    data-parallel rank of its tensor/pipeline/expert coordinates): (indices of the tensors in
    the buffer, each one's [start, end) in it, the buckets, the buffer's data-parallel size,
    whether it holds experts)."""
    tied_stages = shape.tied and par.pp > 1
    out = []
    for expert, dp in ((False, par.dp), (True, par.expert_dp)):
        # The tied output layer's copy has gradients too: it sits in the buffer, unwritten.
        index = [i for i, t in enumerate(tensors) if t.expert == expert and not t.stateless]
        # Tied embedding and its copy over pipeline stages: a bucket of their own (megatron's
        # shared_embedding), so that both stages shard them alike.
        shared = [tied_stages and tensors[i].name == "embedding.word_embeddings.weight" for i in index]
        where, buckets = buffer_shards([(tensors[i].numel, s) for i, s in zip(index, shared)], dp,
                                       _bucket_size(par, dp))
        out.append((index, where, buckets, dp, expert))
    return out


def shard(buffer, dp_rank: int) -> List[Tuple[int, Range]]:
    """(tensor index, its fragment) for every tensor data-parallel rank `dp_rank` owns a part of
    in `buffer`: the rank's even share of each bucket."""
    index, where, buckets, dp, _ = buffer
    starts = [a for a, _ in where]
    order = sorted(range(len(where)), key=lambda k: starts[k])
    sorted_starts = [starts[k] for k in order]
    out = []
    for lo, hi in buckets:
        size = (hi - lo) // dp
        s_lo, s_hi = lo + dp_rank * size, lo + (dp_rank + 1) * size
        k = max(0, bisect.bisect_right(sorted_starts, s_lo) - 1)
        while k < len(order) and sorted_starts[k] < s_hi:
            a, b = where[order[k]]
            s, e = max(a, s_lo), min(b, s_hi)
            if s < e:
                out.append((index[order[k]], Range(s - a, e - a)))
            k += 1
    return out


def with_fragments(tensors: List[SimTensor], shape: ModelShape, par: Parallel, c: Coord) -> List[SimTensor]:
    """The distributed optimizer's share of each tensor on rank `c` (dense tensors over the
    data-parallel group, experts over the expert data-parallel group); stateless buffers and
    copies of another stage's tensor have none. Without it, the optimizer's fp32 copy of
    each whole local tensor."""
    if not par.distributed_optimizer:
        for t in tensors:
            if not t.stateless:
                t.fragment = Range(0, t.numel)
        return tensors
    for buffer in buffers(tensors, shape, par):
        for i, fragment in shard(buffer, c.edp if buffer[4] else c.dp):
            tensors[i].fragment = fragment
    return tensors


def rank_tensors(shape: ModelShape, par: Parallel, rank: int) -> List[SimTensor]:
    """Every tensor rank `rank` holds, with its boxes and its distributed-optimizer share."""
    c = coord(par, rank)
    return with_fragments(registered(shape, par, c), shape, par, c)
