"""Reading format version 1: its atomic names, translated to version 2's (docs/FORMAT.md).

Version 1 named atomic tensors after the saving model's parameters (module names, with global
layer and expert numbers); version 2 names them by megatron's checkpoint keys. The files are
the same: a version-1 manifest is read as version 2 with each entry keeping its file. Pure
functions, so that converters writing from version-1 names use the same translation.
"""

import re
from typing import Dict, Iterable, TypeVar

_LAYER = re.compile(r"^(decoder\.layers\.\d+\.)(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_NORM = re.compile(r"^(input|pre_mlp)_layernorm\.(weight|bias)$")
T = TypeVar("T")


def v2_names(v1_names: Iterable[str]) -> Dict[str, str]:
    """version-1 name -> version-2 name, for all the names of one checkpoint.

    - local experts `mlp.experts.local_experts.<E>.` are megatron's `mlp.experts.experts.<E>.`;
    - the local spec's `input_layernorm.*` is megatron's `self_attention.linear_qkv.layer_norm_*`;
    - its `pre_mlp_layernorm.*` is `mlp.linear_fc1.layer_norm_*` in a dense layer (one that has
      `mlp.linear_fc1.weight`) and stays `pre_mlp_layernorm.*` in a MoE layer.
    transformer-engine spec names of version 1 are already megatron's.
    """
    names = list(v1_names)
    dense_layers = {m.group(1) for n in names if (m := _LAYER.match(n)) and m.group(2) == "mlp.linear_fc1.weight"}
    out = {}
    for name in names:
        m = _LAYER.match(name)
        if not m:
            out[name] = name
            continue
        layer, rest = m.groups()
        e = _EXPERT.match(rest)
        if e:
            rest = f"mlp.experts.experts.{e.group(1)}.{e.group(2)}"
        n = _NORM.match(rest)
        if n and n.group(1) == "input":
            rest = f"self_attention.linear_qkv.layer_norm_{n.group(2)}"
        elif n and layer in dense_layers:
            rest = f"mlp.linear_fc1.layer_norm_{n.group(2)}"
        out[name] = layer + rest
    if len(set(out.values())) != len(out):
        raise ValueError("two version-1 names translate to one version-2 name: "
                         f"{sorted(n for n in out if list(out.values()).count(out[n]) > 1)[:4]}")
    return out


def upgrade_tensors(tensors: Dict[str, T]) -> Dict[str, T]:
    """A version-1 manifest's `tensors` under version 2's names, each entry as it was (it keeps
    its file; TensorEntry.from_json made its vocabulary rule the `vocab` mark)."""
    renamed = v2_names(tensors)
    return {renamed[old]: entry for old, entry in tensors.items()}
