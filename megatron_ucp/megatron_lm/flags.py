"""The trainer's parser with universal checkpoints: `--ckpt-format universal` and the project's
checkpoint flags (mcore/ucp_flags.py), added through the extra-arguments provider that every
release's `parse_args(extra_args_provider, ignore_unknown_args)` takes, so that the re-parses
of fault tolerance and in-job restart (`arguments.parse_args(ignore_unknown_args=True)`) see
them too."""

import functools
import importlib

from megatron_ucp.mcore.ucp_flags import add_universal_flags

UNIVERSAL = "universal"


def add_arguments(parser, cpu: bool = False):
    """Megatron-LM's parser, extended: an extra-arguments provider."""
    for action in parser._actions:
        if action.dest == "ckpt_format" and action.choices is not None and UNIVERSAL not in action.choices:
            action.choices = list(action.choices) + [UNIVERSAL]
            action.help = (action.help or "") + f" {UNIVERSAL}: megatron-ucp's universal checkpoints, " \
                "resumable on any parallel layout"
    add_universal_flags(parser.add_argument_group("universal checkpoints (megatron-ucp)"))
    if cpu:
        parser.set_defaults(distributed_backend="gloo")  # CPU processes: gloo, not NCCL
    return parser


def install(cpu: bool) -> None:
    arguments = importlib.import_module("megatron.training.arguments")
    original = arguments.parse_args

    @functools.wraps(original)
    def parse_args(extra_args_provider=None, ignore_unknown_args=False, *args, **kwargs):
        def provider(parser):
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return add_arguments(parser, cpu)

        return original(provider, ignore_unknown_args, *args, **kwargs)

    from megatron_ucp.megatron_lm.patching import replace_everywhere

    replace_everywhere(original, parse_args)
