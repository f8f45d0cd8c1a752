"""The resume proof of an imported Megatron-DeepSpeed GPT, computed from the SOURCE: a reference
forward of Megatron-DeepSpeed's model written from its own code, on the checkpoint's tensors in
their native layout (engine/proof.py, docs/FORMAT.md 4.9).

Megatron-DeepSpeed itself is not installable here, so its forward cannot run; this one follows
microsoft/Megatron-DeepSpeed's megatron/model (transformer.py ParallelAttention, ParallelMLP,
ParallelTransformerLayer; language_model.py; rotary_pos_embedding.py; rmsnorm.py;
fused_bias_gelu.py) and shares nothing with the importer's mapping (deepspeed_map, deepspeed_qkv):
- each `zero/<name>/fp32.pt` is cut back into the saving run's TP ranks as ds_to_universal merged
  them (`cat_dim`; `param_n_sub_params` 2: [sub 0 of every rank; sub 1 of every rank]; the
  vocabulary's padding rows, which it drops, as the zeros DeepSpeed's loader pads with);
- each rank computes its part as Megatron-DeepSpeed's does: `query_key_value`'s output viewed
  per key-value group [its query heads, key, value] (`split_tensor`; per head [q, k, v] before
  GQA) or, since its commit 676a482c, in thirds [Q; K; V]; rotary on the first `kv_channels`
  (non-interleaved halves); causal softmax in fp32; SwiGLU `silu(first half) * second half` of
  the rank's rows, or GELU (tanh-approximated where `bias_gelu_fusion` fuses it with the bias);
  column-parallel outputs stay per rank, row-parallel partial sums are added, the vocabulary's
  logits concatenated over ranks;
- layers run in the order of their own names (`layers.N`, or GPTModelPipe's spec indices).
The per-token cross-entropy of the probe over the padded vocabulary, in fp32 on CPU, is what the
import's first load recomputes with megatron's model: a mapping that puts right bytes in wrong
places is refused there. The `param` digests are those of the weights the import writes (as
hf_proof's: they check each load's placement; the losses check the mapping).
"""

import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from megatron_ucp.convert import deepspeed_values as dv
from megatron_ucp.engine import proof
from megatron_ucp.errors import ConfigError
from megatron_ucp.format.manifest import MAX_PROBE_TOKENS

DEVICE = "cpu/megatron-deepspeed"
MULTIPLE = 8  # the probe's length: any TP and 2 x CP of 1, 2, 4, 8 splits it
_MEMORY_FACTOR = 2  # the fp32 weights of a layer at a time, their ranks' cuts beside them; the rest: small


@dataclass(frozen=True)
class Source:
    """What Megatron-DeepSpeed's model computes, from its stored args (its defaults where absent)."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    rotary_dim: int  # 0: no rotary
    theta: float
    rmsnorm: bool
    eps: float
    swiglu: bool
    gelu_fusion: bool  # bias_gelu_impl: the tanh approximation, where a bias is fused with it
    tp: int
    vocab: int  # the true vocabulary (ds_to_universal keeps these rows)
    padded_vocab: int
    positions: int  # the positions the model computes: seq_length (rotary's table) or learned rows
    qkv: str  # 'grouped' or 'thirds'


def source_of(args: dict, uc_info: dict, tp: int, qkv_layout: str, where: str) -> Source:
    """The Source of a checkpoint's `args` (deepspeed.plain_args), `universal_checkpoint_info`,
    saving TP degree and query_key_value order (deepspeed_qkv.qkv_layout: told by its args)."""
    def count(key, default=None):
        value = args.get(key)
        return default if value is None else dv.whole(value, f"{where}: args.{key}", 1, dv.MAX_COUNT)

    def switch(key, default):
        return dv.flag(args.get(key), f"{where}: args.{key}", default)

    hidden, heads = count("hidden_size"), count("num_attention_heads")
    groups = count("num_key_value_heads", heads)
    kv = args.get("kv_channels")  # language_model.py: rotary_dim = hidden // heads where kv_channels is None
    head_dim = hidden // heads if kv is None else count("kv_channels")
    rope = switch("use_rotary_position_embeddings", False) or args.get("position_embedding_type") == "rotary"
    normalization = str(args.get("normalization", "layernorm")).lower()
    if normalization not in ("layernorm", "rmsnorm"):
        raise ConfigError(f"{where}: normalization {normalization!r:.40}: no reference forward for it")
    if heads % groups or heads % tp or groups % tp:  # core.utils.divide's asserts
        raise ConfigError(f"{where}: {heads} attention heads in {groups} key-value groups do not split over "
                          f"{tp} TP ranks")
    seq = count("seq_length")
    return Source(
        hidden=hidden, heads=heads, groups=groups, head_dim=head_dim, rotary_dim=head_dim if rope else 0,
        theta=dv.real(args.get("rope_theta", 10000), f"{where}: args.rope_theta", above=0.0) if rope else 0.0,
        rmsnorm=normalization == "rmsnorm",
        eps=dv.real(args.get("layernorm_epsilon", 1e-5), f"{where}: args.layernorm_epsilon", above=0.0),
        swiglu=switch("swiglu", False),
        # arguments.py: --no-bias-gelu-fusion (default on), turned off without linear biases
        gelu_fusion=switch("bias_gelu_fusion", True) and switch("add_bias_linear", True),
        tp=tp, vocab=dv.whole(uc_info.get("original_vocab_size"), f"{where}: original_vocab_size", 1),
        padded_vocab=dv.whole(uc_info.get("padded_vocab_size", args.get("padded_vocab_size")),
                              f"{where}: padded_vocab_size", 1),
        positions=min(seq, count("max_position_embeddings", seq)), qkv=qkv_layout)


# ---- the checkpoint's parameters, by Megatron-DeepSpeed's names ------------------------------------

@dataclass
class Names:
    """Where each of the model's parameters is, by the checkpoint's own names."""

    embedding: Dict[str, str]  # word_embeddings.weight, position_embeddings.weight
    layers: List[Dict[str, str]]  # in order: name inside the layer -> parameter name
    final_norm: Dict[str, str]  # weight, bias
    head: Optional[str]  # the untied output layer


_PLAIN_LAYER = re.compile(r"language_model\.encoder\.layers\.(\d+)\.(.+)")
_EMBEDDING = ("word_embeddings.weight", "position_embeddings.weight")


def names_of(params) -> Names:
    """GPTModel's `language_model.*` names, or GPTModelPipe's (`tied_modules.embed.*`, and `N.*`
    per layer spec: the embedding, the transformer layers, the final norm, `lm_head`, in spec
    order); ConfigError for one that is neither."""
    params = sorted(params)
    emb, layers, final, head, specs = {}, {}, {}, None, {}
    for n in params:
        plain = _PLAIN_LAYER.fullmatch(n)
        spec = re.fullmatch(r"(\d+)\.(.+)", n)
        if plain:
            layers.setdefault(int(plain.group(1)), {})[plain.group(2)] = n
        elif n.startswith("language_model.embedding.") or n.startswith("tied_modules.embed."):
            emb[n.split(".", 2)[2]] = n
        elif n.startswith("language_model.encoder.final_layernorm."):
            final[n.rsplit(".", 1)[1]] = n
        elif n == "language_model.output_layer.weight":
            head = n
        elif spec:
            specs.setdefault(int(spec.group(1)), {})[spec.group(2)] = n
        else:
            raise ConfigError(f"parameter {n!r}: not one of Megatron-DeepSpeed's GPT")
    for index in sorted(specs):
        local = specs[index]
        if "input_layernorm.weight" in local:
            layers[index] = local
        elif set(local) <= set(_EMBEDDING) and not layers:
            emb.update(local)
        elif set(local) <= {"weight", "bias"} and layers:
            final.update(local)
        elif set(local) == {"lm_head.weight"}:
            head = local["lm_head.weight"]
        else:
            raise ConfigError(f"layer spec {index} ({sorted(local)}): not a part of Megatron-DeepSpeed's GPTModelPipe")
    if "word_embeddings.weight" not in emb or "weight" not in final or not layers:
        raise ConfigError("no word embeddings, transformer layers or final norm among the parameters")
    return Names(emb, [layers[i] for i in sorted(layers)], final, head)


# ---- ds_to_universal's merge, undone: each TP rank's own tensor ------------------------------------

def rank_parts(record: dict, s: Source, name: str) -> List[torch.Tensor]:
    """The saving TP ranks' tensors of one fp32.pt record (a dict: `param`, `cat_dim`,
    `param_n_sub_params`, `vocab_tensor`, as ds_to_universal writes it)."""
    t = record["param"].detach().float()
    if record.get("vocab_tensor"):  # rows cut to the true vocabulary; DeepSpeed's loader pads zeros
        t = torch.cat([t, t.new_zeros((s.padded_vocab - t.shape[0],) + tuple(t.shape[1:]))])
    if s.tp == 1:
        return [t]
    if record.get("param_n_sub_params") == 2:  # [sub 0 of rank 0, 1, ...; sub 1 of rank 0, 1, ...]
        halves = [_cut(h, 0, s.tp, name) for h in _cut(t, 0, 2, name)]
        return [torch.cat([halves[0][r], halves[1][r]]) for r in range(s.tp)]
    if "cat_dim" in record:
        return _cut(t, int(record["cat_dim"]), s.tp, name)
    return [t] * s.tp  # replicated (tp_replicated_parameter_patterns): one copy kept


def _cut(t: torch.Tensor, dim: int, n: int, name: str) -> List[torch.Tensor]:
    if not 0 <= dim < t.dim() or t.shape[dim] % n:
        raise ConfigError(f"{name}: shape {list(t.shape)} does not split in {n} along dim {dim}")
    return list(t.chunk(n, dim))


# ---- Megatron-DeepSpeed's forward, per TP rank ----------------------------------------------------

def _norm(s: Source, x, weight, bias):
    if s.rmsnorm:  # rmsnorm.py: x * rsqrt(mean(x^2) + eps), times the weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + s.eps) * weight
    return F.layer_norm(x, (x.shape[-1],), weight, bias, s.eps)


def _rotary(s: Source, length: int):
    """rotary_pos_embedding.py: RotaryEmbedding(rotary_dim, theta) for positions 0..length-1."""
    inv_freq = 1.0 / (s.theta ** (torch.arange(0, s.rotary_dim, 2).float() / s.rotary_dim))
    freqs = torch.outer(torch.arange(length).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [s, 1, rotary_dim]
    return emb.cos(), emb.sin()


def _apply_rotary(t, cos, sin):
    rot = cos.shape[-1]
    t, rest = t[..., :rot], t[..., rot:]
    x1, x2 = t.chunk(2, dim=-1)
    return torch.cat([t * cos + torch.cat((-x2, x1), dim=-1) * sin, rest], dim=-1)


def _split_qkv(s: Source, mixed):
    """One TP rank's query_key_value output [sq, rows] -> q [sq, np, hn], k and v [sq, np, hn]
    (GQA's key-value heads repeated per query head, repeat_kv)."""
    sq, hn = mixed.shape[0], s.head_dim
    per = s.heads // s.groups
    if s.qkv == "thirds":  # since 676a482c: each_hidden_size = rows // 3 (MHA)
        if per != 1:
            raise ConfigError("query_key_value in thirds computes only multi-head attention")
        each = mixed.shape[-1] // 3
        return tuple(mixed[:, i * each:(i + 1) * each].reshape(sq, -1, hn) for i in range(3))
    grouped = mixed.reshape(sq, -1, per + 2, hn)  # [sq, nkv, nq // nkv + 2, hn]
    q = grouped[:, :, :per].reshape(sq, -1, hn)
    k, v = (grouped[:, :, i][:, :, None].expand(-1, -1, per, -1).reshape(sq, -1, hn) for i in (per, per + 1))
    return q, k, v


def _attention(s: Source, p: Dict[str, list], x, rope):
    out = 0
    mask = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool).triu(1)
    for r in range(s.tp):
        mixed = x @ p["self_attention.query_key_value.weight"][r].t()
        if "self_attention.query_key_value.bias" in p:
            mixed = mixed + p["self_attention.query_key_value.bias"][r]
        q, k, v = _split_qkv(s, mixed)
        if rope is not None:
            q, k = _apply_rotary(q, *rope), _apply_rotary(k, *rope)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(s.head_dim)
        probs = torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1)  # attention_mask_func
        context = torch.einsum("hqk,khd->qhd", probs, v).reshape(x.shape[0], -1)  # [sq, np * hn]
        out = out + context @ p["self_attention.dense.weight"][r].t()  # row-parallel: partial sums
    if "self_attention.dense.bias" in p:
        out = out + p["self_attention.dense.bias"][0]
    return out


def _mlp(s: Source, p: Dict[str, list], x):
    out = 0
    for r in range(s.tp):
        h = x @ p["mlp.dense_h_to_4h.weight"][r].t()
        bias = p["mlp.dense_h_to_4h.bias"][r] if "mlp.dense_h_to_4h.bias" in p else None
        h = h if bias is None else h + bias
        if s.swiglu:
            gate, up = torch.chunk(h, 2, dim=-1)
            h = F.silu(gate) * up
        elif s.gelu_fusion and bias is not None:  # fused_bias_gelu.py
            h = h * 0.5 * (1.0 + torch.tanh(0.79788456 * h * (1 + 0.044715 * h * h)))
        else:
            h = F.gelu(h)
        out = out + h @ p["mlp.dense_4h_to_h.weight"][r].t()
    if "mlp.dense_4h_to_h.bias" in p:
        out = out + p["mlp.dense_4h_to_h.bias"][0]
    return out


def _vocab_parallel(parts: List[torch.Tensor], tokens):
    """VocabParallelEmbedding: each rank looks up the ids in its rows, the ranks' outputs summed."""
    out, first = 0, 0
    for w in parts:
        mine = (tokens >= first) & (tokens < first + w.shape[0])
        out = out + w[torch.where(mine, tokens - first, 0)] * mine[:, None]
        first += w.shape[0]
    return out


def losses(s: Source, names: Names, read: Callable[[str], dict], probe: proof.Probe) -> List[float]:
    """The per-token losses of `probe` through Megatron-DeepSpeed's model of the tensors `read`
    gives (a parameter name -> its fp32.pt record), eval mode, fp32 on CPU."""
    def parts(name):
        return rank_parts(read(name), s, name)

    ids = probe.ids()[0]
    tokens, labels, n = ids[:-1], ids[1:], probe.tokens
    if n > s.positions:
        raise ConfigError(f"the probe's {n} tokens exceed the model's {s.positions} positions")
    with torch.no_grad():
        words = parts(names.embedding["word_embeddings.weight"])
        x = _vocab_parallel(words, tokens)
        if "position_embeddings.weight" in names.embedding:
            x = x + parts(names.embedding["position_embeddings.weight"])[0][:n]
        rope = _rotary(s, n) if s.rotary_dim else None
        for layer in names.layers:
            p = {local: parts(name) for local, name in layer.items()}
            bias = p.get("input_layernorm.bias", [None])[0]
            h = x + _attention(s, p, _norm(s, x, p["input_layernorm.weight"][0], bias), rope)
            bias = p.get("post_attention_layernorm.bias", [None])[0]
            x = h + _mlp(s, p, _norm(s, h, p["post_attention_layernorm.weight"][0], bias))
        bias = parts(names.final_norm["bias"])[0] if "bias" in names.final_norm else None
        x = _norm(s, x, parts(names.final_norm["weight"])[0], bias)
        head = parts(names.head) if names.head else words  # tied: the word embeddings
        logits = torch.cat([x @ w.t() for w in head], dim=-1)  # the ranks' vocabulary columns, gathered
        return [float(v) for v in F.cross_entropy(logits, labels, reduction="none").tolist()]


# ---- the record ----------------------------------------------------------------------------------

def unavailable(folder: str, names) -> Optional[str]:
    """Why this machine cannot run the reference (then the import records no proof), or None."""
    import psutil

    weights = sum(os.path.getsize(os.path.join(folder, "zero", n, "fp32.pt")) for n in names)
    need, free = _MEMORY_FACTOR * weights, psutil.virtual_memory().available
    if need > free:
        return f"the reference forward takes about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
    return None


def probe_for(s: Source) -> proof.Probe:
    return proof.Probe(proof.probe_length(min(MAX_PROBE_TOKENS, s.positions), MULTIPLE), s.vocab)


def param_digests(written: Callable[[str], Dict[str, "object"]], atomic_names) -> dict:
    """{"<atomic name>|param" (and "|padding|param"): [digest, scale]} of the weights the import
    writes; `written(name)` gives its parts as writer.py takes them ({part: float32 array})."""
    out = {}
    for name in atomic_names:
        for part, array in written(name).items():
            data = torch.from_numpy(array)
            digest, scale = proof.box_digest(name, part, tuple(data.shape), (0,) * data.dim(), data)
            out[f"{name}{'|' + part if part else ''}|param"] = [proof.finite(digest), proof.finite(scale)]
    return out


def record(s: Source, names: Names, read: Callable[[str], dict], digests: dict) -> dict:
    """The proof record of the import of a checkpoint described by `s` and `names`."""
    probe = probe_for(s)
    return proof.source_record(probe, DEVICE, s.padded_vocab, losses(s, names, read, probe), digests)
