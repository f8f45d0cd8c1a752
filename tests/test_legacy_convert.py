"""Pure rules of the legacy-checkpoint converter (megatron_ucp/convert/legacy_plan.py,
legacy_files.py, and the buffer layout in buffer_layout.py), in-process.

The end-to-end checks (bitwise equality with a direct universal save, resume on other layouts,
errors for missing information) run on real checkpoints in tests/test_resume_matrix.py.
"""

import pytest

from megatron_ucp.errors import LayoutError
from megatron_ucp.format.layout import Rule
from megatron_ucp.convert.buffer_layout import buffer_offsets
from megatron_ucp.convert.legacy_files import parse_rank_dir
from megatron_ucp.convert.legacy_plan import global_name, global_rank, model_geometry


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


def test_rules_from_megatrons_description_and_saved_shapes():
    """The legacy converter names and splits tensors by megatron's description of the model
    (a meta-device model from the stored arguments) and the saved TP-local shapes: the rules
    that come out are megatron's tensor-parallel ones, the names megatron's keys."""
    from megatron_ucp.format.layout import infer_rule, local_shape

    a = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "seq_length": 8,
         "max_position_embeddings": 8, "vocab_size": 50, "swiglu": True, "cpu": True, "mock_data": True,
         "micro_batch_size": 1, "global_batch_size": 1, "untie_embeddings_and_output_weights": True}
    described, architecture = model_geometry(a, 1, 50, 64)
    assert architecture["gated_linear_unit"] and architecture["vocab_size"] == 50
    expected = {
        "embedding.word_embeddings.weight": Rule("vocab"),
        "output_layer.weight": Rule("vocab"),
        "decoder.layers.1.self_attention.linear_qkv.weight": Rule("split", 0),
        "decoder.layers.1.self_attention.linear_qkv.bias": Rule("split", 0),
        "decoder.layers.1.self_attention.linear_proj.weight": Rule("split", 1),
        "decoder.layers.1.self_attention.linear_proj.bias": Rule("replicated"),
        "decoder.layers.1.mlp.linear_fc1.weight": Rule("gated"),
        "decoder.layers.1.mlp.linear_fc2.weight": Rule("split", 1),
        "decoder.layers.1.input_layernorm.weight": Rule("replicated"),
        "decoder.final_layernorm.bias": Rule("replicated"),
    }
    for module_name, rule in expected.items():
        g = described[module_name]
        padded = 64 if rule.kind == "vocab" else None
        saved = local_shape(rule, g.atomic_shape, 2, padded)
        assert infer_rule(g.atomic_shape, saved, len(g.boxes) > 1, g.padded_rows is not None) == rule, module_name
    assert described["decoder.layers.1.input_layernorm.weight"].name == \
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    assert described["embedding.word_embeddings.weight"].atomic_shape == (50, 16)


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
