"""Megatron-DeepSpeed GPT -> megatron-core GPT: the model facts, the names and the checks.

Pure functions (no I/O): deepspeed.py streams a DeepSpeed universal checkpoint through them.
What a DeepSpeed universal checkpoint says is taken from it, not assumed: the training
arguments Megatron-DeepSpeed stores (`args`), `universal_checkpoint_info` (the TP merge rules
ds_to_universal applied), the parameter names (with or without pipeline: `language_model.*` or
`tied_modules.embed.*` and `N.*` layer specs) and each parameter file's record of how it was
merged (`cat_dim`, `param_n_sub_params`, `vocab_tensor`). A model megatron-core does not compute
the same way is refused naming the option or the parameter.

The tensors need no reordering but one: Megatron-DeepSpeed's fused QKV holds, per query group,
its query heads, its key head and its value head (megatron-core's order, docs/FORMAT.md 2.1; TP
ranks hold whole groups, so ds_to_universal's concatenation keeps it), except since its commit
676a482c, which splits each TP rank's rows in thirds [Q; K; V] (qkv_layout, qkv_rows); its SwiGLU
`dense_h_to_4h` merged as two sub-parameters is [gate; up] (FORMAT.md 2.2). What must be checked
is that the merge was the one that keeps those orders.
"""

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_ucp.convert import deepspeed_values as dv
from megatron_ucp.errors import ConfigError


@dataclass(frozen=True)
class Model:
    """The megatron-core GPT a Megatron-DeepSpeed GPT is."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int  # the true vocabulary (ds_to_universal drops the padding rows)
    padded_vocab_size: int  # the saving run's
    normalization: str  # megatron-core's spelling: RMSNorm or LayerNorm
    norm_epsilon: float
    swiglu: bool
    bias: bool  # linear biases
    rope: bool  # else learned absolute positions
    rotary_base: int
    tied: bool
    seq_length: int
    max_position_embeddings: int


_NORMS = {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}
# Megatron-DeepSpeed options that change the math in a way megatron-core's GPT does not build:
# each must be absent or false.
_REFUSED_FLAGS = {
    "apply_layernorm_1p": "LayerNorm with weights offset by 1 (apply_layernorm_1p)",
    "apply_residual_connection_post_layernorm": "residual taken after the layernorm",
    "openai_gelu": "OpenAI's tanh GELU",
    "onnx_safe": "onnx_safe GELU",
    "squared_relu": "squared ReLU activation",
    "use_alibi_position_embeddings": "ALiBi positions",
    "mos": "mixture of softmaxes",
    "kd": "knowledge distillation heads",
    "embed_layernorm": "a layernorm after the embedding",
    # DeepSpeed's FPDT_Attention (deepspeed/sequence/fpdt_layer.py): its own parameters
    # (qkv_linear_weight, ...), chunked attention without dropout
    "ds_sequence_parallel_fpdt": "FPDT chunked attention",
}


def _int(args: dict, key: str, where: str, default=None) -> int:
    value = args.get(key)
    if value is None and default is not None:
        return default
    return dv.whole(value, f"{where}: args.{key}", 1, dv.MAX_COUNT)


def _model_type(args: dict):
    """Megatron-DeepSpeed's get_model() stores args.model_type (megatron.core.enums.ModelType,
    read as its stand-in's text); a GPT is encoder_or_decoder (1)."""
    kind = args.get("model_type")
    if kind is None or kind in ("<ModelType 1>", "<ModelType encoder_or_decoder>"):
        return None
    return f"model_type {kind!r} (a GPT is ModelType.encoder_or_decoder, 1)"


def from_args(args: dict, uc_info: dict, names, where: str) -> Model:
    """The Model of a Megatron-DeepSpeed GPT from its stored `args`, its
    `universal_checkpoint_info` and its parameter names; ConfigError naming every option
    megatron-core's GPT does not compute the same way, FormatError naming a value of the wrong
    type or range."""
    diffs = [d for d in [_model_type(args)] if d]
    for key, what in _REFUSED_FLAGS.items():
        if args.get(key):
            diffs.append(f"{what} (args.{key})")
    experts = args.get("num_experts")
    if experts not in (None, 1, [1]) and not (isinstance(experts, list) and all(e == 1 for e in experts)):
        diffs.append(f"mixture of experts (args.num_experts {dv.plain(experts, where)!r:.80}; Megatron-DeepSpeed's "
                     "MoE is not mapped)")
    normalization = args.get("normalization", "layernorm")
    norm = _NORMS.get(normalization.lower()) if isinstance(normalization, str) else None
    if norm is None:
        diffs.append(f"normalization {dv.plain(normalization, where)!r:.80} (expected layernorm or rmsnorm)")
    if args.get("rotary_percent", 1.0) != 1.0:
        diffs.append(f"rotary_percent {dv.plain(args.get('rotary_percent'), where)!r:.80} (partial rotary)")
    names = set(names)
    learned = any(n.endswith("position_embeddings.weight") for n in names)
    kind = args.get("position_embedding_type")  # its enum's member name (deepspeed.py), in forks that have it
    rope = dv.flag(args.get("use_rotary_position_embeddings"), f"{where}: args.use_rotary_position_embeddings",
                   False) or kind == "rotary"
    if kind not in (None, "rotary", "absolute"):
        diffs.append(f"position_embedding_type {kind!r:.80}")
    if rope and learned:
        diffs.append("both rotary and learned position embeddings")
    if not rope and not learned:
        diffs.append("neither rotary nor learned position embeddings (ALiBi or none)")
    theta = args.get("rope_theta", 10000)
    if rope:
        theta = dv.real(theta, f"{where}: args.rope_theta", above=0.0, hi=float(dv.MAX_COUNT))
        if theta != int(theta):
            diffs.append(f"rope_theta {theta!r} is not an integer (megatron's --rotary-base is)")
    if diffs:
        raise ConfigError(f"{where}: megatron-core's GPT does not compute this model the same way: "
                          + "; ".join(diffs))
    heads = _int(args, "num_attention_heads", where)
    hidden = _int(args, "hidden_size", where)
    groups = _int(args, "num_key_value_heads", where, default=heads)
    kv = _int(args, "kv_channels", where, default=max(hidden // heads, 1))
    original = uc_info.get("original_vocab_size")
    padded = uc_info.get("padded_vocab_size", args.get("padded_vocab_size"))
    original = dv.whole(original, f"{where}: universal_checkpoint_info.original_vocab_size", 1)
    padded = dv.whole(padded, f"{where}: universal_checkpoint_info.padded_vocab_size", original)
    if args.get("padded_vocab_size", padded) != padded:
        raise ConfigError(f"{where}: args.padded_vocab_size {dv.plain(args['padded_vocab_size'], where)!r:.40} but "
                          f"universal_checkpoint_info.padded_vocab_size {padded}")
    if heads % groups:
        raise ConfigError(f"{where}: {heads} attention heads in {groups} key-value groups (not a multiple)")
    seq = _int(args, "seq_length", where)
    return Model(
        num_layers=_int(args, "num_layers", where), hidden_size=hidden,
        ffn_hidden_size=_int(args, "ffn_hidden_size", where, default=4 * hidden), num_attention_heads=heads,
        num_query_groups=groups, kv_channels=kv, vocab_size=original, padded_vocab_size=padded,
        normalization=norm,
        norm_epsilon=dv.real(args.get("layernorm_epsilon", 1e-5), f"{where}: args.layernorm_epsilon", above=0.0,
                             hi=1.0),
        swiglu=dv.flag(args.get("swiglu"), f"{where}: args.swiglu", False),
        bias=dv.flag(args.get("add_bias_linear"), f"{where}: args.add_bias_linear", True), rope=rope,
        rotary_base=int(theta) if rope else 10000,
        tied=not dv.flag(args.get("untie_embeddings_and_output_weights"),
                         f"{where}: args.untie_embeddings_and_output_weights", False),
        seq_length=seq, max_position_embeddings=_int(args, "max_position_embeddings", where, default=seq))


# ---- names -------------------------------------------------------------------------------------

# A transformer layer's parameters: Megatron-DeepSpeed's name inside the layer -> megatron-core's.
LAYER = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "self_attention.query_key_value.bias": "self_attention.linear_qkv.bias",
    "self_attention.dense.weight": "self_attention.linear_proj.weight",
    "self_attention.dense.bias": "self_attention.linear_proj.bias",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "post_attention_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
    "mlp.dense_h_to_4h.bias": "mlp.linear_fc1.bias",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
    "mlp.dense_4h_to_h.bias": "mlp.linear_fc2.bias",
}
_PLAIN = {
    "language_model.embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    "language_model.embedding.position_embeddings.weight": "embedding.position_embeddings.weight",
    "language_model.encoder.final_layernorm.weight": "decoder.final_layernorm.weight",
    "language_model.encoder.final_layernorm.bias": "decoder.final_layernorm.bias",
    "language_model.output_layer.weight": "output_layer.weight",
}
_PIPE_EMBED = {"word_embeddings.weight": "embedding.word_embeddings.weight",
               "position_embeddings.weight": "embedding.position_embeddings.weight"}
_PLAIN_LAYER = re.compile(r"language_model\.encoder\.layers\.(\d+)\.(.+)")
_PIPE = re.compile(r"(\d+)\.(.+)")
_TIED = re.compile(r"tied_modules\.embed\.(.+)")


def _refuse(name: str, why: str):
    raise ConfigError(f"parameter {name!r}: {why}")


def megatron_names(names) -> Dict[str, str]:
    """DeepSpeed parameter name -> megatron-core atomic name, for GPTModel's names or
    GPTModelPipe's (the layer specs' indices: the embedding's, then one per transformer layer,
    the final norm's, the LM head's, numbered here from what the names show, each checked)."""
    names = sorted(set(names))
    out = {}
    if any(_PIPE.fullmatch(n) or _TIED.fullmatch(n) for n in names):
        return _pipe_names(names)
    for n in names:
        m = _PLAIN_LAYER.fullmatch(n)
        if m and m.group(2) in LAYER:
            out[n] = f"decoder.layers.{int(m.group(1))}.{LAYER[m.group(2)]}"
        elif n in _PLAIN:
            out[n] = _PLAIN[n]
        else:
            _refuse(n, "not a parameter of Megatron-DeepSpeed's GPT that megatron-core's GPT has")
    return out


def _pipe_names(names) -> Dict[str, str]:
    by_spec: Dict[int, List[Tuple[str, str]]] = {}
    out = {}
    for n in names:
        tied, spec = _TIED.fullmatch(n), _PIPE.fullmatch(n)
        if tied:
            if tied.group(1) not in _PIPE_EMBED:
                _refuse(n, "a tied module's parameter megatron-core's GPT does not have")
            out[n] = _PIPE_EMBED[tied.group(1)]
        elif spec:
            by_spec.setdefault(int(spec.group(1)), []).append((n, spec.group(2)))
        else:
            _refuse(n, "neither a pipeline layer spec's ('N.') nor a tied module's parameter")
    layers = sorted(i for i, ps in by_spec.items() if any(p in LAYER for _, p in ps))
    if layers and layers != list(range(layers[0], layers[0] + len(layers))):
        raise ConfigError(f"transformer layer specs {layers} are not consecutive")
    for i, ps in by_spec.items():
        for n, p in ps:
            if i in layers:
                if p not in LAYER:
                    _refuse(n, "not a transformer layer parameter megatron-core's layer has")
                out[n] = f"decoder.layers.{i - layers[0]}.{LAYER[p]}"
            elif layers and i == layers[-1] + 1 and p in ("weight", "bias"):
                out[n] = f"decoder.final_layernorm.{p}"
            elif (not layers or i < layers[0]) and p in _PIPE_EMBED:
                out[n] = _PIPE_EMBED[p]
            elif layers and i > layers[-1] + 1 and p == "lm_head.weight":
                out[n] = "output_layer.weight"
            else:
                _refuse(n, f"layer spec {i} is not where GPTModelPipe puts such a parameter "
                           f"(transformer layers are specs {layers[0] if layers else '?'}..)")
    return out


def expected(m: Model) -> Dict[str, Tuple[int, ...]]:
    """Every megatron-core atomic tensor of `m` and its shape (vocabulary tensors: true rows)."""
    h, f = m.hidden_size, m.ffn_hidden_size
    qkv = (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels
    fc1 = 2 * f if m.swiglu else f
    out = {"embedding.word_embeddings.weight": (m.vocab_size, h)}
    if not m.rope:
        out["embedding.position_embeddings.weight"] = (m.max_position_embeddings, h)
    norm_bias = m.normalization == "LayerNorm"
    for L in range(m.num_layers):
        p = f"decoder.layers.{L}."
        shapes = {"self_attention.linear_qkv.layer_norm_weight": (h,), "self_attention.linear_qkv.weight": (qkv, h),
                  "self_attention.linear_proj.weight": (h, m.num_attention_heads * m.kv_channels),
                  "mlp.linear_fc1.layer_norm_weight": (h,), "mlp.linear_fc1.weight": (fc1, h),
                  "mlp.linear_fc2.weight": (h, f)}
        if norm_bias:
            shapes.update({"self_attention.linear_qkv.layer_norm_bias": (h,), "mlp.linear_fc1.layer_norm_bias": (h,)})
        if m.bias:
            shapes.update({"self_attention.linear_qkv.bias": (qkv,), "self_attention.linear_proj.bias": (h,),
                           "mlp.linear_fc1.bias": (fc1,), "mlp.linear_fc2.bias": (h,)})
        out.update({p + k: v for k, v in shapes.items()})
    out["decoder.final_layernorm.weight"] = (h,)
    if norm_bias:
        out["decoder.final_layernorm.bias"] = (h,)
    if not m.tied:
        out["output_layer.weight"] = (m.vocab_size, h)
    return out


VOCAB = {"embedding.word_embeddings.weight", "output_layer.weight"}
COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight",
          "mlp.linear_fc1.bias")
ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


def check_names(m: Model, mapping: Dict[str, str], where: str = "the checkpoint") -> None:
    """The checkpoint holds each tensor of `m` once, and nothing else (`where`: its file, for
    the message)."""
    layers = {int(mc.split(".")[2]) for mc in mapping.values() if mc.startswith("decoder.layers.")}
    if layers != set(range(m.num_layers)):  # before expected() builds num_layers' names
        raise ConfigError(f"{where}: the args describe {m.num_layers} transformer layers, the checkpoint's parameter "
                          f"folders hold {len(layers)}"
                          + (f" (numbered {min(layers)}..{max(layers)})" if layers else ""))
    want = expected(m)
    seen: Dict[str, str] = {}
    for ds, mc in mapping.items():
        if mc in seen:
            raise ConfigError(f"parameters {seen[mc]!r} and {ds!r} both map to {mc!r}")
        seen[mc] = ds
        if mc not in want:
            _refuse(ds, f"maps to {mc!r}, which this model (from its args) does not have")
    missing = sorted(set(want) - set(seen))
    if missing:
        raise ConfigError(f"the checkpoint lacks {missing[0]!r}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                          + " that the model its args describe has")


def check_record(ds_name: str, mc_name: str, record: dict, shape, m: Model, tp: int) -> None:
    """One fp32.pt's merge record and shape fit the atomic tensor: the TP merge kept megatron's
    row orders (column-parallel on rows, row-parallel on columns, SwiGLU halves as two
    sub-parameters), the vocabulary rows are the true ones."""
    if "sub_param_shape" in record:
        _refuse(ds_name, "stored as fused sub-parameters of uneven shapes (sub_param_shape); not mapped")
    want = expected(m)[mc_name]
    if tuple(shape) != want:
        _refuse(ds_name, f"shape {list(shape)}, the model needs {list(want)} for {mc_name!r}")
    vocab = mc_name in VOCAB
    if bool(record.get("vocab_tensor")) != vocab:
        _refuse(ds_name, "vocab_tensor is " + ("set" if record.get("vocab_tensor") else "unset") +
                f" in its fp32.pt, expected {'set' if vocab else 'unset'} (universal_checkpoint_info's "
                "vocabulary_parameter_patterns must list exactly the embedding and output layer)")
    if tp == 1:
        return
    cat = record.get("cat_dim")
    key = mc_name.split(".", 3)[-1] if mc_name.startswith("decoder.layers.") else mc_name
    if key in ROW and cat != 1:
        _refuse(ds_name, f"row-parallel but merged over {tp} TP ranks along dim {cat} (not listed in "
                         "parameter_with_row_parallelism_patterns)")
    if key in COLUMN or vocab:
        if cat != 0:
            _refuse(ds_name, f"column-parallel but merged over {tp} TP ranks along dim {cat}")
        halves = record.get("param_n_sub_params")
        if key.startswith("mlp.linear_fc1.") and m.swiglu and halves != 2:
            _refuse(ds_name, f"SwiGLU's gate and up halves merged over {tp} TP ranks as one tensor "
                             "(interleaved per rank): it must be listed in parameter_with_2_sub_params_cat_dim_0")
        if halves not in (None, 2) or (halves == 2 and not (key.startswith("mlp.linear_fc1.") and m.swiglu)):
            _refuse(ds_name, f"merged as {halves} sub-parameters; only SwiGLU's dense_h_to_4h has two")


# ---- megatron-core flags and manifest facts ------------------------------------------------------

def megatron_args(m: Model, make_vocab_size_divisible_by: Optional[int]) -> List[str]:
    """pretrain_gpt_ucp.py flags that build the megatron-core GPT `m` is (layout flags aside)."""
    argv = ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
            "--ffn-hidden-size", str(m.ffn_hidden_size), "--num-attention-heads", str(m.num_attention_heads),
            "--kv-channels", str(m.kv_channels), "--vocab-size", str(m.vocab_size),
            "--seq-length", str(m.seq_length), "--max-position-embeddings", str(m.max_position_embeddings),
            "--normalization", m.normalization, "--norm-epsilon", repr(m.norm_epsilon)]
    if make_vocab_size_divisible_by:
        argv += ["--make-vocab-size-divisible-by", str(make_vocab_size_divisible_by)]
    if m.swiglu:
        argv.append("--swiglu")
    if m.rope:
        argv += ["--position-embedding-type", "rope", "--rotary-base", str(m.rotary_base)]
    else:
        argv += ["--position-embedding-type", "learned_absolute"]
    if not m.bias:
        argv.append("--disable-bias-linear")
    if m.num_query_groups != m.num_attention_heads:
        argv += ["--group-query-attention", "--num-query-groups", str(m.num_query_groups)]
    if not m.tied:
        argv.append("--untie-embeddings-and-output-weights")
    return argv


def architecture(m: Model) -> dict:
    """The manifest `architecture` of the megatron-core model megatron_args(m) builds."""
    return {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "ffn_hidden_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads, "num_query_groups": m.num_query_groups,
        "kv_channels": m.kv_channels, "gated_linear_unit": m.swiglu, "normalization": m.normalization,
        "add_bias_linear": m.bias, "num_experts": None, "moe_ffn_hidden_size": None, "moe_layer_pattern": None,
        "moe_shared_expert_intermediate_size": None, "vocab_size": m.vocab_size,
        "position_embedding_type": "rope" if m.rope else "learned_absolute",
        "share_embeddings_and_output_weights": m.tied, "qk_layernorm": False, "multi_latent_attention": False,
        "q_lora_rank": None, "kv_lora_rank": None, "qk_head_dim": None, "qk_pos_emb_head_dim": None,
        "v_head_dim": None, "mtp_num_layers": None,
    }
