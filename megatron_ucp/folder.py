"""The checkpoint folder: megatron's tracker file and its `iter_XXXXXXX/` iteration folders.

Library, not training application: save, load, the converters and the tools all find and
commit checkpoints through these (train/checkpointing.py builds its flags on them). Needs no
torch: the tracker is read bounded and written atomically (safe_files.py, durability.py), its number checked by
manifest.tracker_iteration.
"""

import os

from megatron_ucp.errors import IncompleteCheckpointError
from megatron_ucp.manifest import tracker_iteration
from megatron_ucp.durability import atomic_write_bytes
from megatron_ucp.safe_files import MAX_TRACKER_BYTES, read_bounded

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> int:
    path = os.path.join(root, TRACKER)
    try:
        raw = read_bounded(path, "tracker file", MAX_TRACKER_BYTES, root)
    except IncompleteCheckpointError:
        raise IncompleteCheckpointError(f"{path}: no tracker file; is {root} a checkpoint folder?") from None
    return tracker_iteration(raw, path)


def write_tracker(root: str, iteration: int) -> None:
    """Atomically point the tracker at `iteration` (rank 0 only): the commit of a save."""
    atomic_write_bytes(os.path.join(root, TRACKER), f"{iteration}\n".encode())
