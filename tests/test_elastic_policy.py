"""The elastic layout policy (megatron_ucp/mcore/elastic.py), held to args.validate over many worlds and models."""

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.mcore import elastic
from megatron_ucp.errors import ConfigError
from megatron_ucp.mcore.flag_validation import validate
from megatron_ucp.mcore.flags import build_parser


@st.composite
def runs(draw):
    """(argv, world size) of a random model and requested layout, most of them valid somewhere."""
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4, 8, 16) if heads % g == 0]))
    layers = draw(st.integers(1, 24))
    micro = draw(st.sampled_from([1, 2, 4]))
    global_batch = micro * draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64]))
    tp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    pp = draw(st.sampled_from([1, 2, 3, 4, 6]))
    argv = ["--mock-data", "--num-layers", str(layers), "--num-attention-heads", str(heads),
            "--hidden-size", str(8 * heads), "--seq-length", str(draw(st.sampled_from([8, 12, 16]))),
            "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch),
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if groups != heads:
        argv += ["--group-query-attention", "--num-query-groups", str(groups)]
    if draw(st.booleans()):
        argv += ["--sequence-parallel"]
    if pp > 1 and draw(st.booleans()):
        argv += ["--num-layers-per-virtual-pipeline-stage", str(draw(st.integers(1, 4)))]
    if draw(st.integers(0, 3)) == 0:
        experts = draw(st.sampled_from([2, 4, 6, 8]))
        argv += ["--num-experts", str(experts), "--moe-router-topk", "1",
                 "--expert-model-parallel-size", str(draw(st.sampled_from([1, 2, 4, 8])))]
        if draw(st.booleans()):
            argv += ["--disable-bias-linear"]
        if draw(st.booleans()):
            argv += ["--expert-tensor-parallel-size", str(draw(st.sampled_from([1, 2])))]
    return argv, draw(st.integers(1, 96))


def parsed(argv):
    return build_parser().parse_args(argv)


def passes_validate(args, world) -> bool:
    try:
        validate(copy.deepcopy(args), world)
        return True
    except ConfigError:
        return False


def choose(args, world):
    return elastic.choose_layout(world, elastic.dims_from_args(args), elastic.layout_from_args(args),
                                 elastic.Batch(args.micro_batch_size, args.global_batch_size))


def with_layout(args, layout):
    out = copy.deepcopy(args)
    elastic.apply_to_args(out, elastic.Choice(0, layout, 0, 0, layout))
    return out


@settings(max_examples=250, deadline=None)
@given(runs())
def test_policy_matches_validate(run):
    argv, world = run
    args = parsed(argv)
    requested = elastic.layout_from_args(args)
    try:
        choice = choose(args, world)
    except ConfigError as e:
        # Complete: no candidate the policy may take (TP, PP, EP, expert TP <= requested) validates.
        assert "\n" not in str(e)
        for lay in elastic._candidates(requested):
            assert not passes_validate(with_layout(args, lay), world), (lay, str(e))
        return
    lay = choice.layout
    # The chosen layout validates, uses every rank and keeps the global batch.
    chosen = with_layout(args, lay)
    assert passes_validate(chosen, world), lay
    done = validate(chosen, world)
    assert lay.tp * lay.pp * choice.dp == world
    assert done.data_parallel_size == choice.dp
    assert done.micro_batch_size * done.num_microbatches * choice.dp == args.global_batch_size
    assert done.num_microbatches == choice.num_microbatches
    # Nothing grows; divisibility holds.
    assert lay.tp <= requested.tp and lay.pp <= requested.pp and lay.ep <= requested.ep
    assert args.num_attention_heads % lay.tp == 0 and args.num_layers % lay.pp == 0
    # The requested layout is kept whenever it validates on this world size.
    if passes_validate(args, world):
        assert choice.kept and lay == requested
    # TP and PP are kept whenever some candidate with them fits.
    keeps = [c for c in elastic._candidates(requested) if (c.tp, c.pp) == (requested.tp, requested.pp)]
    if any(passes_validate(with_layout(args, c), world) for c in keeps):
        assert (lay.tp, lay.pp) == (requested.tp, requested.pp)
    # Otherwise PP shrinks before TP: no candidate with a larger TP validates.
    for c in elastic._candidates(requested):
        if c.tp > lay.tp or (c.tp == lay.tp and c.pp > lay.pp):
            assert not passes_validate(with_layout(args, c), world), (c, lay)
    # Deterministic.
    assert choose(parsed(argv), world) == choice


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16), st.integers(1, 64))
def test_dp_absorbs_the_world_size(nodes_requested, world):
    """A dense model with TP2 PP2: any multiple of 4 keeps both; DP = world / 4."""
    args = parsed(["--mock-data", "--num-layers", "8", "--num-attention-heads", "8", "--hidden-size", "64",
                   "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                   "--micro-batch-size", "1", "--global-batch-size", str(64 * nodes_requested)])
    if world % 4 == 0 and (64 * nodes_requested) % (world // 4) == 0:
        choice = choose(args, world)
        assert (choice.layout.tp, choice.layout.pp, choice.dp) == (2, 2, world // 4)


def test_shrinks_pp_before_tp():
    args = parsed(["--mock-data", "--num-layers", "4", "--num-attention-heads", "4", "--hidden-size", "32",
                   "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                   "--micro-batch-size", "2", "--global-batch-size", "8"])
    assert choose(args, 8).layout.describe(choose(args, 8).dp) == "TP2 PP2 DP2"
    assert choose(args, 4).num_microbatches == 4
    two = choose(args, 2)
    assert (two.layout.tp, two.layout.pp, two.dp, two.num_microbatches) == (2, 1, 1, 4)
    one = choose(args, 1)
    assert (one.layout.tp, one.layout.pp, one.dp, one.num_microbatches) == (1, 1, 1, 4)
    assert not one.kept
    assert "micro-batches" in elastic.summary(one) and "\n" not in elastic.summary(one)


def test_virtual_pipeline_dropped_when_pp_shrinks():
    args = parsed(["--mock-data", "--num-layers", "8", "--num-attention-heads", "4", "--hidden-size", "32",
                   "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
                   "--micro-batch-size", "1", "--global-batch-size", "8"])
    assert choose(args, 4).layout.vpp_layers == 1
    two = choose(args, 2)  # PP 2 x DP 1 -> 8 micro-batches, 4 layers a stage: VPP still fits
    assert (two.layout.pp, two.layout.vpp_layers) == (2, 1)
    assert choose(args, 1).layout.vpp_layers is None


def test_one_virtual_stage_per_stage_has_no_micro_batch_rule():
    """Found by the property test: 1 layer per virtual stage with 1 layer per stage is no
    interleaving, so 1 micro-batch on PP2 is fine, and the request is kept as it is."""
    args = parsed(["--mock-data", "--num-layers", "2", "--num-attention-heads", "1", "--hidden-size", "8",
                   "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "1",
                   "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"])
    choice = choose(args, 2)
    assert choice.kept and choice.layout.vpp_layers == 1


def test_experts_shrink_ep():
    args = parsed(["--mock-data", "--num-layers", "2", "--num-attention-heads", "4", "--hidden-size", "32",
                   "--num-experts", "4", "--expert-model-parallel-size", "4", "--micro-batch-size", "1",
                   "--global-batch-size", "8"])
    assert choose(args, 4).layout.ep == 4
    assert choose(args, 2).layout.ep == 2
    assert choose(args, 1).layout.ep == 1


def _with_context_parallelism(world, tp=2, pp=2, cp=2, seq_length=16, global_batch=16):
    """Megatron-LM's trainer's layouts (the own loop's parser has no CP): pure policy."""
    dims = elastic.ModelDims(num_layers=4, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=64,
                             seq_length=seq_length)
    return elastic.choose_layout(world, dims, elastic.Layout(tp=tp, pp=pp, cp=cp), elastic.Batch(1, global_batch))


def test_context_parallelism_is_kept_while_it_fits_and_shrinks_last():
    described = {w: _with_context_parallelism(w).layout.describe(_with_context_parallelism(w).dp)
                 for w in (16, 8, 4, 2, 1)}
    assert described == {16: "TP2 PP2 CP2 DP2", 8: "TP2 PP2 CP2 DP1", 4: "TP2 PP1 CP2 DP1",
                         2: "TP1 PP1 CP2 DP1", 1: "TP1 PP1 DP1"}
    assert _with_context_parallelism(6, global_batch=24).layout.describe(3) == "TP1 PP1 CP2 DP3"
    with pytest.raises(ConfigError, match=r"CP <= 2 fits world size 6.*TP x PP x CP x DP"):
        _with_context_parallelism(6)


def test_context_parallelism_needs_the_sequence_to_be_a_multiple_of_2cp():
    """megatron's rule (arguments.py:1295 in 0.19.2): CP4 on 12 tokens does not fit; CP2 does."""
    choice = _with_context_parallelism(4, tp=1, pp=1, cp=4, seq_length=12)
    assert (choice.layout.cp, choice.dp) == (2, 2)
    assert "2 x CP" in elastic._shrink_reason(4, elastic.ModelDims(4, 4, 4, 64, 12), elastic.Layout(cp=4),
                                              elastic.Batch(1, 16))


def test_context_parallelism_is_written_into_the_trainers_arguments():
    import argparse

    args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                              context_parallel_size=2, expert_model_parallel_size=1,
                              expert_tensor_parallel_size=None, num_layers_per_virtual_pipeline_stage=None)
    requested = elastic.layout_from_args(args)
    assert requested.cp == 2
    elastic.apply_to_args(args, _with_context_parallelism(2))
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size) == (1, 1, 2)
    assert elastic.saved_description({"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                                      "context_parallel_size": 2, "data_parallel_size": 1,
                                      "world_size": 2}) == "TP1 PP1 DP1 CP2 on 2 ranks"


def test_no_layout_fits_names_the_world_size():
    args = parsed(["--mock-data", "--num-layers", "4", "--num-attention-heads", "4", "--hidden-size", "32",
                   "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "8"])
    with pytest.raises(ConfigError, match="world size 6") as e:
        choose(args, 6)
    assert "global batch" in str(e.value) and "\n" not in str(e.value)


def test_latest_checkpoint_found_or_none(tmp_path):
    """What --elastic resumes: nothing yet (start fresh), a universal checkpoint, or a clear error."""
    from megatron_ucp.errors import FormatError, IncompleteCheckpointError
    from megatron_ucp.format.durability import atomic_write_json
    from megatron_ucp.format.folder import write_tracker
    from megatron_ucp.train.checkpointing import latest_checkpoint

    args = parsed(["--mock-data", "--load", str(tmp_path / "ckpt")])
    assert latest_checkpoint(args) is None  # no folder yet
    (tmp_path / "ckpt").mkdir()
    assert latest_checkpoint(args) is None  # no tracker yet
    write_tracker(str(tmp_path / "ckpt"), 8)
    with pytest.raises(IncompleteCheckpointError, match="iter_0000008"):
        latest_checkpoint(args)
    (tmp_path / "ckpt" / "iter_0000008").mkdir()
    with pytest.raises(FormatError, match="megatron-ucp convert"):
        latest_checkpoint(args)
    layout = {"world_size": 4, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
              "virtual_pipeline_model_parallel_size": None, "data_parallel_size": 2,
              "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 2,
              "use_distributed_optimizer": True}
    from test_inspect import ARCHITECTURE  # read_manifest needs complete blocks

    atomic_write_json(str(tmp_path / "ckpt" / "iter_0000008" / "ucp.json"),
                      {"format": "megatron-ucp", "version": 1, "iteration": 8, "consumed_samples": 64,
                       "tensors": {}, "architecture": ARCHITECTURE, "layout": layout})
    iteration, directory, saved = latest_checkpoint(args)
    assert (iteration, saved) == (8, layout) and directory.endswith("iter_0000008")
    assert elastic.saved_description(saved) == "TP2 PP1 DP2 on 4 ranks"
