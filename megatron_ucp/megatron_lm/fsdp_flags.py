"""`--ckpt-format universal` for fully sharded runs: Megatron-LM's argument checks name the
checkpoint formats it can write FSDP state in (`arguments.py:1008` in 0.19.2: torch FSDP2 wants
torch_dist or torch_dcp). A universal checkpoint holds the consolidated tensors those formats
are cut from, so for fully sharded runs the checks see torch_dist and the run keeps universal."""

import functools
import importlib

UNIVERSAL = "universal"


def _fully_sharded(args) -> bool:
    return bool(getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False))


def validating_as_torch_dist(original):
    """`original` (arguments.validate_args) with a universal FSDP run checked as torch_dist."""

    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        if getattr(args, "ckpt_format", None) != UNIVERSAL or not _fully_sharded(args):
            return original(args, *rest, **kwargs)
        args.ckpt_format = "torch_dist"
        try:
            return original(args, *rest, **kwargs)
        finally:
            args.ckpt_format = UNIVERSAL

    return validate_args


def install() -> None:
    from megatron_ucp.megatron_lm.patching import replace_everywhere

    arguments = importlib.import_module("megatron.training.arguments")
    replace_everywhere(arguments.validate_args, validating_as_torch_dist(arguments.validate_args))
