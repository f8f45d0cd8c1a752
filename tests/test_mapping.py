"""The mapping from megatron-core's sharded_state_dict (megatron_ucp/mcore/model_map.py).

Pure part: the boxes megatron describes give the same pieces as the layout rules (the oracle),
and the rule a converter infers from saved shapes is the rule that cut them.
Model part: on every model variant the tests train, on several layouts, the atomic names are
megatron's own `torch_dist` keys with their prepended layer and expert coordinates written as
global numbers, every rank and layout naming the same set.
"""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import BASE, ok, run_steps
from megatron_ucp.format.layout import Rule, box_pieces, boxes_of, infer_rule, local_shape, pieces
from test_layout import SETTINGS, layouts

pytestmark = pytest.mark.core_subset  # CI runs these on megatron-core 0.19 too (.ci/run)


@SETTINGS
@given(case=layouts(), data=st.data())
def test_boxes_give_the_rules_pieces(case, data):
    rank = data.draw(st.integers(0, case["tp"] - 1), label="tp_rank")
    boxes = boxes_of(case["rule"], case["shape"], case["tp"], rank, case["padded_rows"])
    assert box_pieces(boxes, case["shape"], case["padded_rows"], case["held"]) == pieces(
        case["rule"], case["shape"], case["tp"], rank, case["padded_rows"], case["held"])


@SETTINGS
@given(case=layouts())
def test_inferred_rule_is_the_rule_that_cut(case):
    rule, tp = case["rule"], case["tp"]
    part = local_shape(rule, case["shape"], tp, case["padded_rows"])
    got = infer_rule(case["shape"], part, rule.kind == "gated", rule.kind == "vocab")
    # one rank holding a tensor whole holds it as a replicated one: the same single piece
    assert got == (Rule("replicated") if tp == 1 and rule.kind in ("split", "gated") else rule)


def test_infer_rule_refuses_shapes_no_rule_gives():
    import pytest

    from megatron_ucp.errors import LayoutError

    with pytest.raises(LayoutError, match="does not evenly split"):
        infer_rule((8, 6), (4, 3), False, False)
    with pytest.raises(LayoutError, match="does not evenly split"):
        infer_rule((9, 6), (4, 6), False, False)
    with pytest.raises(LayoutError, match="packed"):
        infer_rule((8, 6), (8, 3), True, False)


# ------------------------------------------------------------------ names from megatron's keys

def oracle_name(key: str, coords) -> str:
    """megatron's key with its prepended coordinates written in: the layer number after
    `layers.` (when the key does not number layers already), the expert id after
    `experts.experts.` (independent of the mapping, which asks megatron for its spelling)."""
    parts = key.split(".")
    slots = []
    for i, p in enumerate(parts):
        if p == "layers" and not (i + 1 < len(parts) and parts[i + 1].isdigit()):
            slots.append(i + 1)
        if p == "experts" and i > 0 and parts[i - 1] == "experts":
            slots.append(i + 1)
    assert len(slots) == len(coords), (key, coords)
    for slot, c in sorted(zip(slots, coords), reverse=True):
        parts.insert(slot, str(c))
    return ".".join(parts)


def test_oracle_name():
    assert oracle_name("decoder.layers.mlp.experts.experts.linear_fc1.weight", (3, 5)) == \
        "decoder.layers.3.mlp.experts.experts.5.linear_fc1.weight"
    assert oracle_name("decoder.layers.2.mlp.router.weight", ()) == "decoder.layers.2.mlp.router.weight"


VARIANTS = {
    "dense": [],
    "gqa_swiglu_untied": ["--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
                          "--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
                          "--untie-embeddings-and-output-weights", "--disable-bias-linear"],
    "moe_shared_bias": ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear",
                        "--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
                        "--moe-router-enable-expert-bias", "--moe-layer-freq", "[0,1,1,1]"],
    "mla_qk_mtp": ["--multi-latent-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
                   "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
                   "--v-head-dim", "6", "--qk-layernorm", "--mtp-num-layers", "1",
                   "--untie-embeddings-and-output-weights"],
    "deepseek_like": ["--multi-latent-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
                      "--kv-lora-rank", "16", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6",
                      "--mtp-num-layers", "1", "--untie-embeddings-and-output-weights", "--swiglu", "--disable-bias-linear", "--num-experts", "4",
                      "--moe-router-topk", "2", "--moe-shared-expert-intermediate-size", "32",
                      "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                      "--moe-layer-freq", "[0]+[1]*3"],
}
LAYOUTS = {
    "tp1": [], "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "pp2_uneven": ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"],
    "ep2": ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"],
}


def names_step(variant: str, layout: str) -> dict:
    extra = VARIANTS[variant] + LAYOUTS[layout]
    return {"name": f"{variant}:{layout}", "op": "names", "argv": BASE + extra + ["--train-iters", "1"]}


def _moe_norm_canonical(name: str, names: set) -> str:
    m = re.match(r"^(.*\.)mlp\.linear_fc1\.layer_norm_(weight|bias)$", name)
    if m and f"{m.group(1)}mlp.linear_fc1.weight" not in names:
        return f"{m.group(1)}pre_mlp_layernorm.{m.group(2)}"
    return name


def test_atomic_names_are_megatrons_keys(tmp_path):
    steps = [names_step(v, lay) for v in VARIANTS for lay in LAYOUTS
             if not (lay == "ep2" and "--num-experts" not in VARIANTS[v])]
    results = run_steps(2, steps, tmp_path)
    for variant in VARIANTS:
        seen = {}
        for lay in LAYOUTS:
            name = f"{variant}:{lay}"
            if name not in results and lay == "ep2":
                continue
            r = ok(results, name)
            keys = {oracle_name(k, tuple(c)) for k, c in r["keys"]}
            keys = {_moe_norm_canonical(k, keys) for k in keys}
            assert set(r["names"]) == keys, (name, sorted(set(r["names"]) ^ keys)[:6])
            seen[lay] = set(r["names"])
        first = next(iter(seen.values()))
        for lay, names in seen.items():
            assert names == first, (variant, lay, sorted(names ^ first)[:6])
