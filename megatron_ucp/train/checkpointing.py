"""Where checkpoints go: Megatron's `iter_XXXXXXX/` folders and tracker, in either format."""

import os
import time

import torch.distributed as dist

from megatron_ucp.errors import FormatError, IncompleteCheckpointError
from megatron_ucp.manifest import tracker_iteration

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int:
    from megatron_ucp.storage import MAX_TRACKER_BYTES, read_bounded

    path = os.path.join(root, TRACKER)
    try:
        raw = read_bounded(path, "tracker file", MAX_TRACKER_BYTES, root)
    except IncompleteCheckpointError:
        raise IncompleteCheckpointError(f"{path}: no tracker file; is {root} a checkpoint folder?") from None
    return tracker_iteration(raw, path)


def write_tracker(root: str, iteration: int) -> None:
    """Atomically point the tracker at `iteration` (rank 0 only): the commit of a save."""
    from megatron_ucp.storage import atomic_write_bytes

    atomic_write_bytes(os.path.join(root, TRACKER), f"{iteration}\n".encode())


def claim_save_folder(args) -> None:
    """Rank 0 takes the --save folder's owner lock when the job starts, not at its first save:
    a second job is refused (on every rank) before it trains (ownership.py)."""
    from megatron_ucp import ownership
    from megatron_ucp.collective import run_everywhere

    run_everywhere(lambda: ownership.claim(args.save) if dist.get_rank() == 0 else None)


def release_save_folder(args) -> None:
    """Rank 0 gives the --save folder up at a clean end of training (ownership.release)."""
    from megatron_ucp import ownership

    dist.barrier()  # every rank is done with the folder
    if dist.get_rank() == 0:
        ownership.release(args.save)


def finish_pending_save(state) -> None:
    """Wait for an asynchronous save still in flight (before the next one, and before exit)."""
    if state.pending_save is not None:
        pending, state.pending_save = state.pending_save, None
        pending.wait()


def save(args, state, iteration: int, consumed: int) -> None:
    finish_pending_save(state)
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

        result = save_universal(args.save, iteration, state.model, state.optimizer, state.scheduler,
                                vocab_size=args.vocab_size, consumed_samples=consumed,
                                args=vars(args), keep_last=args.keep_last,
                                async_save=args.async_save)
        if args.async_save:
            state.pending_save = result
    if dist.get_rank() == 0:
        verb = "started background save" if args.async_save else "saved checkpoint"
        print(f" {verb} at iteration {iteration:8d} to {args.save} ({args.ckpt_format}) "
              f"in {time.perf_counter() - start:.2f} s", flush=True)


def _load_target(args):
    """(iteration, folder) that `--load` (and `--ckpt-step`) designate."""
    iteration = args.ckpt_step if args.ckpt_step is not None else read_tracker(args.load)
    return iteration, iteration_dir(args.load, iteration)


def latest_checkpoint(args):
    """(iteration, folder, saved layout) that --elastic resumes; None when --load holds none yet."""
    if not args.load or (args.ckpt_step is None and not os.path.exists(os.path.join(args.load, TRACKER))):
        return None
    iteration, directory = _load_target(args)
    if not os.path.isdir(directory):
        raise IncompleteCheckpointError(f"{directory}: named by --load/--ckpt-step but missing")
    if not _is_universal(directory):
        raise FormatError(f"{directory}: --elastic resumes universal checkpoints only (no ucp.json); "
                          "convert it with tools/convert_to_universal.py")
    from megatron_ucp.manifest import read_manifest

    return iteration, directory, read_manifest(directory)["layout"]


def keep_saved_vocab_padding(args) -> None:
    """Reuse the checkpoint's padded vocabulary when the new TP size divides it.

    Padding rows take part in the softmax, so changing their number changes the loss; Megatron
    only needs the padded size divisible by TP, so keeping the saved size keeps the loss curve.
    Collective: a bad checkpoint is the same error on every rank.
    """
    if args.load:
        from megatron_ucp.collective import run_everywhere

        run_everywhere(_keep_saved_vocab_padding, args)


def _keep_saved_vocab_padding(args) -> None:
    _, directory = _load_target(args)
    if not _is_universal(directory):
        return
    from megatron_ucp.manifest import read_manifest

    padded = read_manifest(directory)["layout"].get("padded_vocab_size")
    tp = args.tensor_model_parallel_size
    if padded and padded >= args.vocab_size and padded % tp == 0 and padded != args.padded_vocab_size:
        if dist.get_rank() == 0:
            print(f" keeping the checkpoint's padded vocabulary of {padded} rows "
                  f"(instead of {args.padded_vocab_size})", flush=True)
        args.padded_vocab_size = padded


def load(args, state, reseed=None):
    """Resume from `--load`; returns (iteration, consumed_samples).

    `reseed(iteration)` reseeds RNG when a universal checkpoint comes from another layout.
    """
    from megatron_ucp.collective import run_everywhere

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
                                verify=not args.no_verify_checkpoint, reseed=reseed)
        iteration, consumed = result.iteration, result.consumed_samples
    else:
        from megatron_ucp.train import legacy, native

        module = legacy if args.ckpt_format == "torch" else native
        iteration, consumed = module.load(args, state, directory)
    if dist.get_rank() == 0:
        print(f" loaded checkpoint from {directory} at iteration {iteration}", flush=True)
    return iteration, consumed


# How each format loads, for the message that names the flag.
LOAD_FLAGS = {"universal": "--ckpt-format universal (the default) or --load-universal",
              "torch_dist": "--ckpt-format torch_dist", "torch": "--ckpt-format torch"}


def found_format(directory: str):
    """(format, evidence) of the checkpoint an iteration folder holds; (None, None) for none."""
    from megatron_ucp.legacy_convert import is_legacy

    if _is_universal(directory):
        return "universal", "ucp.json"
    if is_legacy(directory):
        return "torch", "mp_rank_* folders"
    names = os.listdir(directory)
    if ".metadata" in names or any(n.endswith(".distcp") for n in names):
        return "torch_dist", ".metadata / *.distcp files"
    return None, None


def check_format(directory: str, wanted: str) -> None:
    """The folder holds a checkpoint of the format asked for: no silent fallback to another
    format's loader (megatron's unpickles; a universal resume must not quietly become one)."""
    if not os.path.isdir(directory):
        raise IncompleteCheckpointError(f"{directory}: named by --load/--ckpt-step but missing")
    found, evidence = found_format(directory)
    if found is None:
        raise IncompleteCheckpointError(f"{directory}: holds no checkpoint (no ucp.json, .metadata, "
                                        "*.distcp or mp_rank_* folders)")
    if found != wanted:
        convert = " or convert it with tools/convert_to_universal.py" if found != "universal" else ""
        raise FormatError(f"{directory}: holds a {found} checkpoint ({evidence}), not the {wanted} one "
                          f"asked for; load it with {LOAD_FLAGS[found]}{convert}")


def _is_universal(directory: str) -> bool:
    return os.path.lexists(os.path.join(directory, "ucp.json"))
