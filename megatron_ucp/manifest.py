"""The manifest `ucp.json`: what a universal checkpoint holds, self-described and versioned.

See docs/FORMAT.md. `read_manifest` validates structure before anything trusts it: every error
names the file and the key at fault.
"""

import os
import re
from typing import Dict, Optional

from megatron_ucp.errors import FormatError, LayoutError
from megatron_ucp.layout import PADDING, Rule, padding_shape
from megatron_ucp.storage import MAX_MANIFEST_BYTES, TensorFileLayout, read_json

FORMAT_NAME = "megatron-ucp"
FORMAT_VERSION = 1
MANIFEST = "ucp.json"
STATES = ("param", "exp_avg", "exp_avg_sq")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def tensor_file(name: str) -> str:
    if not _SAFE_NAME.match(name) or ".." in name:
        raise FormatError(f"atomic tensor name {name!r} is not a safe file name")
    return f"tensors/{name}.safetensors"


def file_entries(shape, states, padding_rows: int) -> list:
    """The tensors inside one atomic file: each state, then each state's vocabulary padding."""
    entries = [(s, tuple(shape), "F32") for s in states]
    if padding_rows:
        entries += [(f"{PADDING}.{s}", padding_shape(shape, padding_rows), "F32") for s in states]
    return entries


def file_tensor_name(state: str, part: str) -> str:
    return state if not part else f"{part}.{state}"


def file_layout(entry: dict) -> TensorFileLayout:
    return TensorFileLayout.build(file_entries(entry["shape"], entry["states"], entry["padding_rows"]))


def moe_layer_pattern(config) -> Optional[list]:
    """1 for each MoE layer, 0 for each dense one (megatron's reading of `moe_layer_freq`)."""
    if not config.num_moe_experts:
        return None
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [int(i % freq == 0) for i in range(config.num_layers)]
    return [int(v) for v in freq]


def architecture(gpt, vocab_size: int) -> dict:
    """The model facts a checkpoint must agree with to load (from megatron's TransformerConfig)."""
    c = gpt.config
    return {
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "ffn_hidden_size": c.ffn_hidden_size,
        "num_attention_heads": c.num_attention_heads,
        "num_query_groups": c.num_query_groups or c.num_attention_heads,
        "kv_channels": c.kv_channels,
        "gated_linear_unit": bool(c.gated_linear_unit),
        "normalization": c.normalization,
        "add_bias_linear": bool(c.add_bias_linear),
        "num_experts": c.num_moe_experts,
        "moe_ffn_hidden_size": c.moe_ffn_hidden_size if c.num_moe_experts else None,
        "moe_layer_pattern": moe_layer_pattern(c),
        "moe_shared_expert_intermediate_size":
            c.moe_shared_expert_intermediate_size if c.num_moe_experts else None,
        "vocab_size": int(vocab_size),
        "position_embedding_type": gpt.position_embedding_type,
        "share_embeddings_and_output_weights": bool(gpt.share_embeddings_and_output_weights),
    }


def check_architecture(saved: dict, current: dict, path: str) -> None:
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, model {v!r}" for k, v in current.items()
             if k in saved and saved[k] != v]
    if diffs:
        raise LayoutError(f"{path}: checkpoint does not fit the model ({'; '.join(diffs)})")


def _need(cond, path, message):
    if not cond:
        raise FormatError(f"{path}: {message}")


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    m = read_json(path, "universal checkpoint manifest", MAX_MANIFEST_BYTES, root=directory)
    _need(m.get("format") == FORMAT_NAME, path, f"'format' is {m.get('format')!r}, expected {FORMAT_NAME!r}")
    version = m.get("version")
    _need(isinstance(version, int), path, f"'version' is {version!r}, expected an integer")
    _need(version <= FORMAT_VERSION, path,
          f"format version {version} is newer than this megatron-ucp reads ({FORMAT_VERSION}); upgrade megatron-ucp")
    for key, kind in (("iteration", int), ("consumed_samples", int), ("tensors", dict),
                      ("architecture", dict), ("layout", dict)):
        _need(isinstance(m.get(key), kind), path, f"key {key!r} missing or not {kind.__name__}")
    tensors: Dict[str, dict] = m["tensors"]
    for name, entry in tensors.items():
        where = f"tensor {name!r}"
        _need(isinstance(entry, dict), path, f"{where}: not an object")
        _need(entry.get("file") == tensor_file(name), path,
              f"{where}: file {entry.get('file')!r}, expected {tensor_file(name)!r}")
        shape = entry.get("shape")
        _need(isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < 2**40 for d in shape),
              path, f"{where}: bad shape {shape!r}")
        _need(isinstance(entry.get("padding_rows", 0), int) and entry.get("padding_rows", 0) >= 0,
              path, f"{where}: bad padding_rows")
        entry.setdefault("padding_rows", 0)
        states = entry.get("states")
        _need(isinstance(states, list) and states and all(s in STATES for s in states), path,
              f"{where}: bad states {states!r}")
        try:
            Rule.from_json(entry.get("rule") or {})
        except (KeyError, LayoutError, TypeError, ValueError) as e:
            raise FormatError(f"{path}: {where}: bad rule {entry.get('rule')!r} ({e})") from None
    return m


def jsonable(obj):
    """Arguments made JSON-safe: string keys, lists for tuples, repr() for anything else."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    return repr(obj)
