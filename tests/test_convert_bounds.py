"""A converter's stored numbers, checked before they cost anything (issue 47, bug 6 and the weak
fsdp_dtensor inputs).

Stored arguments are typed, bounded and compared with the tensors of the checkpoint's
`.metadata` before a meta model is built from them (`num_layers 100000` beside two layers: one
line in milliseconds, not minutes and GBs), for `fsdp_dtensor` (its `args` object) and
`torch_dist` (`common.pt`). Text, infinity, NaN, negative or deeply nested values in the
arguments, the step, the world, the parallel sizes, the param groups, the scheduler or the
progress are refused naming the key, and nothing is written: what a converter commits passes
the reader's checks (`inspect --verify`). The checkpoints are built by hand
(fsdp_dtensor_fixture.py: megatron's keys and shapes, written with torch DCP), small.
"""

import argparse
import math
import os

import pytest
import torch

import fsdp_dtensor_fixture as fx
from zip_bombs import bomb
from megatron_ucp.convert import fsdp_dtensor, torch_dist_plan
from megatron_ucp.errors import UCPError
from megatron_ucp.format import inspection
from harness import deadline
from megatron_ucp.mcore import saved_args


def _refused(fn, *words, seconds=30):
    """fn() raises one line naming each of `words`, within `seconds` (imports included, on a
    loaded machine; building the model the hostile arguments describe takes minutes)."""
    with deadline(seconds), pytest.raises(UCPError) as ei:
        fn()
    message = str(ei.value)
    for w in words:
        assert w in message, f"{w!r} not in: {message}"
    assert "\n" not in message
    return message


def _convert(folder, out):
    return fsdp_dtensor.convert(str(folder), str(out), progress=False)


# ---------------------------------------------------------------- the keys, pure


def test_stored_counts_read_every_key_style():
    per_layer = {"decoder.layers.0.mlp.linear_fc1.weight": (8, 4), "decoder.layers.1.mlp.linear_fc1.weight": (8, 4),
                 "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight": (8, 4),
                 "decoder.layers.1.mlp.experts.local_experts.5.linear_fc1.weight": (8, 4),
                 "decoder.layers.1.mlp.shared_experts.linear_fc1.weight": (8, 4),
                 "mtp.layers.0.enorm.weight": (4,)}
    assert saved_args.stored_counts(per_layer) == {"num_layers": 2, "num_experts": 2, "mtp_num_layers": 1,
                                                   "any_experts": True}
    stacked = {"decoder.layers.self_attention.linear_qkv.weight": (6, 12, 4),
               "decoder.layers.mlp.experts.experts.linear_fc1.weight": (6, 3, 8, 4),
               "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight": (6, 12, 4),
               "embedding.word_embeddings.weight": (256, 4)}
    assert saved_args.stored_counts(stacked) == {"num_layers": 6, "num_experts": 3, "mtp_num_layers": None,
                                                 "any_experts": True}
    pattern = {"decoder.layers.0.mlp.experts.experts.linear_fc2.weight": (7, 4, 8),
               "decoder.layers.1.mlp.experts.experts.3.linear_fc2.weight": (4, 8)}
    assert saved_args.stored_counts(pattern)["num_experts"] == 7
    assert saved_args.stored_counts({"output_layer.weight": (3, 4)})["num_layers"] is None


def test_against_tensors_names_the_argument_and_what_the_tensors_hold():
    shapes = {"decoder.layers.0.x.weight": (4,), "decoder.layers.1.x.weight": (4,),
              "embedding.word_embeddings.weight": (256, 32), "embedding.position_embeddings.weight": (16, 32)}
    saved_args.against_tensors({"num_layers": 2, "hidden_size": 32, "seq_length": 16}, shapes, "f")
    cases = [({"num_layers": 100000}, "'args.num_layers' is 100000, the tensors hold 2 layers"),
             ({"num_experts": 100000}, "'args.num_experts' is 100000, the tensors hold 0 experts"),
             ({"mtp_num_layers": 1000}, "'args.mtp_num_layers' is 1000, the tensors hold 0 MTP layers"),
             ({"hidden_size": 10**6}, "'args.hidden_size' is 1000000, embedding.word_embeddings.weight has 32"),
             ({"max_position_embeddings": 10**9}, "'args.max_position_embeddings' is 1000000000, but the position")]
    for values, says in cases:
        with pytest.raises(UCPError, match=None) as ei:
            saved_args.against_tensors({"num_layers": 2, **values}, shapes, "f")
        assert says in str(ei.value) and str(ei.value).startswith("f: ")


# ---------------------------------------------------------------- fsdp_dtensor, built by hand


def test_a_hand_built_checkpoint_converts_and_verifies(tmp_path):
    summary = _convert(fx.write(tmp_path), tmp_path / "out")
    assert summary["iteration"] == fx.ITERATION and summary["tensors"] > 0
    assert inspection.verify(str(tmp_path / "out")) == []


HUGE_ARGS = {
    "num_layers": ({"num_layers": 100000}, "'args.num_layers' is 100000, the tensors hold 2 layers"),
    "num_experts": ({"num_experts": 100000}, "'args.num_experts' is 100000, the tensors hold 0 experts"),
    "mtp_num_layers": ({"mtp_num_layers": 100000}, "'args.mtp_num_layers' is 100000"),
    "hidden_size": ({"hidden_size": 2**30}, "'args.hidden_size' is 1073741824, embedding.word_embeddings"),
    "num_layers_over_int32": ({"num_layers": 2**40}, "'args.num_layers' is 1099511627776, expected an integer 0.."),
}


@pytest.mark.parametrize("case", sorted(HUGE_ARGS))
def test_fsdp_dtensor_stored_sizes_are_checked_before_the_model_is_built(tmp_path, case):
    changes, says = HUGE_ARGS[case]
    folder = fx.write(tmp_path, args=fx.stored_args(**changes))
    _refused(lambda: _convert(folder, tmp_path / "out"), str(folder / "args"), says)
    assert not (tmp_path / "out").exists()


def _torch_dist_folder(tmp_path, **changes):
    """A torch_dist folder as megatron-core 0.16 writes one (stacked layers in .metadata, the
    arguments in common.pt), of a 2-layer model; only what the plan reads before its model."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "iter_0000004"
    sd = {"embedding.word_embeddings.weight": torch.zeros(256, 32),
          "decoder.layers.input_layernorm.weight": torch.zeros(2, 32),
          "decoder.layers.self_attention.linear_qkv.weight": torch.zeros(2, 96, 32)}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    args = fx.stored_args(**{"world_size": 1, "mock_data": True, **changes})
    torch.save({"args": args, "iteration": 4, "optimizer": {}}, folder / "common.pt")
    return folder


@pytest.mark.parametrize("case", ["num_layers", "num_experts", "hidden_size"])
def test_torch_dist_stored_sizes_are_checked_before_the_model_is_built(tmp_path, case):
    changes, says = HUGE_ARGS[case]
    folder = _torch_dist_folder(tmp_path, **changes)
    _refused(lambda: torch_dist_plan.plan_conversion(str(folder)), str(folder / "common.pt"), says)


def test_torch_dist_stored_world_and_args_are_typed(tmp_path):
    folder = _torch_dist_folder(tmp_path / "a", world_size="two")
    _refused(lambda: torch_dist_plan.plan_conversion(str(folder)), "'args.world_size' is 'two'")
    folder = _torch_dist_folder(tmp_path / "b", num_layers="2")
    _refused(lambda: torch_dist_plan.plan_conversion(str(folder)), "'args.num_layers' is '2', expected an integer")


PLACEHOLDER = "NESTED_PLACEHOLDER"


def _deeply_nested_args(key: str, depth: int) -> bytes:
    """A torch.save file of the arguments with `key` a list nested `depth` levels: pickle opcodes
    written by hand (EMPTY_LIST x depth, APPEND x depth-1), which unpickle without recursion
    where Python's pickler could not write them."""
    from zip_bombs import torch_entries, zip_bytes
    import zlib

    deep = b"]" * depth + b"a" * (depth - 1)
    entries = []
    for name, method, data, crc, size in torch_entries(argparse.Namespace(**fx.stored_args(**{key: PLACEHOLDER}))):
        if name.endswith("/data.pkl"):
            marker = b"X" + len(PLACEHOLDER).to_bytes(4, "little") + PLACEHOLDER.encode()
            assert data.count(marker) == 1
            data = data.replace(marker, deep)
            crc, size = zlib.crc32(data), len(data)
        entries.append((name, method, data, crc, size))
    return zip_bytes(entries)


# name: (what to change, words of the one line). Each one was a traceback (ValueError,
# TypeError, OverflowError, RecursionError) or an output `inspect --verify` refuses.
WEAK = {
    "args_text": ({"args": {"hidden_size": "32"}}, ["'args.hidden_size' is '32', expected an integer"]),
    "args_inf": ({"args": {"norm_epsilon": math.inf}}, ["'args.norm_epsilon' is inf, expected a finite number"]),
    "args_nan_carried": ({"args": {"lr": math.nan}}, ["'args.lr' is nan", "would be written"]),
    "args_nested": ({"blob": ("args", _deeply_nested_args("data_path", 100000))},
                    ["'args.data_path' nests deeper than 16 levels"]),
    "world_text": ({"args": {"world_size": "two"}}, ["'args.world_size' is 'two', expected an integer"]),
    "world_inf": ({"args": {"world_size": math.inf}}, ["'args.world_size' is inf"]),
    "world_list": ({"args": {"world_size": [2]}}, ["'args.world_size' is [2]"]),
    "tp_text": ({"args": {"tensor_model_parallel_size": "1"}}, ["'args.tensor_model_parallel_size' is '1'"]),
    "tp_negative": ({"args": {"tensor_model_parallel_size": -1}}, ["'args.tensor_model_parallel_size' is -1"]),
    "consumed_negative": ({"args": {"consumed_train_samples": -8}}, ["'args.consumed_train_samples' is -8"]),
    "consumed_text": ({"args": {"consumed_train_samples": "32"}}, ["'args.consumed_train_samples' is '32'"]),
    "dp_negative": ({"args": {"data_parallel_size": -2}}, ["'args.data_parallel_size' is -2"]),
    "skipped_inf": ({"args": {"skipped_train_samples": math.inf}}, ["'args.skipped_train_samples' is inf"]),
    "step_text": ({"group": {"step": "four"}}, ["step is 'four', expected an integer step"]),
    "step_inf": ({"group": {"step": math.inf}}, ["step is inf"]),
    "step_nan": ({"group": {"step": math.nan}}, ["step is nan"]),
    "step_negative": ({"group": {"step": -4}}, ["step is -4"]),
    "step_fraction": ({"group": {"step": 4.5}}, ["step is 4.5"]),
    "betas_nan": ({"group": {"betas": (math.nan, 0.999)}}, ["betas", "nan"]),
    "betas_over_one": ({"group": {"betas": (1.5, 0.999)}}, ["param_groups[0].betas' is [1.5, 0.999], expected two "
                                                            "numbers in [0, 1)"]),
    "eps_negative": ({"group": {"eps": -1e-8}}, ["param_groups[0].eps' is -1e-08"]),
    "eps_inf": ({"group": {"eps": math.inf}}, ["eps", "inf"]),
    "weight_decay_nan": ({"group": {"weight_decay": math.nan}}, ["weight_decay", "nan"]),
    "weight_decay_negative": ({"group": {"weight_decay": -0.01}}, ["param_groups[0].weight_decay' is -0.01"]),
    "lr_text": ({"group": {"lr": "fast"}}, ["param_groups[0].lr' is 'fast'"]),
    "scheduler_negative": ({"scheduler": {"num_steps": -3}}, ["'scheduler.num_steps' is -3"]),
    "scheduler_nan": ({"scheduler": {"max_lr": math.nan}}, ["max_lr", "nan"]),
    "flops_nan": ({"objects": {"num_floating_point_operations_so_far": math.nan}},
                  ["num_floating_point_operations_so_far", "nan"]),
    "flops_negative": ({"objects": {"num_floating_point_operations_so_far": -1.0}},
                       ["num_floating_point_operations_so_far' is -1.0"]),
    "iteration_true": ({"objects": {"iteration": True}}, ["'iteration' is True"]),
}


@pytest.mark.parametrize("case", sorted(WEAK))
def test_weak_fsdp_dtensor_values_are_refused_and_nothing_is_written(tmp_path, case):
    change, words = WEAK[case]
    args = fx.stored_args(**change.get("args", {}))
    group = {**fx.GROUP, **change.get("group", {})}
    scheduler = {**fx.SCHEDULER, **change.get("scheduler", {})}
    folder = fx.write(tmp_path, args=args, group=group, scheduler=scheduler, objects=change.get("objects"))
    if "blob" in change:
        fx.replace_object(folder, *change["blob"])
    _refused(lambda: _convert(folder, tmp_path / "out"), *words)
    assert not (tmp_path / "out" / "iter_0000004").exists()
    assert not (tmp_path / "out").exists() or not [n for n in os.listdir(tmp_path / "out") if n.startswith("iter_")]


def test_the_args_object_is_bounded_inside_its_distcp_file(tmp_path):
    """fsdp_dtensor's `args` inside a .distcp: a DEFLATEd pickle of 300 MiB in 0.3 MB (bug 7)."""
    folder = fx.write(tmp_path)
    fx.replace_object(folder, "args", bomb(300 * 2**20))
    _refused(lambda: _convert(folder, tmp_path / "out"), "'args'", "refused before inflating")


def test_a_flag_after_the_separator_overrides_the_stored_value_it_is_checked_against(tmp_path):
    """The user's own flags are the user's: a stored num_layers 100000 corrected by
    `-- --num-layers 2` converts; a wrong flag is named by the model built from it."""
    folder = fx.write(tmp_path, args=fx.stored_args(num_layers=100000))
    assert _convert_with(folder, tmp_path / "out", ["--num-layers", "2"])["iteration"] == fx.ITERATION
    assert inspection.verify(str(tmp_path / "out")) == []


def _convert_with(folder, out, extra):
    return fsdp_dtensor.convert(str(folder), str(out), extra_argv=extra, progress=False)


def test_a_common_pt_that_is_not_a_dict_is_named(tmp_path):
    folder = _torch_dist_folder(tmp_path)
    torch.save([1, 2], folder / "common.pt")
    _refused(lambda: torch_dist_plan.plan_conversion(str(folder)), str(folder / "common.pt"), "holds list")


MODELS = {
    "dense": [],
    "moe": ["--num-experts", "4", "--moe-ffn-hidden-size", "16"],
    "moe_pattern": ["--num-experts", "4", "--moe-layer-freq", "2"],
    "pipeline_split": ["--pipeline-model-parallel-size", "1", "--num-experts", "2", "--moe-layer-freq", "[0,1,1,0]"],
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_stored_counts_of_megatrons_own_keys(model):
    """The counts read from the keys megatron itself gives a model: its torch_dist keys and
    global shapes (sharded_state_dict, stacked or per layer) and its module paths (what
    fsdp_dtensor stores), for dense, MoE and MoE patterns. (The converters' meta model has no
    MTP layers; `mtp.layers.<i>.` keys are read in test_stored_counts_read_every_key_style.)"""
    from megatron_ucp.convert.source_model import meta_model, single_process_megatron, source_args
    from megatron_ucp.convert.torch_dist_plan import _sharded_by_tensor

    argv = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--vocab-size", "250", "--untie-embeddings-and-output-weights"] + MODELS[model]
    source = source_args(argv + ["--cpu", "--mock-data"], 1)
    with single_process_megatron():
        gpt = meta_model(source, 256)
        dist_keys = {st.key: tuple(st.global_shape) for sts in _sharded_by_tensor(gpt).values() for st in sts}
        paths = {path: tuple(p.shape) for path, p in gpt.named_parameters()}
    want = {"num_layers": 4, "num_experts": source.num_experts}
    for shapes in (dist_keys, paths):
        found = saved_args.stored_counts(shapes)
        assert {k: found[k] for k in want} == want, sorted(shapes)[:8]
        saved_args.against_tensors(vars(source), shapes, "f")  # its own arguments fit
