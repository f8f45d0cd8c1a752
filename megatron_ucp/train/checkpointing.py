"""Where checkpoints go: Megatron's `iter_XXXXXXX/` folders and tracker, in either format."""

import os

import torch.distributed as dist

from megatron_ucp.errors import FormatError, IncompleteCheckpointError

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int:
    path = os.path.join(root, TRACKER)
    try:
        with open(path) as f:
            text = f.read().strip()
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: no tracker file; is {root} a checkpoint folder?")
    try:
        return int(text)
    except ValueError:
        raise FormatError(f"{path}: expected an iteration number, found {text[:40]!r}")


def write_tracker(root: str, iteration: int) -> None:
    """Atomically point the tracker at `iteration` (rank 0 only): the commit of a save."""
    from megatron_ucp.storage import atomic_write_bytes

    atomic_write_bytes(os.path.join(root, TRACKER), f"{iteration}\n".encode())


def save(args, state, iteration: int, consumed: int) -> None:
    if args.ckpt_format == "torch_dist":
        from megatron_ucp.train import native

        native.save(args, state, iteration, consumed, iteration_dir(args.save, iteration))
        dist.barrier()
        if dist.get_rank() == 0:
            write_tracker(args.save, iteration)
        dist.barrier()
    else:
        from megatron_ucp.api import save_universal

        save_universal(args.save, iteration, state.model, state.optimizer, state.scheduler,
                       consumed_samples=consumed, model_args=vars(args))
    if dist.get_rank() == 0:
        print(f" saved checkpoint at iteration {iteration:8d} to {args.save} ({args.ckpt_format})",
              flush=True)


def load(args, state):
    """Resume from `--load`; returns (iteration, consumed_samples)."""
    iteration = read_tracker(args.load)
    directory = iteration_dir(args.load, iteration)
    if args.load_universal or (args.ckpt_format == "universal" and _is_universal(directory)):
        from megatron_ucp.api import load_universal

        result = load_universal(args.load, state.model, state.optimizer, state.scheduler,
                                iteration=iteration, load_optim=not args.no_load_optim,
                                load_rng=not args.no_load_rng, model_args=vars(args))
        iteration, consumed = result.iteration, result.consumed_samples
    else:
        from megatron_ucp.train import native

        iteration, consumed = native.load(args, state, directory)
    if dist.get_rank() == 0:
        print(f" loaded checkpoint from {directory} at iteration {iteration}", flush=True)
    return iteration, consumed


def _is_universal(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "ucp.json"))
