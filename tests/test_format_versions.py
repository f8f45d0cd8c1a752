"""Format version 1 keeps loading: its names are read as version 2's, its files as they are.

tests/fixtures/v1_moe is a version-1 checkpoint (MoE, EP2, distributed optimizer) written by
megatron-ucp before version 2; v1_moe.json holds the arguments and losses of the run that
saved it at iteration 4.
"""

import json
import shutil

import pytest

from harness import REPO, losses, max_loss_delta, run_steps, train_step
from megatron_ucp.format.format_v1 import upgrade_tensors, v2_names
from megatron_ucp.format.tensor_entry import TensorEntry

FIXTURE = REPO / "tests" / "fixtures" / "v1_moe"
RUN = json.loads((REPO / "tests" / "fixtures" / "v1_moe.json").read_text())
TOL = 1e-4


def test_v2_names_of_local_and_te_spec_layers():
    v1 = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight",
          "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.bias",
          "decoder.layers.0.mlp.linear_fc1.weight",
          "decoder.layers.1.input_layernorm.bias", "decoder.layers.1.pre_mlp_layernorm.weight",
          "decoder.layers.1.mlp.router.weight",
          "decoder.layers.1.mlp.experts.local_experts.12.linear_fc1.weight",
          "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight"]
    assert v2_names(v1) == {
        "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
        "decoder.final_layernorm.weight": "decoder.final_layernorm.weight",
        "decoder.layers.0.input_layernorm.weight": "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.0.pre_mlp_layernorm.bias": "decoder.layers.0.mlp.linear_fc1.layer_norm_bias",
        "decoder.layers.0.mlp.linear_fc1.weight": "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.1.input_layernorm.bias": "decoder.layers.1.self_attention.linear_qkv.layer_norm_bias",
        # a MoE layer (no dense fc1): megatron's transformer-engine spec keeps the norm apart
        "decoder.layers.1.pre_mlp_layernorm.weight": "decoder.layers.1.pre_mlp_layernorm.weight",
        "decoder.layers.1.mlp.router.weight": "decoder.layers.1.mlp.router.weight",
        "decoder.layers.1.mlp.experts.local_experts.12.linear_fc1.weight":
            "decoder.layers.1.mlp.experts.experts.12.linear_fc1.weight",
        "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight":
            "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight",
    }


def test_upgrade_keeps_files_and_marks_the_vocabulary():
    tensors = {"embedding.word_embeddings.weight": {"file": "tensors/embedding.word_embeddings.weight.safetensors",
                                                    "shape": [250, 32], "states": ["param"],
                                                    "rule": {"kind": "vocab", "dim": 0}, "padding_rows": 6},
               "decoder.layers.3.input_layernorm.weight": {
                   "file": "tensors/decoder.layers.3.input_layernorm.weight.safetensors", "shape": [32],
                   "states": ["param"], "rule": {"kind": "replicated", "dim": 0}}}
    out = upgrade_tensors({n: TensorEntry.from_json(n, e, "ucp.json", 1) for n, e in tensors.items()})
    assert out["embedding.word_embeddings.weight"].vocab is True
    norm = out["decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"]
    assert norm.file == "tensors/decoder.layers.3.input_layernorm.weight.safetensors" and not norm.vocab
    assert "rule" not in norm.to_json()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    work = tmp_path_factory.mktemp("v1")
    shutil.copytree(FIXTURE, work / "V1")
    step = RUN["saved_at"]
    model = RUN["argv"]
    steps = [
        # saved on EP2 with the distributed optimizer; resumed on EP1 without it, and on EP2
        train_step("ep1", model, iters=8, load=str(work / "V1"), step=step),
        train_step("ep2", model + RUN["saved_with"], iters=8, load=str(work / "V1"), step=step,
                   save=str(work / "V2"), interval=8),
    ]
    return run_steps(2, steps, work), work


@pytest.mark.parametrize("name", ["ep1", "ep2"])
def test_version_1_resumes(resumed, name):
    results, _ = resumed
    reference = {int(k): v for k, v in RUN["losses"].items()}
    got = losses(results, name)
    assert sorted(got) == [5, 6, 7, 8]
    delta = max_loss_delta(reference, got)
    print(f"version 1 -> {name}: max |loss delta| {delta:.3g}")
    assert delta <= TOL


def test_saved_again_as_version_2(resumed):
    _, work = resumed
    m = json.loads((work / "V2" / "iter_0000008" / "ucp.json").read_text())
    assert m["version"] == 2
    names = set(m["tensors"])
    assert "decoder.layers.1.mlp.experts.experts.3.linear_fc2.weight" in names
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in names
    assert not any("local_experts" in n or "input_layernorm" in n for n in names)
