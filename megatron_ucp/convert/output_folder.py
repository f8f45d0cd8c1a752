"""Where a converter, import or export may write, and the owner lock while it does.

A converter's output folder may be a save folder a training run uses. Writing there is a save
like any other: it takes the folder's owner lock (engine/ownership.py, so a live run or another
converter is refused), never moves the folder's tracker backwards (a later `--load` would resume
from the converted weights), never mixes formats under one tracker, and never lies inside a
checkpoint (that checkpoint's verification would then fail).
"""

import contextlib
import errno
import os
import shutil

from megatron_ucp.engine import ownership
from megatron_ucp.errors import ConfigError, SaveError
from megatron_ucp.format.folder import TRACKER, found_format, iteration_dir, iteration_of, read_tracker


def enclosing_checkpoint(path: str):
    """The checkpoint iteration folder `path` lies in (or is), or None."""
    here = os.path.realpath(path)
    while True:
        if iteration_of(os.path.basename(here)) is not None and os.path.isdir(here) and found_format(here)[0]:
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def refuse_inside_checkpoint(output: str, flag: str) -> None:
    inside = enclosing_checkpoint(output)
    if inside is not None:
        raise ConfigError(f"{flag} {output} lies inside the checkpoint {inside}; writing there would change "
                          "that checkpoint (its verification would fail): choose a folder outside it")


def refuse_inside_input(output: str, source: str, flag: str) -> None:
    """An import's output may not lie in (or be) the folder it reads: it would change that folder,
    and the next read of it would find the output among its files."""
    out, src = os.path.realpath(output), os.path.realpath(source)
    if out == src or out.startswith(src.rstrip(os.sep) + os.sep):
        raise ConfigError(f"{flag} {output} lies inside the input {source}; writing there would change the "
                          "folder being read (a later import of it would fail): choose a folder outside it")


def check_save_folder(output: str, iteration: int, fmt: str, flag: str) -> None:
    """`output` can take a checkpoint of `iteration` in format `fmt` without moving its tracker
    back or mixing formats; a file, or a checkpoint's inside, is refused."""
    if os.path.lexists(output) and not os.path.isdir(output):
        raise ConfigError(f"{flag} {output} exists and is not a folder; expected a folder (new, or a save folder)")
    refuse_inside_checkpoint(output, flag)
    if not os.path.lexists(os.path.join(output, TRACKER)):
        return
    latest = read_tracker(output)  # FormatError naming a bad tracker
    tracked = iteration_dir(output, latest)
    found = found_format(tracked)[0] if os.path.isdir(tracked) else None
    if found is not None and found != fmt:
        raise ConfigError(f"{flag} {output} holds {found} checkpoints (its tracker names {tracked}); this "
                          f"writes a {fmt} one: choose another folder")
    if latest > iteration:
        raise ConfigError(f"{flag} {output} is a save folder at iteration {latest} ({os.path.join(output, TRACKER)}); "
                          f"writing iteration {iteration} there would move its tracker back and a later --load "
                          "would resume from it: choose another folder")


@contextlib.contextmanager
def owned(output: str, iteration: int, fmt: str, flag: str = "output"):
    """Check `output` (check_save_folder) and hold its owner lock while the body writes. A
    folder this call created and that got no checkpoint (the body failed before its commit) is
    removed, lock files and all: a refused conversion leaves nothing behind."""
    check_save_folder(output, iteration, fmt, flag)
    created = not os.path.lexists(output)
    ownership.claim(output, launcher=True)
    try:
        yield
    except BaseException:
        ownership.release(output)
        if created and not os.path.lexists(os.path.join(output, TRACKER)):
            shutil.rmtree(output, ignore_errors=True)
        raise
    ownership.release(output)


def disk_full(error: BaseException, output: str):
    """A SaveError saying disk full for an out-of-space OSError (ENOSPC, EDQUOT) while writing
    `output`, else None; the caller has removed what it wrote, so a rerun starts clean."""
    if not (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)):
        return None
    where = f" ({error.filename})" if error.filename else ""
    return SaveError(f"{output}: disk full: {error.strerror or error}{where}; nothing was kept "
                     "(the partial output is removed): free space or choose another folder, then rerun")
