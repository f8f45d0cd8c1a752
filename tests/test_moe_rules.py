"""MoE arguments, pure. (Expert names come from megatron's sharded state dict: tests/test_mapping.py
checks them against its keys on every expert-parallel layout, test_moe_matrix.py across expert layouts.)"""

import argparse

import pytest

from megatron_ucp.errors import ConfigError
from megatron_ucp.mcore.flag_validation import validate
from megatron_ucp.mcore.flags import build_parser, moe_layer_freq


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


def test_grouped_gemm_without_kernels_is_refused_at_build():
    """Without transformer-engine and (before megatron-core 0.19) the grouped_gemm package there
    is no grouped-experts layout on CPU: 0.19 would build sequential experts silently, so the
    flag is refused by name instead."""
    from megatron_ucp.mcore import model

    if model._have_te() or model._have_legacy_grouped_gemm():
        pytest.skip("grouped-GEMM kernels are installed here")
    args = parse(["--moe-grouped-gemm", "--cpu"])
    with pytest.raises(ConfigError, match="--moe-grouped-gemm needs GPU kernels"):
        model._megatron_layer_spec(args, None, None)
