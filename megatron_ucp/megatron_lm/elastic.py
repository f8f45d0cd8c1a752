"""`--elastic` in Megatron-LM's trainer: the layout is chosen for the world size the job starts
with, before megatron validates the arguments and builds its parallel state.

The policy is the own loop's (mcore/elastic.py: keep TP/PP/CP where they fit and let DP absorb
the change, else shrink PP, then TP, then context parallelism; the global batch is kept). The checkpoint resumed is the latest
in `--load`, loaded universally on the new layout by the plug-in's load_checkpoint; a job with
none yet starts fresh, as megatron does.
"""

import functools
import importlib
import os

from megatron_ucp.errors import ConfigError, FormatError
from megatron_ucp.mcore import elastic


def _checkpoint_line(args) -> str | None:
    """What the job resumes, for the start-up line; a checkpoint of another format is an error
    (a new layout needs a universal one)."""
    from megatron_ucp.format.manifest import read_manifest
    from megatron_ucp.megatron_lm.checkpoint import found_format, universal_target

    if not args.load:
        return None
    target = universal_target(args.load, args.ckpt_step)
    if target is None:
        fmt = found_format(args.load, args.ckpt_step)
        if fmt is not None:
            raise FormatError(f"{args.load}: --elastic resumes universal checkpoints only, and this one "
                              f"is {fmt}; convert it with `megatron-ucp convert`")
        return f"nothing: no checkpoint in {args.load} yet"
    saved = read_manifest(target[1]).layout
    return f"iteration {target[0]} saved on {elastic.saved_description(saved)}"


def choose(args) -> elastic.Choice:
    """Write the layout for `args.world_size` into the (not yet validated) arguments."""
    if args.ckpt_format != "universal":
        raise ConfigError(f"--elastic resumes on whatever layout fits, which needs universal checkpoints: "
                          f"add --ckpt-format universal (got --ckpt-format {args.ckpt_format})")
    choice = elastic.choose_layout(args.world_size, elastic.dims_from_args(args),
                                   elastic.layout_from_args(args),
                                   elastic.Batch(args.micro_batch_size, args.global_batch_size))
    elastic.apply_to_args(args, choice)
    resuming = _checkpoint_line(args)
    if args.rank == 0:
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        print(f" {elastic.summary(choice, resuming)}" + (f" (torchrun restart {restarts})" if restarts else ""),
              flush=True)
        warning = elastic.shared_store_warning(os.environ)
        if warning:
            print(f" {warning}", flush=True)
    return choice


def install() -> None:
    """Choose the layout in `validate_args`, which every release calls before the parallel state
    exists (0.17.0 initialize.py:88 in initialize_megatron; 0.19.2 arguments.py:107 in
    parse_and_validate_args), after `--use-checkpoint-args`."""
    from megatron_ucp.megatron_lm.patching import replace_everywhere

    arguments = importlib.import_module("megatron.training.arguments")
    original = arguments.validate_args

    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        if getattr(args, "elastic", False):
            if args.global_batch_size is None:
                raise ConfigError("--elastic keeps the global batch over layouts: give --global-batch-size")
            choose(args)
        return original(args, *rest, **kwargs)

    replace_everywhere(original, validate_args)
