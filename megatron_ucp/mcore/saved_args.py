"""Arguments a checkpoint stores, checked before anything is built from them.

`--use-checkpoint-args` and the torch_dist export rebuild a model from the arguments in a
manifest: a stranger's numbers. Each adopted value must have the type its flag parses to (a
JSON integer for an int flag, true/false for a switch, one of the flag's choices), lie within
bounds, and agree with the same checkpoint's architecture block and tensor shapes, so that a
manifest saying `num_layers: 100000` beside two layers of tensors is refused in milliseconds
instead of building for a minute and dying in an allocation.
"""

import argparse
import math
import re

from megatron_ucp.errors import FormatError
from megatron_ucp.mcore import layer_pattern

MAX_INT = 2**31 - 1  # every count and size megatron keeps fits an int32

# Adopted argument -> (architecture key, how the argument reads as that key's value).
_SAME = {k: (k, None) for k in (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels", "normalization",
    "num_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "position_embedding_type",
    "qk_layernorm", "multi_latent_attention", "mtp_num_layers")}
_MLA = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
ARCHITECTURE_OF = {
    **_SAME,
    "swiglu": ("gated_linear_unit", None),
    "disable_bias_linear": ("add_bias_linear", lambda v: not v),
    "untie_embeddings_and_output_weights": ("share_embeddings_and_output_weights", lambda v: not v),
}


def _negated(v):
    return (not v) if isinstance(v, bool) else v  # a non-switch stays itself, for `typed` to refuse


# The same fact under another name in Megatron-LM's trainer: the own loop's name -> (the
# trainer's, how either reads as the other). Its parser stores --disable-bias-linear as
# add_bias_linear=False and --norm-epsilon as layernorm_epsilon; a checkpoint holds the names of
# the trainer that saved it (tests/test_megatron_lm.py derives this table from the parser).
SYNONYMS = {"disable_bias_linear": ("add_bias_linear", _negated),
            "norm_epsilon": ("layernorm_epsilon", None)}


def canonical(saved: dict) -> dict:
    """`saved` (either trainer's arguments) with the own loop's name of each synonym too."""
    out = dict(saved)
    for own, (theirs, read) in SYNONYMS.items():
        if own not in out and theirs in out:
            out[own] = read(out[theirs]) if read else out[theirs]
    return out


def _uses(args, name) -> str:
    """The attribute of `args` that holds `name`'s fact (the trainer's synonym where it has one)."""
    if not hasattr(args, name) and name in SYNONYMS and hasattr(args, SYNONYMS[name][0]):
        return SYNONYMS[name][0]
    return name


def _get(args, name):
    attribute = _uses(args, name)
    value = getattr(args, attribute, None)
    read = SYNONYMS[name][1] if attribute != name else None
    return read(value) if read else value


def _set(args, name, value) -> None:
    attribute = _uses(args, name)
    read = SYNONYMS[name][1] if attribute != name else None
    setattr(args, attribute, read(value) if read else value)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def _expected(action) -> tuple:
    """(check, words) for a value of `action`'s flag as JSON holds it."""
    nullable = action.default is None
    if action.nargs == 0:
        return (lambda v: isinstance(v, bool)), "true or false"
    if action.choices is not None:
        choices = list(action.choices)
        return (lambda v: v in choices or (nullable and v is None)), f"one of {choices}" + (" or null" if nullable else "")
    if action.type is int:
        return ((lambda v: (nullable and v is None) or (type(v) is int and 0 <= v <= MAX_INT)),
                f"an integer 0..{MAX_INT}" + (" or null" if nullable else ""))
    if action.type is float:
        return ((lambda v: (nullable and v is None) or (type(v) in (int, float) and math.isfinite(v))),
                "a finite number" + (" or null" if nullable else ""))
    if getattr(action.type, "__name__", "") == "moe_layer_freq":
        return _is_pattern, f"an integer 1..{layer_pattern.MAX_LAYERS} or a list of at most {layer_pattern.MAX_LAYERS} 0s and 1s"
    if action.nargs in ("+", "*"):
        return (lambda v: (nullable and v is None) or (isinstance(v, list) and all(isinstance(x, str) for x in v))), \
            "a list of strings"
    return (lambda v: (nullable and v is None) or isinstance(v, str)), "a string"


def _is_pattern(v) -> bool:
    if type(v) is int:
        return 1 <= v <= layer_pattern.MAX_LAYERS
    return isinstance(v, list) and len(v) <= layer_pattern.MAX_LAYERS and all(type(x) is int and x in (0, 1) for x in v)


def _shown(v) -> str:
    return f"a list of {len(v)}" if isinstance(v, list) and len(v) > 8 else f"{v!r:.60}"


def typed(saved: dict, names, parser: argparse.ArgumentParser, path: str) -> None:
    """Each of `names` that `saved` holds has the type and range its flag in `parser` parses to."""
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    for name in names:
        if name not in saved or name not in actions:
            continue
        ok, words = _expected(actions[name])
        if not ok(saved[name]):
            raise FormatError(f"{path}: 'args.{name}' is {_shown(saved[name])}, expected {words} "
                              f"(the flag {actions[name].option_strings[0]})")


def _layer_and_experts(tensors) -> tuple:
    layers, experts = set(), set()
    for name in tensors:
        m = _LAYER.match(name)
        if m:
            layers.add(int(m.group(1)))
        m = _EXPERT.search(name)
        if m:
            experts.add(int(m.group(1)))
    return layers, experts


def architecture_problems(architecture: dict, tensors: dict) -> list:
    """Where a manifest's architecture contradicts its own tensor entries ({name: entry with
    .shape}): the layer count, the hidden size, the vocabulary, the expert count."""
    problems = []
    layers, experts = _layer_and_experts(tensors)
    if layers and architecture.get("num_layers") != len(layers):
        problems.append(f"'architecture.num_layers' is {architecture.get('num_layers')!r}, the tensors "
                        f"hold {len(layers)} layers")
    if experts and architecture.get("num_experts") != len(experts):
        problems.append(f"'architecture.num_experts' is {architecture.get('num_experts')!r}, the tensors "
                        f"hold {len(experts)} experts per layer")
    embedding = tensors.get("embedding.word_embeddings.weight")
    if embedding is not None and len(embedding.shape) == 2:
        rows, width = embedding.shape
        if architecture.get("hidden_size") != width:
            problems.append(f"'architecture.hidden_size' is {architecture.get('hidden_size')!r}, "
                            f"embedding.word_embeddings.weight has {width} columns")
        if architecture.get("vocab_size") != rows:
            problems.append(f"'architecture.vocab_size' is {architecture.get('vocab_size')!r}, "
                            f"embedding.word_embeddings.weight has {rows} rows")
    return problems


# Megatron's checkpoint keys and module paths, as the converters' sources store them: a layer
# per key (`decoder.layers.<i>.`: fsdp_dtensor's module paths, torch_dist with a MoE pattern) or
# stacked along a first axis of num_layers (torch_dist's `decoder.layers.<name>`); experts per
# key (`local_experts.<e>.`, torch_dist's singleton shards `experts.experts.<e>.`) or stacked
# along the axis after the layers' (`experts.experts.linear_fc1.weight`, SequentialMLP and TE's
# grouped GEMM alike).
_STACKED_LAYERS = re.compile(r"^decoder\.layers\.(?!\d+\.)")
_PER_EXPERT = re.compile(r"\.experts\.(?:local_experts|experts)\.(\d+)\.")
_STACKED_EXPERTS = re.compile(r"\.experts\.experts\.linear_fc[12]\.")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.")


def stored_counts(shapes: dict) -> dict:
    """The layers, experts per layer and MTP layers a checkpoint's tensors ({key: shape}) hold;
    None where its keys show none. Pure: from the keys and shapes only."""
    (layers, experts), mtp = _layer_and_experts(shapes), set()
    stacked_layers = stacked_experts = 0
    for key, shape in shapes.items():
        stacked = bool(_STACKED_LAYERS.match(key))
        if stacked and shape:
            stacked_layers = max(stacked_layers, int(shape[0]))
        if _STACKED_EXPERTS.search(key) and len(shape) > int(stacked):
            stacked_experts = max(stacked_experts, int(shape[int(stacked)]))
        m = _PER_EXPERT.search(key)
        if m:
            experts.add(int(m.group(1)))
        m = _MTP.match(key)
        if m:
            mtp.add(int(m.group(1)))
    return {"num_layers": max(len(layers), stacked_layers) or None,
            "num_experts": max(len(experts), stacked_experts) or None,
            "mtp_num_layers": len(mtp) or None,
            "any_experts": any(".experts." in k for k in shapes)}


def against_tensors(values: dict, shapes: dict, path: str) -> None:
    """The model arguments a converter builds from (`values`: stored, with the command line's
    flags over them) agree with the checkpoint's tensors ({key: shape}, its `.metadata`), before
    anything is built from them: the module counts that cost a meta model its time (layers,
    experts, MTP layers), the hidden size and the learned positions."""
    counts = stored_counts(shapes)
    for name in ("num_layers", "mtp_num_layers"):
        want = values.get(name) or None
        if want is not None and want != counts[name]:
            raise FormatError(f"{path}: 'args.{name}' is {_shown(want)}, the tensors hold "
                              f"{counts[name] or 0} {'MTP ' if name.startswith('mtp') else ''}layers")
    experts, found = values.get("num_experts") or None, counts["num_experts"]
    if experts is not None and experts != found and (found is not None or not counts["any_experts"]):
        raise FormatError(f"{path}: 'args.num_experts' is {_shown(experts)}, the tensors hold "
                          f"{counts['num_experts'] or 0} experts per layer")
    embedding = shapes.get("embedding.word_embeddings.weight")
    hidden = values.get("hidden_size")
    if embedding is not None and len(embedding) == 2 and hidden is not None and hidden != embedding[1]:
        raise FormatError(f"{path}: 'args.hidden_size' is {_shown(hidden)}, embedding.word_embeddings.weight "
                          f"has {embedding[1]} columns")
    positions = shapes.get("embedding.position_embeddings.weight")
    for name in ("seq_length", "max_position_embeddings"):
        if positions and type(values.get(name)) is int and values[name] > positions[0]:
            raise FormatError(f"{path}: 'args.{name}' is {values[name]}, but the position embedding "
                              f"embedding.position_embeddings.weight has {positions[0]} rows")


def against_checkpoint(saved: dict, names, architecture: dict, tensors: dict, path: str) -> None:
    """The adopted `names` of `saved` agree with the checkpoint's architecture, the architecture
    with its tensors, and the sequence with the position embedding's rows."""
    problems = architecture_problems(architecture, tensors)
    if problems:
        raise FormatError(f"{path}: {problems[0]}")
    vocab = saved.get("vocab_size")
    if "vocab_size" in names and vocab is not None and architecture.get("vocab_size") is not None \
            and not _vocab_agrees(saved, architecture["vocab_size"]):
        raise FormatError(f"{path}: 'args.vocab_size' is {_shown(vocab)}, but 'architecture.vocab_size' is "
                          f"{architecture['vocab_size']!r}; expected the arguments of the model the checkpoint holds")
    for name in names:
        if name not in saved or name not in ARCHITECTURE_OF or saved[name] is None:
            continue
        key, read = ARCHITECTURE_OF[name]
        if key not in architecture:
            continue
        value = read(saved[name]) if read else saved[name]
        if architecture[key] is not None and value != architecture[key]:
            raise FormatError(f"{path}: 'args.{name}' is {_shown(saved[name])}, but 'architecture.{key}' "
                              f"is {architecture[key]!r}; expected the arguments of the model the "
                              "checkpoint holds")
    if architecture.get("multi_latent_attention"):
        for name in _MLA:
            if name in names and saved.get(name) is not None and saved[name] != architecture.get(name):
                raise FormatError(f"{path}: 'args.{name}' is {_shown(saved[name])}, but "
                                  f"'architecture.{name}' is {architecture.get(name)!r}")
    positions = tensors.get("embedding.position_embeddings.weight")
    limit = positions.shape[0] if positions is not None and positions.shape else None
    for name in ("seq_length", "max_position_embeddings"):
        if limit is not None and name in names and type(saved.get(name)) is int and saved[name] > limit:
            raise FormatError(f"{path}: 'args.{name}' is {saved[name]}, but the position embedding "
                              f"embedding.position_embeddings.weight has {limit} rows")
    divisor = saved.get("make_vocab_size_divisible_by")
    if "make_vocab_size_divisible_by" in names and divisor is not None and divisor < 1:
        raise FormatError(f"{path}: 'args.make_vocab_size_divisible_by' is {divisor!r}, expected an integer >= 1")


def _vocab_agrees(saved: dict, entries: int) -> bool:
    """A saved --vocab-size that gives `entries` entries: the same number (the own loop keeps the
    count with its EOD; 0.17+'s trainer), or one fewer beside a NullTokenizer that adds the EOD
    (Megatron-LM 0.16's trainer stores the flag as given)."""
    vocab = saved["vocab_size"]
    return vocab == entries or (vocab == entries - 1 and saved.get("tokenizer_type") == "NullTokenizer"
                                and saved.get("eod_token") is None)


def check(saved: dict, names, manifest, path: str) -> None:
    """`typed` and `against_checkpoint` for the adopted `names` of a universal manifest (either
    trainer's arguments: `canonical` names them)."""
    from megatron_ucp.mcore.flags import build_parser

    saved = canonical(saved)
    typed(saved, names, build_parser(), path)
    eod = saved.get("eod_token") if "eod_token" in names else None
    if eod is not None and not (type(eod) is int and 0 <= eod <= MAX_INT):
        raise FormatError(f"{path}: 'args.eod_token' is {_shown(eod)}, expected null or an integer 0..{MAX_INT}")
    against_checkpoint(saved, names, manifest.architecture, manifest.tensors, path)


# Megatron-LM's --use-checkpoint-args takes the model's shape from the checkpoint (its
# load_args_from_checkpoint); the parallel layout and the training schedule stay the command
# line's (a universal checkpoint loads on any layout).
CHECKPOINT_ARGS = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
    "group_query_attention", "num_query_groups", "seq_length", "max_position_embeddings",
    "vocab_size", "make_vocab_size_divisible_by", "swiglu", "normalization", "norm_epsilon",
    "position_embedding_type", "rotary_base", "untie_embeddings_and_output_weights",
    "disable_bias_linear", "add_qkv_bias", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size", "moe_layer_freq", "moe_router_score_function",
    "moe_router_enable_expert_bias", "moe_grouped_gemm", "qk_layernorm", "multi_latent_attention",
    "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
    "rotary_scaling_factor", "mtp_num_layers",
)


def use_checkpoint_args(args, saved: dict, verbose: bool = False, *, entries=None, extra=0) -> list:
    """Set the model arguments from `saved` (either trainer's); returns (and prints) the values
    it changed. `entries`: the checkpoint's true vocabulary (its architecture's), from which
    --vocab-size is set as the running tokenizer reads it: `extra` is what that tokenizer adds to
    the flag (1 where a NullTokenizer adds its EOD: the own loop, Megatron-LM 0.16's trainer; 0
    where the flag is the vocabulary), None where the flag does not set the vocabulary (another
    tokenizer: left alone)."""
    changed = []
    saved = canonical(saved)
    if entries is not None:
        saved.pop("vocab_size", None)
        if extra is not None:
            saved["vocab_size"] = entries - extra
    elif saved.get("eod_token") is not None:  # NullTokenizer: the flag's value; validate adds EOD
        saved = dict(saved, vocab_size=saved["eod_token"])
    for name in CHECKPOINT_ARGS:
        if name in saved and saved[name] != _get(args, name):
            changed.append((name, _get(args, name), saved[name]))
            _set(args, name, saved[name])
    if verbose:
        for name, old, new in changed:
            if old is None:  # not given: derived later from the other arguments
                continue
            print(f" --use-checkpoint-args: --{name.replace('_', '-')} {new} from the checkpoint "
                  f"(was {old})", flush=True)
    return changed
