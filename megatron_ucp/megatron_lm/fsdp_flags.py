"""`--ckpt-format universal` for fully sharded runs: Megatron-LM's argument checks name the
checkpoint formats it can write FSDP state in (in 0.19.2: torch FSDP2 wants torch_dist or
torch_dcp, `arguments.py:1008`; Megatron-FSDP wants fsdp_dtensor, 1146). A universal checkpoint
holds the consolidated tensors those formats are cut from, so for fully sharded runs the checks
see the format they name and the run keeps universal."""

import functools
import importlib

UNIVERSAL = "universal"


def _checked_as(args):
    """The format megatron's checks want for this run's FSDP flavour, or None (not sharded)."""
    if getattr(args, "use_megatron_fsdp", False):
        return "fsdp_dtensor"
    return "torch_dist" if getattr(args, "use_torch_fsdp2", False) else None


def validating_as_torch_dist(original):
    """`original` (arguments.validate_args) with a universal FSDP run checked as its format."""

    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        checked_as = _checked_as(args)
        if getattr(args, "ckpt_format", None) != UNIVERSAL or checked_as is None:
            return original(args, *rest, **kwargs)
        args.ckpt_format = checked_as
        try:
            return original(args, *rest, **kwargs)
        finally:
            args.ckpt_format = UNIVERSAL

    return validate_args


def install() -> None:
    from megatron_ucp.megatron_lm.patching import replace_everywhere

    arguments = importlib.import_module("megatron.training.arguments")
    replace_everywhere(arguments.validate_args, validating_as_torch_dist(arguments.validate_args))
