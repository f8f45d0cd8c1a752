"""A Hugging Face config.json read as a stranger's: every value the import uses typed and bounded,
and its sizes compared with the tensors actually present, before anything is sized from it.

A config saying `num_hidden_layers: 10**6` made the import plan a million layers (99 s, 6.7 GB)
before looking at the files; `tie_word_embeddings: "false"` counted as true; `heads: 0` divided
by zero. Here each key is one line naming the file, the key and what was expected.
"""

import math
import re

from megatron_ucp.errors import FormatError

MAX_SIZE = 2**31 - 1


def _int(v, low=1):
    return type(v) is int and low <= v <= MAX_SIZE


def _number(v):
    return type(v) in (int, float) and math.isfinite(v) and v > 0


# key -> (check, expected, required)
SIZES = {
    "num_hidden_layers": (_int, f"an integer 1..{MAX_SIZE}", True),
    "hidden_size": (_int, f"an integer 1..{MAX_SIZE}", True),
    "intermediate_size": (_int, f"an integer 1..{MAX_SIZE}", True),
    "num_attention_heads": (_int, f"an integer 1..{MAX_SIZE}", True),
    "vocab_size": (_int, f"an integer 1..{MAX_SIZE}", True),
    "num_key_value_heads": (lambda v: v is None or _int(v), f"null or an integer 1..{MAX_SIZE}", False),
    "head_dim": (lambda v: v is None or _int(v), f"null or an integer 1..{MAX_SIZE}", False),
    "max_position_embeddings": (_int, f"an integer 1..{MAX_SIZE}", False),
    "rms_norm_eps": (_number, "a finite number > 0", False),
    "rope_theta": (_number, "a finite number > 0", False),
    "tie_word_embeddings": (lambda v: isinstance(v, bool), "true or false", False),
    "rope_scaling": (lambda v: v is None or isinstance(v, dict), "null or an object", False),
    "rope_parameters": (lambda v: v is None or isinstance(v, dict), "null or an object", False),
    "architectures": (lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v), "a list of names", True),
}
MOE_SIZES = {
    "num_local_experts": (_int, f"an integer 1..{MAX_SIZE}", True),
    "num_experts_per_tok": (_int, f"an integer 1..{MAX_SIZE}", True),
}


def _shown(v) -> str:
    return f"{v!r:.60}"


def check(config, path: str, moe: bool) -> None:
    """Every key the import reads of the type and range it needs; the head counts consistent."""
    if not isinstance(config, dict):
        raise FormatError(f"{path}: holds {type(config).__name__}, expected a JSON object")
    for key, (ok, expected, required) in {**SIZES, **(MOE_SIZES if moe else {})}.items():
        if key not in config:
            if required:
                raise FormatError(f"{path}: lacks {key!r} (expected {expected})")
            continue
        if not ok(config[key]):
            raise FormatError(f"{path}: {key!r} is {_shown(config[key])}, expected {expected}")
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and not _number(theta):
        raise FormatError(f"{path}: 'rope_parameters.rope_theta' is {_shown(theta)}, expected a finite number > 0")
    heads, groups = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    if heads % groups:
        raise FormatError(f"{path}: 'num_key_value_heads' ({groups}) must divide 'num_attention_heads' ({heads})")
    if config.get("head_dim") is None and config["hidden_size"] % heads:
        raise FormatError(f"{path}: 'hidden_size' ({config['hidden_size']}) is not a multiple of "
                          f"'num_attention_heads' ({heads}) and no 'head_dim' is given")
    if moe and config["num_experts_per_tok"] > config["num_local_experts"]:
        raise FormatError(f"{path}: 'num_experts_per_tok' ({config['num_experts_per_tok']}) exceeds "
                          f"'num_local_experts' ({config['num_local_experts']})")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _numbered(found: set, n: int) -> bool:
    """`found` is exactly 0..n-1 (without building that range: n is the stranger's number)."""
    return len(found) == n and (n == 0 or (min(found) == 0 and max(found) == n - 1))


def against_tensors(config: dict, names, embedding_shape, path: str, folder: str) -> None:
    """The config's layer and expert counts and its vocabulary and hidden sizes are those of the
    tensors the folder holds (`names`; `embedding_shape`: model.embed_tokens.weight's, or None)."""
    layers = {int(m.group(1)) for n in names if (m := _LAYER.match(n))}
    if not _numbered(layers, config["num_hidden_layers"]):
        raise FormatError(f"{path}: 'num_hidden_layers' is {config['num_hidden_layers']}, the tensors of {folder} "
                          f"hold {len(layers)} layers" + (f" (numbered up to {max(layers)})" if layers else ""))
    if "num_local_experts" in config:
        experts = {int(m.group(1)) for n in names if (m := _EXPERT.search(n))}
        if not _numbered(experts, config["num_local_experts"]):
            raise FormatError(f"{path}: 'num_local_experts' is {config['num_local_experts']}, the tensors of "
                              f"{folder} hold {len(experts)} experts per layer")
    want = [config["vocab_size"], config["hidden_size"]]
    if embedding_shape is not None and list(embedding_shape) != want:
        raise FormatError(f"{path}: 'vocab_size' and 'hidden_size' are {want}, model.embed_tokens.weight "
                          f"in {folder} has shape {list(embedding_shape)}")


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
