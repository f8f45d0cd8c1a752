"""Hugging Face <-> universal checkpoint: the model facts, the names and the tensor reorderings.

Pure functions (numpy, no I/O): hf.py streams files through them. Only models whose
computation megatron-core reproduces exactly are mapped; every other model is refused with an
error naming the difference (docs/design.md, "Hugging Face models").

Three families:
- `llama` (LlamaForCausalLM): RMSNorm, SwiGLU, RoPE without scaling, GQA, no linear biases.
- `qwen2` (Qwen2ForCausalLM): the same with biases on the query, key and value projections
  (megatron's `add_qkv_bias`), no sliding window.
- `mixtral` (MixtralForCausalLM): Llama attention, every layer a MoE of SwiGLU experts, no
  shared expert. Its router takes the softmax over all experts, keeps the top k and divides by
  their sum: that is megatron's default softmax router (top k of the logits, softmax over
  those k), the same numbers. Qwen2-MoE adds a sigmoid-gated shared expert and, by default,
  un-normalised top-k weights, which this megatron-ucp's models do not build.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from megatron_ucp.errors import ConfigError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM"}
FAMILY_OF = {v: k for k, v in ARCHITECTURES.items()}


@dataclass(frozen=True)
class Model:
    """What both sides must agree on; everything else is fixed by the family."""

    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    norm_epsilon: float
    rotary_base: int
    tied: bool
    max_position_embeddings: int
    num_experts: Optional[int] = None
    topk: Optional[int] = None


# ---- from a universal checkpoint's manifest ----------------------------------------------------

def from_checkpoint(architecture: dict, args: dict, names) -> Model:
    """The HF model a checkpoint is, from its manifest's `architecture` and `args` and its tensor
    names; ConfigError naming each fact that no supported HF family computes the same way."""
    a, names = architecture, set(names)
    diffs = []

    def need(ok, message):
        if not ok:
            diffs.append(message)

    need(a["normalization"] == "RMSNorm", f"normalization {a['normalization']} (HF Llama-like models use RMSNorm)")
    need(a["gated_linear_unit"], "no SwiGLU (gated_linear_unit false; HF Llama-like MLPs are SwiGLU)")
    need(a["position_embedding_type"] == "rope",
         f"position embeddings {a['position_embedding_type']!r} (HF Llama-like models use rope)")
    need(not a["add_bias_linear"], "linear biases (add_bias_linear true; the HF models have none)")
    need(not a.get("qk_layernorm"), "QK layernorm (Llama, Qwen2 and Mixtral have none)")
    need(not a.get("multi_latent_attention"), "multi-latent attention")
    need(not a.get("mtp_num_layers"), "multi-token prediction layers")
    for key, default in (("rope_type", None), ("rotary_percent", 1.0), ("rotary_interleaved", False),
                         ("apply_query_key_layer_scaling", False)):
        need(args.get(key, default) in (default, "rope"), f"{key} {args.get(key)!r} (HF rope here is plain, "
             "full-width, non-interleaved, unscaled)")
    need(not args.get("use_rope_scaling"), "use_rope_scaling (Llama 3.1 rope scaling; HF's plain rope here is unscaled)")
    for key in ("rotary_base", "norm_epsilon"):
        need(key in args, f"the manifest's args lack {key!r} (needed for the HF config)")
    swiglu_activation = args.get("swiglu", True)
    need(swiglu_activation, "args.swiglu false (the HF activation is SiLU-gated)")
    qkv_bias = any(n.endswith(".self_attention.linear_qkv.bias") for n in names)
    family = "qwen2" if qkv_bias else "llama"
    experts = a["num_experts"]
    if experts:
        family = "mixtral"
        need(not qkv_bias, "MoE with QKV biases (Mixtral has none)")
        need(all(a.get("moe_layer_pattern") or [1]), f"dense layers among MoE ones (moe_layer_pattern "
             f"{a.get('moe_layer_pattern')}; every Mixtral layer is MoE)")
        need(not a.get("moe_shared_expert_intermediate_size"), "a shared expert (Mixtral has none)")
        need(args.get("moe_router_score_function", "softmax") == "softmax",
             f"router score function {args.get('moe_router_score_function')!r} (Mixtral's is softmax)")
        need(not args.get("moe_router_enable_expert_bias"), "a router expert bias (Mixtral has none)")
        need(not args.get("moe_router_pre_softmax"), "moe_router_pre_softmax (Mixtral renormalises the top k)")
        need(args.get("moe_router_topk_scaling_factor") in (None, 1.0), "a top-k scaling factor")
        need(not args.get("moe_router_num_groups"), "group-limited routing")
        need(args.get("moe_expert_capacity_factor") is None, "an expert capacity factor (token dropping; "
             "Mixtral drops no token)")
        need(args.get("moe_router_load_balancing_type", "aux_loss") != "sinkhorn", "sinkhorn routing")
        need("moe_router_topk" in args, "the manifest's args lack 'moe_router_topk'")
    if diffs:
        raise ConfigError("no Hugging Face family computes this model the same way: " + "; ".join(diffs))
    return Model(
        family=family, num_layers=a["num_layers"], hidden_size=a["hidden_size"],
        ffn_hidden_size=a["moe_ffn_hidden_size"] if experts else a["ffn_hidden_size"],
        num_attention_heads=a["num_attention_heads"], num_query_groups=a["num_query_groups"],
        head_dim=a["kv_channels"], vocab_size=a["vocab_size"], norm_epsilon=float(args["norm_epsilon"]),
        rotary_base=args["rotary_base"], tied=a["share_embeddings_and_output_weights"],
        max_position_embeddings=int(args.get("max_position_embeddings") or args.get("seq_length") or 2048),
        num_experts=experts or None, topk=int(args["moe_router_topk"]) if experts else None)


# ---- from a Hugging Face config.json --------------------------------------------------------------

def rope_theta(config: dict):
    """rope_theta, from transformers 5's `rope_parameters` or the older top-level keys; refuses
    scaled rope (megatron's plain RotaryEmbedding has no scaling)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
        raise ConfigError(f"config.json: rope scaling {params or scaling} (megatron's GPT rope here is unscaled)")
    return params.get("rope_theta", config.get("rope_theta", 10000.0))


def from_hf_config(config: dict) -> Model:
    """The Model of a HF config.json; ConfigError naming what megatron does not compute alike."""
    archs = config.get("architectures") or []
    family = FAMILY_OF.get(archs[0]) if len(archs) == 1 else None
    if family is None:
        raise ConfigError(f"config.json: architectures {archs} unsupported (supported: "
                          f"{', '.join(ARCHITECTURES.values())})")
    diffs = []
    if config.get("hidden_act", "silu") != "silu":
        diffs.append(f"hidden_act {config['hidden_act']!r} (megatron's SwiGLU uses silu)")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if config.get(key):
            diffs.append(f"{key} true")
    if family == "mixtral" and config.get("sliding_window"):
        diffs.append(f"sliding_window {config['sliding_window']}")
    theta = rope_theta(config)
    if float(theta) != int(theta):
        diffs.append(f"rope_theta {theta} is not an integer (megatron's --rotary-base is)")
    if family == "mixtral" and config.get("router_jitter_noise"):
        diffs.append("router_jitter_noise (megatron's router input jitter is not Mixtral's)")
    if diffs:
        raise ConfigError(f"config.json ({archs[0]}): " + "; ".join(diffs))
    heads = config["num_attention_heads"]
    moe = family == "mixtral"
    return Model(
        family=family, num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"], num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads, vocab_size=config["vocab_size"],
        norm_epsilon=float(config.get("rms_norm_eps", 1e-6)), rotary_base=int(theta),
        tied=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        num_experts=config["num_local_experts"] if moe else None,
        topk=config["num_experts_per_tok"] if moe else None)


def hf_config(m: Model, dtype: str = "float32") -> dict:
    """config.json of the HF model `m` is."""
    config = {
        "architectures": [ARCHITECTURES[m.family]], "model_type": m.family,
        "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups, "head_dim": m.head_dim, "hidden_act": "silu",
        "max_position_embeddings": m.max_position_embeddings, "rms_norm_eps": m.norm_epsilon,
        # Both spellings: transformers 5 reads rope_parameters, earlier ones rope_theta.
        "rope_theta": float(m.rotary_base),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rotary_base)},
        "tie_word_embeddings": m.tied, "attention_dropout": 0.0, "initializer_range": 0.02,
        "use_cache": True, "torch_dtype": dtype, "dtype": dtype,
    }
    if m.family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    if m.family == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None)
    if m.family == "mixtral":
        config.update(num_local_experts=m.num_experts, num_experts_per_tok=m.topk, sliding_window=None,
                      router_jitter_noise=0.0, output_router_logits=False)
    return config


def megatron_args(m: Model) -> List[str]:
    """pretrain_gpt_ucp.py flags that build the megatron model `m` is (layout flags aside)."""
    argv = ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
            "--ffn-hidden-size", str(m.ffn_hidden_size), "--num-attention-heads", str(m.num_attention_heads),
            "--kv-channels", str(m.head_dim), "--vocab-size", str(m.vocab_size), "--swiglu",
            "--normalization", "RMSNorm", "--norm-epsilon", repr(m.norm_epsilon),
            "--position-embedding-type", "rope", "--rotary-base", str(m.rotary_base),
            "--disable-bias-linear", "--max-position-embeddings", str(m.max_position_embeddings)]
    if m.num_query_groups != m.num_attention_heads:
        argv += ["--group-query-attention", "--num-query-groups", str(m.num_query_groups)]
    if not m.tied:
        argv.append("--untie-embeddings-and-output-weights")
    if m.family == "qwen2":
        argv.append("--add-qkv-bias")
    if m.num_experts:
        argv += ["--num-experts", str(m.num_experts), "--moe-router-topk", str(m.topk),
                 "--moe-ffn-hidden-size", str(m.ffn_hidden_size)]
    return argv


def architecture(m: Model) -> dict:
    """The manifest `architecture` of the megatron model megatron_args(m) builds
    (what megatron_ucp.format.manifest.architecture reports for it)."""
    return {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "ffn_hidden_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads, "num_query_groups": m.num_query_groups,
        "kv_channels": m.head_dim, "gated_linear_unit": True, "normalization": "RMSNorm",
        "add_bias_linear": False, "num_experts": m.num_experts,
        "moe_ffn_hidden_size": m.ffn_hidden_size if m.num_experts else None,
        "moe_layer_pattern": [1] * m.num_layers if m.num_experts else None,
        "moe_shared_expert_intermediate_size": None, "vocab_size": m.vocab_size,
        "position_embedding_type": "rope", "share_embeddings_and_output_weights": m.tied,
        "qk_layernorm": False, "multi_latent_attention": False, "q_lora_rank": None, "kv_lora_rank": None,
        "qk_head_dim": None, "qk_pos_emb_head_dim": None, "v_head_dim": None, "mtp_num_layers": None,
    }


# ---- tensors ---------------------------------------------------------------------------------------

def qkv_from_hf(q: np.ndarray, k: np.ndarray, v: np.ndarray, groups: int) -> np.ndarray:
    """megatron's fused QKV (FORMAT.md 2.1: per query group, its query heads, then its key and its
    value head) from HF's separate projections (weights or biases: rows first)."""
    per = q.shape[0] // groups  # query rows per group
    hn = k.shape[0] // groups
    blocks = []
    for g in range(groups):
        blocks += [q[g * per:(g + 1) * per], k[g * hn:(g + 1) * hn], v[g * hn:(g + 1) * hn]]
    return np.concatenate(blocks, axis=0)


def qkv_to_hf(qkv: np.ndarray, heads: int, groups: int, head_dim: int) -> Tuple[np.ndarray, ...]:
    """HF's (q, k, v) from megatron's fused QKV rows (inverse of qkv_from_hf)."""
    per = heads // groups * head_dim
    block = qkv.reshape(groups, per + 2 * head_dim, *qkv.shape[1:])
    rest = qkv.shape[1:]
    q = block[:, :per].reshape(heads * head_dim, *rest)
    k = block[:, per:per + head_dim].reshape(groups * head_dim, *rest)
    v = block[:, per + head_dim:].reshape(groups * head_dim, *rest)
    return q, k, v


def fc1_from_hf(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """megatron's SwiGLU linear_fc1 is [gate; up] (FORMAT.md 2.2)."""
    return np.concatenate([gate, up], axis=0)


def fc1_to_hf(fc1: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    half = fc1.shape[0] // 2
    return fc1[:half], fc1[half:]


@dataclass(frozen=True)
class Pair:
    """One megatron atomic tensor and the HF tensors it is made of (`join`) or split into (`split`)."""

    megatron: str
    hf: Tuple[str, ...]
    shape: Tuple[int, ...]  # the megatron tensor's shape
    hf_shapes: Tuple[Tuple[int, ...], ...]
    join: Callable[..., np.ndarray]
    split: Callable[[np.ndarray], Tuple[np.ndarray, ...]]


def _same(name_m, name_h, shape) -> Pair:
    return Pair(name_m, (name_h,), tuple(shape), (tuple(shape),), lambda x: x, lambda x: (x,))


def pairs(m: Model) -> List[Pair]:
    """Every tensor of model `m`: its megatron atomic name, its HF names, shapes and reorderings
    (the one table of names; HF's lm_head is absent when embeddings are tied, as HF saves it)."""
    h, hn, nh, ng = m.hidden_size, m.head_dim, m.num_attention_heads, m.num_query_groups
    out = [_same("embedding.word_embeddings.weight", "model.embed_tokens.weight", (m.vocab_size, h))]
    qkv_rows = (nh + 2 * ng) * hn
    q_shape, kv_shape = (nh * hn,), (ng * hn,)
    for L in range(m.num_layers):
        M, H = f"decoder.layers.{L}.", f"model.layers.{L}."
        attn = H + "self_attn."
        out.append(_same(M + "self_attention.linear_qkv.layer_norm_weight", H + "input_layernorm.weight", (h,)))
        names = tuple(f"{attn}{p}_proj.weight" for p in "qkv")
        out.append(Pair(M + "self_attention.linear_qkv.weight", names, (qkv_rows, h),
                        (q_shape + (h,), kv_shape + (h,), kv_shape + (h,)),
                        lambda q, k, v: qkv_from_hf(q, k, v, ng), lambda x: qkv_to_hf(x, nh, ng, hn)))
        if m.family == "qwen2":
            names = tuple(f"{attn}{p}_proj.bias" for p in "qkv")
            out.append(Pair(M + "self_attention.linear_qkv.bias", names, (qkv_rows,), (q_shape, kv_shape, kv_shape),
                            lambda q, k, v: qkv_from_hf(q, k, v, ng), lambda x: qkv_to_hf(x, nh, ng, hn)))
        out.append(_same(M + "self_attention.linear_proj.weight", attn + "o_proj.weight", (h, nh * hn)))
        f = m.ffn_hidden_size
        if m.num_experts:
            moe = H + "block_sparse_moe."
            out.append(_same(M + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight", (h,)))
            out.append(_same(M + "mlp.router.weight", moe + "gate.weight", (m.num_experts, h)))
            for E in range(m.num_experts):
                X, Y = f"{M}mlp.experts.experts.{E}.", f"{moe}experts.{E}."
                out.append(Pair(X + "linear_fc1.weight", (Y + "w1.weight", Y + "w3.weight"), (2 * f, h),
                                ((f, h), (f, h)), fc1_from_hf, fc1_to_hf))
                out.append(_same(X + "linear_fc2.weight", Y + "w2.weight", (h, f)))
        else:
            out.append(_same(M + "mlp.linear_fc1.layer_norm_weight", H + "post_attention_layernorm.weight", (h,)))
            out.append(Pair(M + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"),
                            (2 * f, h), ((f, h), (f, h)), fc1_from_hf, fc1_to_hf))
            out.append(_same(M + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight", (h, f)))
    out.append(_same("decoder.final_layernorm.weight", "model.norm.weight", (h,)))
    if not m.tied:
        out.append(_same("output_layer.weight", "lm_head.weight", (m.vocab_size, h)))
    return out


VOCAB = {"embedding.word_embeddings.weight", "output_layer.weight"}


def check_names(m: Model, megatron_names, where: str) -> None:
    """The checkpoint holds exactly the tensors of `m`: ConfigError naming the missing and extra ones."""
    want = {p.megatron for p in pairs(m)}
    have = set(megatron_names)
    problems = []
    if want - have:
        problems.append(f"missing {sorted(want - have)[:5]}")
    if have - want:
        problems.append(f"not in a {ARCHITECTURES[m.family]} {sorted(have - want)[:5]}")
    if problems:
        raise ConfigError(f"{where}: tensors do not match the model: " + "; ".join(problems))


def hf_index(m: Model) -> Dict[str, Tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor of `m`."""
    return {n: s for p in pairs(m) for n, s in zip(p.hf, p.hf_shapes)}
