"""How training saves and resumes: the --save/--load flags, in any of the three formats.

The checkpoint folder itself (tracker, `iter_XXXXXXX/` folders) is megatron_ucp/format/folder.py."""

import argparse
import os
import time

import torch.distributed as dist

from megatron_ucp.engine.local_tier import tolerating_save_failure
from megatron_ucp.errors import FormatError, IncompleteCheckpointError
from megatron_ucp.format import storage, stores
from megatron_ucp.format.folder import TRACKER, iteration_dir, read_tracker, write_tracker
from megatron_ucp.mcore import saved_args
from megatron_ucp.mcore.flag_validation import keeps_saved_padding
from megatron_ucp.mcore.saved_args import CHECKPOINT_ARGS, use_checkpoint_args  # noqa: F401 (the loop's)


def claim_save_folder(args) -> None:
    """Rank 0 takes the --save folder's owner lock when the job starts, not at its first save:
    a second job is refused (on every rank) before it trains (ownership.py)."""
    from megatron_ucp.engine import ownership
    from megatron_ucp.engine.collective import run_everywhere

    if storage.is_remote(args.save):  # conditional writes in place of the flock
        from megatron_ucp.engine import store_owner
        run_everywhere(lambda: store_owner.claim(args.save) if dist.get_rank() == 0 else None)
        return
    run_everywhere(lambda: ownership.claim(args.save) if dist.get_rank() == 0 else None)


def release_save_folder(args) -> None:
    """Rank 0 gives the --save folder up at a clean end of training (ownership.release)."""
    from megatron_ucp.engine import ownership

    dist.barrier()  # every rank is done with the folder
    if dist.get_rank() == 0 and storage.is_remote(args.save):
        from megatron_ucp.engine import store_owner
        store_owner.release(args.save)
    elif dist.get_rank() == 0:
        ownership.release(args.save)


def finish_pending_save(state, args=None) -> None:
    """Wait for an asynchronous save still in flight (before the next one, and before exit)."""
    if state.pending_save is not None:
        pending, state.pending_save = state.pending_save, None
        tolerating_save_failure(args, pending.wait)


def save(args, state, iteration: int, consumed: int, sync: bool = False) -> None:
    """Save as the flags say; `sync` saves synchronously even with --async-save (an exit)."""
    finish_pending_save(state, args)
    tolerating_save_failure(args, lambda: _save(args, state, iteration, consumed, sync))


def _save(args, state, iteration: int, consumed: int, sync: bool) -> None:
    background = args.async_save and not sync
    start = time.perf_counter()
    if args.ckpt_format in ("torch_dist", "torch"):
        from megatron_ucp.train import legacy, native

        module = native if args.ckpt_format == "torch_dist" else legacy
        module.save(args, state, iteration, consumed, iteration_dir(args.save, iteration))
        dist.barrier()
        if dist.get_rank() == 0:
            write_tracker(args.save, iteration)
        dist.barrier()
    else:
        from megatron_ucp.api import save_universal

        weights_only = args.no_save_optim  # as Megatron-LM: neither optimizer nor scheduler
        result = save_universal(args.save, iteration, state.model,
                                None if weights_only else state.optimizer,
                                None if weights_only else state.scheduler,
                                vocab_size=args.vocab_size, consumed_samples=consumed,
                                args=vars(args), keep_last=args.keep_last,
                                async_save=background, save_rng=not args.no_save_rng,
                                progress=dict(state.progress))
        if background:
            state.pending_save = result
    if dist.get_rank() == 0:
        verb = "started background save" if background else "saved checkpoint"
        print(f" {verb} at iteration {iteration:8d} to {args.save} ({args.ckpt_format}) "
              f"in {time.perf_counter() - start:.2f} s", flush=True)


def open_local_tier(args, state):
    """The local tier of --local-ckpt-dir (collective), or None without the flag."""
    if not args.local_ckpt_dir:
        return None
    from megatron_ucp.engine.local_tier import open_tier

    return open_tier(args, state)


def restore_local(args, state, tier, reseed=None):
    """(iteration, consumed) restored from the local tier when it holds a sound iteration newer
    than --load's checkpoint; None (after one line saying why, when it held something) when
    the persistent tier must serve. Collective."""
    if tier is None or args.finetune:
        return None
    from megatron_ucp.engine import local_restore
    from megatron_ucp.engine.collective import on_rank_zero, run_everywhere

    persistent = on_rank_zero(_persistent_iteration, args)
    result = local_restore.restore(tier, args, state, persistent, reseed)
    if result is None:
        if args.load:
            note = local_restore.fallback_padding_note(state.model, args.vocab_size,
                                                       run_everywhere(_saved_padding, args))
            if note and dist.get_rank() == 0:
                print(f" {note}", flush=True)
        return None
    state.progress = dict(result.manifest.progress or {})
    return result.iteration, result.consumed_samples


def _persistent_iteration(args) -> int:
    """The iteration --load resumes (-1: none)."""
    if not args.load:
        return -1
    return _load_target(args)[0]


def _load_target(args):
    """(iteration, folder) that `--load` (and `--ckpt-step`) designate."""
    iteration = args.ckpt_step if args.ckpt_step is not None else read_tracker(args.load)
    return iteration, iteration_dir(args.load, iteration)


def latest_checkpoint(args):
    """(iteration, folder, saved layout) that --elastic resumes; None when --load holds none yet."""
    if not args.load or not _has_checkpoint(args):  # a tracker in a folder or a store
        return None
    iteration, directory = _load_target(args)
    if storage.is_remote(directory):
        from megatron_ucp.format.folder import designated_format
        designated_format(directory)  # IncompleteCheckpointError: no manifest there
    elif not os.path.isdir(directory):
        raise IncompleteCheckpointError(f"{directory}: named by --load/--ckpt-step but missing")
    if not _is_universal(directory):
        raise FormatError(f"{directory}: --elastic resumes universal checkpoints only (no ucp.json); "
                          "convert it with `megatron-ucp convert`")
    from megatron_ucp.format.manifest import read_manifest

    return iteration, directory, read_manifest(directory).layout


def prepare_load(args) -> None:
    """Before the model is built: `--load` without a checkpoint yet starts from scratch, as in
    Megatron-LM (the first job of a requeued chain points --load and --save at one new folder),
    or is a one-line error with --exit-on-missing-checkpoint; --use-checkpoint-args then takes
    the architecture from the checkpoint. Collective: rank 0 looks, every rank agrees."""
    from megatron_ucp.engine.collective import on_rank_zero

    if not args.load:
        return
    found = on_rank_zero(_has_checkpoint, args)
    if not found and args.elastic and not args.exit_on_missing_checkpoint:
        return  # --elastic starts fresh itself, and says so
    if not found:
        tracker = os.path.join(args.load, TRACKER)
        if args.exit_on_missing_checkpoint:
            raise IncompleteCheckpointError(f"{tracker}: no checkpoint in --load {args.load} "
                                            "(--exit-on-missing-checkpoint)")
        if dist.get_rank() == 0:
            print(f" no checkpoint in --load {args.load} (no {TRACKER}): training from scratch",
                  flush=True)
        args.load = None
        return
    if args.use_checkpoint_args:
        saved, entries = on_rank_zero(_saved_args, args)
        # the own loop's NullTokenizer adds its EOD to --vocab-size (validate_data); mock data none
        use_checkpoint_args(args, saved, verbose=dist.get_rank() == 0, entries=entries,
                            extra=1 if args.tokenizer_type == "NullTokenizer" else 0)


def _has_checkpoint(args) -> bool:
    """A tracker (or --ckpt-step) names a checkpoint; whether it is sound is load's to say."""
    return args.ckpt_step is not None or stores.exists(os.path.join(args.load, TRACKER))


def _saved_args(args) -> tuple:
    """The arguments the checkpoint to load was saved with (its manifest's "args") and its true
    vocabulary (its architecture's)."""
    iteration, directory = _load_target(args)
    if not _is_universal(directory):
        raise FormatError(f"{directory}: --use-checkpoint-args reads the arguments of a universal "
                          "checkpoint (ucp.json); convert it with `megatron-ucp convert`")
    from megatron_ucp.format.manifest import MANIFEST, read_manifest

    manifest = read_manifest(directory)
    saved = manifest.args
    if not isinstance(saved, dict) or not saved:
        raise FormatError(f"{os.path.join(directory, MANIFEST)}: key 'args' holds no arguments; "
                          "--use-checkpoint-args needs them (drop the flag and give the model's "
                          "arguments on the command line)")
    saved_args.check(saved, CHECKPOINT_ARGS + ("eod_token",), manifest, os.path.join(directory, MANIFEST))
    return saved, manifest.architecture.get("vocab_size")


def keep_saved_vocab_padding(args) -> None:
    """Build the padded vocabulary of the checkpoint this run restores, when the new TP size
    divides it: the local tier's iteration when it holds one newer than --load's (the one
    restore_local takes), else --load's.

    Padding rows take part in the softmax, so changing their number changes the loss; Megatron
    only needs the padded size divisible by TP, so keeping the saved size keeps the loss curve.
    Collective: a bad checkpoint is the same error on every rank.
    """
    padded, source = _restored_padding(args)
    tp = args.tensor_model_parallel_size
    if keeps_saved_padding(padded, args.vocab_size, tp) and padded != args.padded_vocab_size:
        if dist.get_rank() == 0:
            print(f" keeping {source}'s padded vocabulary of {padded} rows "
                  f"(instead of {args.padded_vocab_size})", flush=True)
        args.padded_vocab_size = padded


def _restored_padding(args):
    """(padded vocabulary, where from) of the checkpoint this run will restore: the local
    tier's newest iteration newer than --load's (its COMPLETE markers record it), else
    --load's universal checkpoint; (None, None) without either. Collective."""
    from megatron_ucp.engine.collective import on_rank_zero, run_everywhere

    if args.local_ckpt_dir and not args.finetune:
        from megatron_ucp.engine import local_restore
        from megatron_ucp.engine.local_tier import job_identity

        found = local_restore.peek(args.local_ckpt_dir, on_rank_zero(_persistent_iteration, args),
                                   on_rank_zero(job_identity, args))
        if found is not None and found[1] is not None:
            return found[1], f"local iteration {found[0]}"
    if args.load:
        return run_everywhere(_saved_padding, args), "the checkpoint"
    return None, None


def _saved_padding(args):
    _, directory = _load_target(args)
    if not _is_universal(directory):
        return None
    from megatron_ucp.format.manifest import read_manifest

    return read_manifest(directory).layout.get("padded_vocab_size")


def load(args, state, reseed=None):
    """Resume from `--load`; returns (iteration, consumed_samples).

    `reseed(iteration)` reseeds RNG when a universal checkpoint comes from another layout.
    With --finetune only the model weights load (as --no-load-optim --no-load-scheduler
    --no-load-rng say) and training starts over: iteration 0, no samples consumed, as in
    Megatron-LM, where fine-tuning from pretrained weights is a new run.
    """
    from megatron_ucp.engine.collective import run_everywhere

    if args.finetune:
        args = argparse.Namespace(**{**vars(args), "no_load_optim": True, "no_load_scheduler": True,
                                     "no_load_rng": True})

    iteration, directory = run_everywhere(_load_target, args)  # a bad tracker fails every rank
    # The same folder on every rank: agreed, so that the job prints it once.
    run_everywhere(check_format, directory, "universal" if args.load_universal else args.ckpt_format)
    if args.load_universal or args.ckpt_format == "universal":
        from megatron_ucp.api import load_universal

        result = load_universal(args.load, state.model, state.optimizer, state.scheduler,
                                vocab_size=args.vocab_size, iteration=iteration,
                                load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
                                load_scheduler=not args.no_load_scheduler,
                                strict=not args.no_strict_load,
                                verify=not args.no_verify_checkpoint, reseed=reseed,
                                read_policy=args.ckpt_read_policy, prove=not args.no_resume_proof)
        iteration, consumed = result.iteration, result.consumed_samples
        state.progress = dict(result.manifest.progress or {})
    else:
        from megatron_ucp.train import legacy, native

        module = legacy if args.ckpt_format == "torch" else native
        iteration, consumed = module.load(args, state, directory)
    if dist.get_rank() == 0:
        print(f" loaded checkpoint from {directory} at iteration {iteration}", flush=True)
    if args.finetune:
        if dist.get_rank() == 0:
            print(" --finetune: model weights only; training starts at iteration 0", flush=True)
        state.progress = {}
        return 0, 0
    return iteration, consumed


# How each format loads, for the message that names the flag.
LOAD_FLAGS = {"universal": "--ckpt-format universal (the default) or --load-universal",
              "torch_dist": "--ckpt-format torch_dist", "torch": "--ckpt-format torch",
              "fsdp_dtensor": "Megatron-LM's trainer with --use-megatron-fsdp --ckpt-format fsdp_dtensor"}


def check_format(directory: str, wanted: str) -> None:
    """The folder holds a checkpoint of the format asked for: no silent fallback to another
    format's loader (megatron's unpickles; a universal resume must not quietly become one)."""
    from megatron_ucp.format.folder import designated_format

    found, evidence = designated_format(directory)
    if found != wanted:
        convert = " or convert it with `megatron-ucp convert`" if found != "universal" else ""
        raise FormatError(f"{directory}: holds a {found} checkpoint ({evidence}), not the {wanted} one "
                          f"asked for; load it with {LOAD_FLAGS[found]}{convert}")


def _is_universal(directory: str) -> bool:
    return stores.exists(os.path.join(directory, "ucp.json"))
