"""The --save folder or prefix given up at a clean end of Megatron-LM's training, as the own
loop gives it up (train/checkpointing.release_save_folder): the owner record the universal saves
took (engine/ownership.py for a folder, engine/store_owner.py for an object store) is removed,
so that the next job, on any host, need not wait an hour for it to count as stale.

A clean end is `pretrain` (0.19.2 training.py:1014) returning, or its `sys.exit(0)` after
--exit-interval, --exit-duration-in-mins or --exit-signal-handler (training.py:4155, every rank
together); an error leaves the record (the job's other ranks may still be writing).
"""

import functools
import importlib


def release_save(args) -> None:
    """Every rank at the end; rank 0 removes the record if this job still holds it."""
    import torch.distributed as dist

    from megatron_ucp.engine import ownership, store_owner
    from megatron_ucp.format import storage

    if not getattr(args, "save", None) or getattr(args, "ckpt_format", None) != "universal":
        return  # megatron's own formats take no record of ours
    if not dist.is_initialized():
        return
    dist.barrier()  # every rank is done with it
    if dist.get_rank() == 0:
        (store_owner.release if storage.is_remote(args.save) else ownership.release)(args.save)


def install() -> None:
    """Wrap `training.pretrain`, which training scripts import from megatron.training by name."""
    training = importlib.import_module("megatron.training.training")
    original = training.pretrain

    def release():
        try:
            args = importlib.import_module("megatron.training.global_vars").get_args()
        except AssertionError:  # no arguments parsed (--help's exit): nothing was saved
            return
        release_save(args)

    @functools.wraps(original)
    def pretrain(*args, **kwargs):
        try:
            result = original(*args, **kwargs)
        except SystemExit as e:
            if e.code in (None, 0):
                release()
            raise
        release()
        return result

    from megatron_ucp.megatron_lm.patching import replace_everywhere

    replace_everywhere(original, pretrain)
