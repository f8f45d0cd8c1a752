"""The checkpoint folder: megatron's tracker file, its `iter_XXXXXXX/` iteration folders, and
the one commit protocol every writer of a checkpoint follows (the save and the converters).

A checkpoint is written into a temporary folder beside its final place (`begin`), then
`commit` writes the manifest into it, makes everything durable, renames it into place and
points the tracker at it: a failed or killed writer leaves the previous checkpoint and the
tracker as they were, and at worst a temporary folder that the next save removes
(ownership.remove_leftovers). Needs no torch: the tracker is read bounded and written
atomically (safe_files.py, durability.py), its number taken as ASCII digits only.
"""

import os
import re
import shutil
import uuid
from typing import Optional

from megatron_ucp.errors import FormatError, IncompleteCheckpointError, UCPError
from megatron_ucp.format import storage, stores
from megatron_ucp.format.durability import atomic_write_bytes, atomic_write_json, fsync_dir
from megatron_ucp.format.safe_files import MAX_TRACKER_BYTES, open_regular, read_bounded

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "ucp.json"  # in each iteration folder: what the checkpoint holds (manifest.py)
TMP_PREFIX = ".tmp_iter_"  # a checkpoint being written: never read, removed once its writer is gone
OLD_MARK = ".old_"  # iter_N.old_*: a checkpoint being replaced by a new save of iteration N


_ITERATION_NAME = re.compile(r"^iter_(\d{7,})$")
# Megatron-LM's legacy per-rank folders: mp_rank_TT[_PPP][_EEE]
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def is_legacy(directory: str) -> bool:
    """An iteration folder of Megatron-LM's legacy per-rank format."""
    return os.path.isdir(directory) and any(
        RANK_DIR.match(n) and os.path.isdir(os.path.join(directory, n)) for n in os.listdir(directory))


def designated_format(directory: str):
    """found_format of the folder --load (and --ckpt-step) designate; IncompleteCheckpointError
    naming it when it is missing or holds no checkpoint (both trainers' format checks). In an
    object store only universal checkpoints are read."""
    if storage.is_remote(directory):
        if not stores.store_for(directory).exists(storage.join(directory, MANIFEST)):
            raise IncompleteCheckpointError(f"{directory}: holds no universal checkpoint (no {MANIFEST}: "
                                            "never committed, or its save was killed)")
        return "universal", MANIFEST
    if not os.path.isdir(directory):
        raise IncompleteCheckpointError(f"{directory}: named by --load/--ckpt-step but missing")
    found, evidence = found_format(directory)
    if found is None:
        raise IncompleteCheckpointError(f"{directory}: holds no checkpoint (no {MANIFEST}, .metadata, "
                                        "*.distcp or mp_rank_* folders)")
    return found, evidence


def found_format(directory: str):
    """(format, evidence) of the checkpoint an iteration folder holds; (None, None) for none."""
    if os.path.lexists(os.path.join(directory, MANIFEST)):
        return "universal", MANIFEST
    if is_legacy(directory):
        return "torch", "mp_rank_* folders"
    names = os.listdir(directory)
    if is_fsdp_dtensor(directory, names):
        return "fsdp_dtensor", f".metadata with {FSDP_DTENSOR_MARK.decode()}* keys"
    if ".metadata" in names or any(n.endswith(".distcp") for n in names):
        return "torch_dist", ".metadata / *.distcp files"
    return None, None


# Megatron-FSDP's `fsdp_dtensor` checkpoints are plain torch DCP: no megatron `metadata.json`
# (megatron-core's torch_dist writes one, and 0.16 a common.pt), and the model's keys are its
# module paths under the wrapper, `model.module.<path>` (megatron/training/checkpointing.py).
FSDP_DTENSOR_MARK = b"model.module."
_SCAN_BLOCK = 1 << 20
_SCAN_LIMIT = 1 << 30  # the DCP metadata bound of the converters' reader


def is_fsdp_dtensor(directory: str, names=None) -> bool:
    """A Megatron-FSDP `fsdp_dtensor` checkpoint: `.metadata` alone (no metadata.json, no
    common.pt) naming `model.module.*` keys. Found in the pickle's bytes (a key is stored as
    its UTF-8 text), so that this needs no torch; the converter then reads it properly."""
    names = os.listdir(directory) if names is None else names
    if ".metadata" not in names or "metadata.json" in names or "common.pt" in names:
        return False
    try:
        fd = open_regular(os.path.join(directory, ".metadata"), "torch DCP metadata", directory)
    except (UCPError, OSError):  # not a regular file: whoever reads it names the problem
        return False
    try:
        tail, offset = b"", 0
        while offset < _SCAN_LIMIT:
            block = os.pread(fd, _SCAN_BLOCK, offset)
            if not block:
                return False
            if FSDP_DTENSOR_MARK in tail + block:
                return True
            tail, offset = block[-len(FSDP_DTENSOR_MARK):], offset + len(block)
        return False
    finally:
        os.close(fd)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def iteration_of(name: str) -> Optional[int]:
    """The iteration an `iter_XXXXXXX` folder name holds; None for any other name."""
    found = _ITERATION_NAME.match(name)
    return int(found.group(1)) if found else None


def tracker_iteration(raw: bytes, path: str) -> int:
    """The iteration a tracker file names: ASCII digits only (int() would take '-4', '+4',
    '4_0' and other scripts' digits), so that it names an `iter_XXXXXXX` folder."""
    found = re.fullmatch(rb"\s*([0-9]{1,19})\s*", raw)
    if found is None:
        raise FormatError(f"{path}: expected an iteration number (digits 0-9), found {raw[:40]!r}")
    return int(found.group(1))


def read_tracker(root: str) -> int:
    path = os.path.join(root, TRACKER)
    try:
        if storage.is_remote(root):
            raw = stores.store_for(root).read(path, MAX_TRACKER_BYTES, "tracker file")
        else:
            raw = read_bounded(path, "tracker file", MAX_TRACKER_BYTES, root)
    except IncompleteCheckpointError:
        raise IncompleteCheckpointError(f"{path}: no tracker file; is {root} a checkpoint folder?") from None
    return tracker_iteration(raw, path)


def write_tracker(root: str, iteration: int) -> None:
    """Atomically point the tracker at `iteration` (rank 0 only): the commit of a save."""
    atomic_write_bytes(os.path.join(root, TRACKER), f"{iteration}\n".encode())


def rng_file(folder: str, rank: int) -> str:
    """Rank `rank`'s RNG state in a checkpoint's `rng/` folder."""
    return os.path.join(folder, f"rank_{rank:05d}.json")


def begin(root: str, iteration: int) -> str:
    """A new temporary folder for `iteration`'s checkpoint under `root` (with `tensors/` and
    `rng/`), on the same file system as its final place so that the commit is a rename."""
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f"{TMP_PREFIX}{iteration:07d}_{uuid.uuid4().hex[:8]}")
    os.makedirs(os.path.join(tmp, "tensors"))
    os.makedirs(os.path.join(tmp, "rng"))
    return tmp


def commit(root: str, tmp: str, iteration: int, manifest: dict) -> str:
    """Write `manifest` into `tmp`, make the folder durable, move it to `iter_XXXXXXX` (an older
    folder of that name is set aside first and removed last) and point the tracker at it.
    Returns the final folder. A full disk while the manifest is written raises an OSError that
    names the manifest (the kernel's names no file)."""
    path = os.path.join(tmp, MANIFEST)
    try:
        atomic_write_json(path, manifest)
    except OSError as e:
        raise OSError(e.errno, f"writing the manifest {path} failed: {e.strerror or e}") from e
    fsync_dir(os.path.join(tmp, "tensors"))
    fsync_dir(os.path.join(tmp, "rng"))
    final = iteration_dir(root, iteration)
    old = None
    if os.path.exists(final):
        old = f"{final}{OLD_MARK}{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(root)
    write_tracker(root, iteration)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return final
