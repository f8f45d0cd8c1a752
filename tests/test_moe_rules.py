"""MoE naming and flags, pure: global expert ids from every expert layout, and MoE arguments."""

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_ucp.errors import ConfigError, LayoutError
from megatron_ucp.model_map import _expert_rule, expert_name
from megatron_ucp.train.args import build_parser, moe_layer_freq, validate


@given(st.integers(1, 16), st.integers(1, 8), st.sampled_from(["linear_fc1.weight", "linear_fc2.weight",
                                                                 "linear_fc1.bias", "linear_fc2.bias"]))
def test_every_expert_layout_names_each_global_expert_once(num_local, ep, tail):
    seen = set()
    for ep_rank in range(ep):
        for i in range(num_local):
            sequential = expert_name(f"mlp.experts.local_experts.{i}.{tail}", num_local, ep_rank)
            module, kind = tail.split(".")
            te_grouped = expert_name(f"mlp.experts.{module}.{kind}{i}", num_local, ep_rank)
            assert sequential == te_grouped
            seen.add(sequential)
    assert seen == {f"mlp.experts.local_experts.{e}.{tail}" for e in range(num_local * ep)}


def test_other_names_are_not_experts():
    assert expert_name("mlp.router.weight", 4, 1) is None
    assert expert_name("mlp.shared_experts.linear_fc1.weight", 4, 1) is None
    assert expert_name("mlp.experts.weight1", 4, 1) is None  # legacy grouped: mapped separately


def test_local_expert_outside_the_rank_is_an_error():
    with pytest.raises(LayoutError, match="local expert 4 outside 0..3"):
        expert_name("mlp.experts.local_experts.4.linear_fc1.weight", 4, 0)


def test_expert_rules_follow_column_and_row_parallelism():
    name = "decoder.layers.1.mlp.experts.local_experts.3.{}"
    assert _expert_rule(name.format("linear_fc1.weight"), gated=True).kind == "gated"
    assert _expert_rule(name.format("linear_fc1.weight"), gated=False).dim == 0
    assert _expert_rule(name.format("linear_fc2.weight"), gated=True).dim == 1
    assert _expert_rule(name.format("linear_fc2.bias"), gated=True).kind == "replicated"


def test_moe_layer_freq_forms():
    assert moe_layer_freq("2") == 2
    assert moe_layer_freq("([0]+[1])*2") == [0, 1, 0, 1]
    assert moe_layer_freq("[1,0,1]") == [1, 0, 1]
    for bad in ("__import__('os')", "[2,1]", "[0,"):
        with pytest.raises(argparse.ArgumentTypeError):
            moe_layer_freq(bad)


def parse(argv, world=2):
    base = ["--mock-data", "--num-layers", "4", "--num-experts", "4", "--disable-bias-linear"]
    return validate(build_parser().parse_args(base + argv), world)


@pytest.mark.parametrize("argv,names", [
    (["--moe-layer-freq", "[1,0,1]"], ["--moe-layer-freq", "3 layers", "--num-layers 4"]),
    (["--moe-router-enable-expert-bias"], ["--moe-router-enable-expert-bias", "sigmoid"]),
    (["--moe-grouped-gemm", "--disable-bias-linear"], None),  # valid: refused at build without kernels
])
def test_moe_arguments(argv, names):
    if names is None:
        assert parse(argv).moe_grouped_gemm
        return
    with pytest.raises(ConfigError) as e:
        parse(argv)
    for name in names:
        assert name in str(e.value), str(e.value)
