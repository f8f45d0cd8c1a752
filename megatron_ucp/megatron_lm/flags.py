"""The trainer's parser with universal checkpoints: `--ckpt-format universal` and the project's
own flags, added through the extra-arguments provider that every release's
`parse_args(extra_args_provider, ignore_unknown_args)` takes, so that the re-parses of fault
tolerance and in-job restart (`arguments.parse_args(ignore_unknown_args=True)`) see them too.

The project's flags: the checkpoint flags of both loops (mcore/ucp_flags.py), `--load-universal`
(megatron_lm/checkpoint.py), `--elastic`
(megatron_lm/elastic.py), `--loss-log` (megatron_lm/loss_log.py) and `--cpu`, which the entry
points read from the command line before megatron is imported (megatron_lm/__main__.py)."""

import functools
import importlib

from megatron_ucp.mcore.ucp_flags import add_universal_flags

UNIVERSAL = "universal"

# --cpu: what CPU processes lack, as defaults (a flag on the command line still wins): TE's
# layers, apex's and TE's fused kernels, NCCL (and its PREMUL_SUM, which Megatron-FSDP's
# gradient reduction fuses its division into by default). Listed in the README beside the own loop's defaults.
CPU_DEFAULTS = dict(distributed_backend="gloo", transformer_impl="local",
                    gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                    bias_gelu_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                    no_persist_layer_norm=True, gradient_reduce_div_fusion=False)


def add_arguments(parser, cpu: bool = False):
    """Megatron-LM's parser, extended: an extra-arguments provider."""
    for action in parser._actions:
        if action.dest == "ckpt_format" and action.choices is not None and UNIVERSAL not in action.choices:
            action.choices = list(action.choices) + [UNIVERSAL]
            action.help = (action.help or "") + f" {UNIVERSAL}: megatron-ucp's universal checkpoints, " \
                "resumable on any parallel layout"
    group = parser.add_argument_group("megatron-ucp")
    add_universal_flags(group)
    group.add_argument("--load-universal", action="store_true",
                       help="the checkpoint --load (and --ckpt-step) designates must be a universal "
                            "one (any layout); a folder of another format is an error naming it, "
                            "never a load in that format (the own loop's flag, the same meaning)")
    group.add_argument("--elastic", action="store_true",
                       help="fit the layout to the world size before the parallel state is built "
                            "(keep TP/PP where they fit, DP absorbs the change, else shrink PP then "
                            "TP; global batch kept) and resume the latest checkpoint in --load "
                            "(docs/elastic.md)")
    group.add_argument("--loss-log", default=None,
                       help="append one JSON line per iteration here: its loss over the global "
                            "batch and the learning rate its update used")
    group.add_argument("--cpu", action="store_true",
                       help="train on CPU processes over gloo, with the local layer spec and no "
                            "fused kernels by default (read from the command line at start)")
    if cpu:
        parser.set_defaults(**CPU_DEFAULTS)
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
