"""The source model a converter builds, shared by the converters so that they need not import
each other: the training arguments a checkpoint stores turned back into flags
(`argv_from_args`), the arguments a command line sets (`given_args`, `legacy_overrides`), a
validated namespace (`source_args`), and the whole model on the meta device in one process
(`single_process_megatron`, `meta_model`).

It builds them with Megatron-LM's flags (mcore/flags.py) and the model builder (mcore/model.py),
the same the training application uses.
"""

import argparse
import contextlib
import copy

from megatron_ucp.errors import ConfigError, FormatError

# Arguments that describe where checkpoints go, not the model or the layout.
_NOT_CARRIED = {"save", "load", "save_interval", "loss_log", "ckpt_step", "load_universal",
                "ckpt_format", "exit_interval", "keep_last", "async_save", "cpu", "world_size",
                "data_parallel_size", "num_microbatches", "padded_vocab_size",
                "virtual_pipeline_model_parallel_size", "no_verify_checkpoint", "no_strict_load", "finetune",
                "ckpt_read_policy"}


# Megatron-LM's names of the own loop's model arguments (its checkpoints store its own).
_MEGATRON_LM_NAMES = {"layernorm_epsilon": ("norm_epsilon", lambda v: v),
                      "add_bias_linear": ("disable_bias_linear", lambda v: not v)}


def _own_loop_names(args: dict) -> dict:
    """`args` with Megatron-LM's names of the own loop's arguments added under the own loop's."""
    out = dict(args)
    for theirs, (ours, value) in _MEGATRON_LM_NAMES.items():
        if theirs in args and ours not in args and args[theirs] is not None:
            out[ours] = value(args[theirs])
    return out


def argv_from_args(args: dict, only=None) -> list:
    """Command-line flags that rebuild the model and layout the arguments describe (of the
    argument names in `only`, when given); the own loop's arguments or Megatron-LM's."""
    from megatron_ucp.mcore.flags import build_parser

    args = _own_loop_names(args)
    argv = []
    for action in build_parser()._actions:
        dest = action.dest
        if dest in _NOT_CARRIED or dest not in args or not action.option_strings:
            continue
        if only is not None and dest not in only:
            continue
        value, flag = args[dest], action.option_strings[0]
        if action.nargs == 0:  # store_true, or store_false (--no-store-param-remainders)
            if value == action.const:
                argv.append(flag)
        elif dest == "vocab_size" and args.get("eod_token") is not None:
            argv += [flag, str(args["eod_token"])]  # the flag's value: the NullTokenizer adds EOD
        elif isinstance(value, (list, tuple)) and action.nargs in ("+", "*"):  # --data-path W1 P1 W2 P2
            argv += [flag, *map(str, value)]
        elif isinstance(value, (list, tuple)):  # --moe-layer-freq's per-layer pattern, one word
            argv += [flag, str(list(value))]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def given_args(argv: list) -> dict:
    """The arguments `argv` sets, by name (defaults left out: --use-checkpoint-args takes only these)."""
    from megatron_ucp.mcore.flags import build_parser

    return _given(build_parser(), argv)


def legacy_overrides(extra_argv) -> dict:
    """Flags after '--' for a legacy checkpoint: only those given, by argument name."""
    from megatron_ucp.mcore.flags import build_parser

    p = build_parser()
    p.add_argument("--consumed-train-samples", type=int)
    p.add_argument("--data-parallel-size", type=int)
    p.add_argument("--ddp-bucket-size", type=int)
    return _given(p, list(extra_argv))


def _given(parser, argv: list) -> dict:
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return vars(parser.parse_args(argv))


# The argument groups of mcore/flags.py that describe the model and its layout: what a meta
# model is built from.
MODEL_GROUPS = ("model", "multi-latent attention", "multi-token prediction", "mixture of experts", "parallelism")


def model_arg_names() -> set:
    """The arguments of MODEL_GROUPS (the own loop's flags; Megatron-LM's others, its dtypes,
    data and schedule, are its own parser's and only carried into a manifest)."""
    from megatron_ucp.mcore.flags import build_parser

    groups = [g for g in build_parser()._action_groups if g.title in MODEL_GROUPS]
    return {a.dest for g in groups for a in g._group_actions}


def typed_stored_args(stored: dict, origin: str) -> None:
    """The stored model arguments have the types and ranges their flags parse to, before any is
    turned into a flag (argparse would take "2" or 2.0 for an int, nan for a float) or sizes
    anything (mcore/saved_args.py, as --use-checkpoint-args takes them). A null is left to the
    flag's default, as argv_from_args does."""
    from megatron_ucp.mcore import saved_args
    from megatron_ucp.mcore.flags import build_parser

    present = {k: v for k, v in _own_loop_names(stored).items() if v is not None}
    saved_args.typed(present, model_arg_names(), build_parser(), origin)


MAX_WORLD = 2**24  # processes of one job, with room to spare


def stored_world(stored: dict, origin: str) -> int:
    """The source run's world size from its stored arguments (0: not stored)."""
    world = stored.get("world_size")
    if world is None:
        return 0
    if type(world) is not int or not 1 <= world <= MAX_WORLD:
        raise FormatError(f"{origin}: 'args.world_size' is {world!r:.60}, expected an integer 1..{MAX_WORLD}")
    return world


def checked_source(source, shapes: dict, origin: str, extra_argv=()) -> None:
    """The parsed source arguments agree with the checkpoint's tensors ({key: shape}, from its
    `.metadata`) before a meta model is built from them: a stored num_layers of 100000 beside
    two layers of tensors is refused in milliseconds, not after minutes and GBs of building.
    The flags given after '--' (`extra_argv`) are the user's own: the model built from them
    says where they do not fit."""
    from megatron_ucp.mcore import saved_args

    given = given_args(list(extra_argv))
    saved_args.against_tensors({k: v for k, v in vars(source).items() if k not in given}, shapes, origin)


def source_args(argv: list, world: int, origin: str = "the stored arguments"):
    """The namespace `argv` gives pretrain_gpt_ucp.py, validated for a world of `world` processes.
    A value it cannot read is one line naming `origin` (the file the arguments came from), not
    argparse's usage and exit."""
    from megatron_ucp.mcore.flag_validation import validate
    from megatron_ucp.mcore.flags import build_parser

    parser = build_parser()

    def refuse(message):
        raise FormatError(f"{origin}: {message} (a stored argument, or a flag after '--')")

    parser.error = refuse
    source = parser.parse_args(argv)
    validate(source, world)
    return source


@contextlib.contextmanager
def single_process_megatron():
    """megatron's parallel state for one process (TP = PP = EP = 1), torn down afterwards."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ucp.mcore import compat, cpu_mode

    if dist.is_initialized():
        raise ConfigError("the torch_dist converter runs outside a torch.distributed job")
    cpu_mode.enable()
    compat.apply()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def meta_model(source, padded_vocab: int):
    """The whole model (one stage, no parallelism) on the meta device: names, shapes, keys."""
    import torch
    from megatron.core.models.gpt import GPTModel

    from megatron_ucp.mcore import model as model_lib

    a = copy.copy(source)
    a.tensor_model_parallel_size = a.pipeline_model_parallel_size = 1
    a.expert_model_parallel_size, a.expert_tensor_parallel_size = 1, 1
    a.virtual_pipeline_model_parallel_size = None
    a.sequence_parallel = False
    config = model_lib.transformer_config(a)
    with torch.device("meta"):
        return GPTModel(
            config=config, transformer_layer_spec=model_lib.layer_spec(a, config, None), vocab_size=padded_vocab,
            max_sequence_length=a.max_position_embeddings, pre_process=True, post_process=True,
            share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
            position_embedding_type=a.position_embedding_type, rotary_base=a.rotary_base)
