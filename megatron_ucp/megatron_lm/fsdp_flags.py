"""`--ckpt-format universal` for fully sharded runs: Megatron-LM's argument checks name the
checkpoint formats it can write FSDP state in (in 0.19.2: torch FSDP2 wants torch_dist or
torch_dcp, `arguments.py:1008`; Megatron-FSDP wants fsdp_dtensor, 1146). A universal checkpoint
holds the consolidated tensors those formats are cut from, so for fully sharded runs the checks
see the format they name and the run keeps universal.

Also a warning where Megatron-FSDP is known to train differently from DDP (`one_rank_groups`)."""

import functools
import importlib

UNIVERSAL = "universal"


def _checked_as(args):
    """The format megatron's checks want for this run's FSDP flavour, or None (not sharded)."""
    if getattr(args, "use_megatron_fsdp", False):
        return "fsdp_dtensor"
    return "torch_dist" if getattr(args, "use_torch_fsdp2", False) else None


def one_rank_groups(args) -> list:
    """The gradient groups Megatron-FSDP mis-accumulates in this run: groups of one data-parallel
    rank (the experts' when EP = DP, all when DP = 1), reduced at every microbatch
    (`optim_grads`, `optim_grads_params`) of a step that has several. megatron-core 0.19.2 scales
    such a group's unsharded buffer, which already holds the earlier microbatches' gradients, at
    every microbatch (megatron_fsdp/param_and_grad_buffer.py:4746-4751), so early microbatches
    count less; NVIDIA/Megatron-LM#6660 reports the same family of bug on GPUs."""
    if not getattr(args, "use_megatron_fsdp", False) or getattr(
            args, "data_parallel_sharding_strategy", None) not in ("optim_grads", "optim_grads_params"):
        return []
    if args.global_batch_size <= args.micro_batch_size * args.data_parallel_size:
        return []  # one microbatch per step: nothing accumulates
    groups = []
    if args.data_parallel_size * args.context_parallel_size == 1:
        groups.append("data-parallel")
    if getattr(args, "num_experts", None):
        expert_tp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
        expert_dp = args.world_size // (args.pipeline_model_parallel_size * args.expert_model_parallel_size
                                        * expert_tp)
        if expert_dp == 1:
            groups.append("expert data-parallel")
    return groups


def _warn_one_rank_groups(args) -> None:
    groups = one_rank_groups(args)
    if groups and getattr(args, "rank", 0) == 0:
        print(f" megatron-ucp: warning: Megatron-FSDP under --data-parallel-sharding-strategy "
              f"{args.data_parallel_sharding_strategy} mis-accumulates gradients over the microbatches "
              f"of a step where a gradient group has one rank (here the {' and '.join(groups)} group): "
              "megatron-core scales the accumulated gradients at every microbatch "
              "(NVIDIA/Megatron-LM#6660), so this run's losses differ from the same run under DDP. "
              "--data-parallel-sharding-strategy optim, or one microbatch per step, trains as DDP does.",
              flush=True)


def validating_as_torch_dist(original):
    """`original` (arguments.validate_args) with a universal FSDP run checked as its format."""

    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        checked_as = _checked_as(args)
        if getattr(args, "ckpt_format", None) != UNIVERSAL or checked_as is None:
            result = original(args, *rest, **kwargs)
        else:
            args.ckpt_format = checked_as
            try:
                result = original(args, *rest, **kwargs)
            finally:
                args.ckpt_format = UNIVERSAL
        _warn_one_rank_groups(args)
        return result

    return validate_args


def install() -> None:
    from megatron_ucp.megatron_lm.patching import replace_everywhere

    arguments = importlib.import_module("megatron.training.arguments")
    replace_everywhere(arguments.validate_args, validating_as_torch_dist(arguments.validate_args))
