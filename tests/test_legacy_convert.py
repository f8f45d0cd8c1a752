"""Pure rules of the legacy-checkpoint converter (megatron_ucp/legacy_convert.py), in-process.

The end-to-end checks (bitwise equality with a direct universal save, resume on other layouts,
errors for missing information) run on real checkpoints in tests/test_resume_matrix.py.
"""

import pytest

from megatron_ucp.errors import LayoutError
from megatron_ucp.layout import Rule
from megatron_ucp.legacy_convert import (
    buffer_offsets,
    global_name,
    global_rank,
    parse_rank_dir,
    rule_for_name,
)


def test_buffer_offsets_reverse_order_and_64_element_starts():
    offsets, numel = buffer_offsets([("a", 10, False), ("b", 100, False), ("c", 5, False)], dp=2, bucket_size=None)
    # reversed: c at 0, b at pad64(5) = 64, a at pad64(164) = 192
    assert offsets == {"c": (0, 5), "b": (64, 100), "a": (192, 10)}
    assert numel == 202


@pytest.mark.parametrize("dp", [1, 3, 8])
def test_buffer_offsets_shared_embedding_bucket_drops_bucket_padding(dp):
    # The tied embedding on the first stage gets a bucket of its own; the saved flat state
    # concatenates buckets without their end padding (which depends on DP), so offsets do not.
    offsets, numel = buffer_offsets([("e", 10, True), ("x", 3, False), ("y", 4, False)], dp=dp, bucket_size=None)
    assert offsets == {"y": (0, 4), "x": (64, 3), "e": (128, 10)}
    assert numel == 138


def test_buffer_offsets_bucket_size_splits_buckets():
    # bucket_size 50: y (0..60) fills bucket 0; x starts bucket 1 at pad(60, 128) = 128
    offsets, numel = buffer_offsets([("x", 7, False), ("y", 60, False)], dp=1, bucket_size=50)
    assert offsets == {"y": (0, 60), "x": (60, 7)}
    assert numel == 67


def test_rules_by_name():
    assert rule_for_name("embedding.word_embeddings.weight", False) == Rule("vocab")
    assert rule_for_name("output_layer.weight", True) == Rule("vocab")
    assert rule_for_name("decoder.layers.0.self_attention.linear_qkv.weight", False) == Rule("split", 0)
    assert rule_for_name("decoder.layers.0.self_attention.linear_qkv.bias", False) == Rule("split", 0)
    assert rule_for_name("decoder.layers.0.self_attention.linear_proj.weight", False) == Rule("split", 1)
    assert rule_for_name("decoder.layers.0.self_attention.linear_proj.bias", False) == Rule("replicated")
    assert rule_for_name("decoder.layers.0.mlp.linear_fc1.weight", True) == Rule("gated")
    assert rule_for_name("decoder.layers.0.mlp.linear_fc1.weight", False) == Rule("split", 0)
    assert rule_for_name("decoder.layers.0.mlp.linear_fc2.weight", False) == Rule("split", 1)
    assert rule_for_name("decoder.layers.0.mlp.linear_fc2.bias", False) == Rule("replicated")
    assert rule_for_name("decoder.layers.0.input_layernorm.weight", False) == Rule("replicated")
    assert rule_for_name("decoder.final_layernorm.bias", False) == Rule("replicated")
    assert rule_for_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", False) == Rule("replicated")
    assert rule_for_name("embedding.position_embeddings.weight", False) == Rule("replicated")
    with pytest.raises(LayoutError, match="unknown to the legacy converter"):
        rule_for_name("decoder.layers.0.mlp.something_new.weight", False)


def test_global_layer_names_follow_the_pipeline_and_virtual_stages():
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    assert global_name(name, 8, 2, 1, None, None, 4) == "decoder.layers.5.mlp.linear_fc1.weight"
    # PP2 x 2 virtual stages of 2 layers: chunk v of rank r starts at (v * 2 + r) * 2
    assert global_name(name, 8, 2, 1, 2, 1, 2) == "decoder.layers.7.mlp.linear_fc1.weight"
    assert global_name(name, 8, 2, 0, 2, 1, 2) == "decoder.layers.5.mlp.linear_fc1.weight"
    assert global_name("embedding.word_embeddings.weight", 8, 2, 0, None, None, 4) == "embedding.word_embeddings.weight"
    with pytest.raises(LayoutError, match="uneven"):
        global_name(name, 8, 2, 0, None, None, 3)


def test_rank_folders():
    assert parse_rank_dir("mp_rank_01") == (1, 0)
    assert parse_rank_dir("mp_rank_01_002") == (1, 2)
    assert parse_rank_dir("iter_0000005") is None
    with pytest.raises(LayoutError, match="expert-parallel"):
        parse_rank_dir("mp_rank_00_001_003")
    assert global_rank(tp_rank=1, dp_rank=1, pp_rank=1, tp=2, dp=2) == 7
