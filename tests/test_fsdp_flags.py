"""Which Megatron-FSDP runs the plug-in warns about: gradient groups of one rank, reduced at every
microbatch of a step that accumulates (megatron_lm/fsdp_flags.one_rank_groups). The warning's
ground: on CPU, MoE on EP2 over 2 processes (expert data-parallel size 1), 2 microbatches per
step, Megatron-FSDP's losses left DDP's from iteration 2; under `optim`, or with one microbatch
per step, they equal DDP's exactly (docs/megatron_lm.md)."""

from types import SimpleNamespace

import pytest

from megatron_ucp.megatron_lm.fsdp_flags import one_rank_groups


def run_args(world=2, tp=1, pp=1, cp=1, ep=1, experts=None, global_batch=8, micro_batch=2,
             strategy="optim_grads_params", fsdp=True):
    return SimpleNamespace(
        use_megatron_fsdp=fsdp, data_parallel_sharding_strategy=strategy, world_size=world,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        data_parallel_size=world // (tp * pp * cp), expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp, num_experts=experts, global_batch_size=global_batch,
        micro_batch_size=micro_batch)


@pytest.mark.parametrize("args, groups", [
    (run_args(ep=2, experts=4), ["expert data-parallel"]),  # EP = DP, 2 microbatches
    (run_args(ep=2, experts=4, strategy="optim_grads"), ["expert data-parallel"]),
    (run_args(world=1, experts=4), ["data-parallel", "expert data-parallel"]),
    (run_args(world=1), ["data-parallel"]),
    (run_args(world=2, tp=2, global_batch=4), ["data-parallel"]),
    (run_args(ep=2, experts=4, global_batch=4), []),  # one microbatch per step
    (run_args(ep=2, experts=4, strategy="optim"), []),  # reduced once, at the last microbatch
    (run_args(ep=2, experts=4, strategy="no_shard"), []),
    (run_args(world=4, ep=2, experts=4), []),  # expert data-parallel size 2
    (run_args(world=2, cp=2, global_batch=4), []),  # DP 1 but CP 2: the group is data x context
    (run_args(ep=2, experts=4, fsdp=False), []),  # DDP
])
def test_one_rank_groups(args, groups):
    assert one_rank_groups(args) == groups
