"""The local checkpoint tier in Megatron-LM's trainer: Megatron-LM's flags for its own local
checkpoints select the project's tier (engine/local_tier.py, docs/elastic.md "The local tier")
when the job saves universal checkpoints:

    --ckpt-format universal --non-persistent-ckpt-type local
    --non-persistent-local-ckpt-dir DIR --non-persistent-save-interval N
    [--replication --replication-factor F]   # F - 1 replicas on other nodes (Megatron-LM's meaning)

Megatron-LM's own local checkpoints (nvidia-resiliency-ext's manager) are tied to the layout
that wrote them; these reshard: a job that lost a node restores them on the nodes that are left.
The trainer calls save_checkpoint(non_persistent_ckpt=True) every N iterations (checkpoint.py
sends it here), and load_checkpoint restores the newest sound local iteration when it is newer
than --load's checkpoint, else the persistent one loads.
"""

import types

from megatron_ucp.errors import ConfigError
from megatron_ucp.mcore.flag_validation import check_tier_apart

_TIER = {}


def adopt(args) -> None:
    """After parsing: take Megatron-LM's local-checkpoint flags for the project's tier, and turn
    Megatron-LM's own local checkpointing off (it would need nvidia-resiliency-ext's manager)."""
    args.local_ckpt_dir = None
    if getattr(args, "non_persistent_ckpt_type", None) != "local" or args.ckpt_format != "universal":
        return
    if not args.non_persistent_local_ckpt_dir:
        raise ConfigError("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir (a "
                          "node-local folder: /dev/shm or a local disk)")
    if not args.non_persistent_save_interval:
        raise ConfigError("--non-persistent-ckpt-type local needs --non-persistent-save-interval N")
    check_tier_apart(getattr(args, "save", None), args.non_persistent_local_ckpt_dir,
                     "--non-persistent-local-ckpt-dir")
    args.local_ckpt_dir = args.non_persistent_local_ckpt_dir
    args.local_save_interval = args.non_persistent_save_interval
    args.local_ckpt_replicas = args.replication_factor - 1 if getattr(args, "replication", False) else 0
    args.non_persistent_ckpt_type = None
    args.replication, args.replication_jump = False, None


def engine_args(args, vocab_size: int):
    """The trainer's arguments under the names the engine's tier reads (the own loop's);
    `vocab_size`: the tokenizer's (checkpoint.true_vocab_size)."""
    view = types.SimpleNamespace(**vars(args))
    view.vocab_size = vocab_size
    view.no_load_scheduler = args.no_load_optim  # Megatron-LM: no optimizer, no scheduler either
    return view


def _state(model, optimizer, scheduler, progress=None):
    return types.SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler,
                                 progress=progress or {})


def tier(args, vocab_size, model, optimizer, scheduler):
    """The job's tier (opened once, collectively, with a check of each node's free space)."""
    if "tier" not in _TIER:
        from megatron_ucp.engine.local_tier import open_tier

        _TIER["tier"] = open_tier(engine_args(args, vocab_size), _state(model, optimizer, scheduler))
    return _TIER["tier"]


def save(args, vocab_size, iteration, model, optimizer, scheduler, progress) -> None:
    """A local save: this rank's piece copied now, written and replicated in the background."""
    import time

    import torch.distributed as dist

    start = time.perf_counter()
    t = tier(args, vocab_size, model, optimizer, scheduler)
    t.save(engine_args(args, vocab_size), _state(model, optimizer, scheduler, progress), iteration,
           args.consumed_train_samples)
    if dist.get_rank() == 0:
        print(f" local save at iteration {iteration:8d} started ({time.perf_counter() - start:.3f} s "
              "stall)", flush=True)


def restore(args, vocab_size, model, optimizer, scheduler, newer_than: int, reseed):
    """The engine's LoadResult of the newest sound local iteration newer than `newer_than`, or
    None (after one line saying why, when the tier held something) for the persistent tier."""
    from megatron_ucp.engine import local_restore

    t = tier(args, vocab_size, model, optimizer, scheduler)
    return local_restore.restore(t, engine_args(args, vocab_size), _state(model, optimizer, scheduler),
                                 newer_than, reseed)


def install() -> None:
    """Take the flags in `validate_args`, before megatron's own checks of them (0.19.2
    arguments.py:399 and 1813-1817 want nvidia-resiliency-ext for a local type, and
    training.py:1193 builds its LocalCheckpointManager from the same flag)."""
    import functools
    import importlib

    from megatron_ucp.megatron_lm.patching import replace_everywhere

    arguments = importlib.import_module("megatron.training.arguments")
    original = arguments.validate_args

    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        adopt(args)
        return original(args, *rest, **kwargs)

    replace_everywhere(original, validate_args)


def wait() -> None:
    """The local save in flight, finished (before exit)."""
    if "tier" in _TIER:
        _TIER["tier"].wait()
