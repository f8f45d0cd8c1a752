"""Foreign formats and object stores: an input in a store downloaded into a local staging folder
for the unchanged converter, and export-torch-dist's output uploaded from one.

The readers of foreign formats (torch DCP's file reader, `torch.load` of zip files,
safetensors' mmap) need POSIX files, not ranged GETs, and megatron's torch_dist writer writes
files. So an input in a store (`convert`'s torch_dist, fsdp_dtensor or legacy checkpoint,
`import-hf`'s folder, `import-deepspeed`'s) is downloaded first, into `--staging-dir` (default
TMPDIR): only what the command reads where that is known (the iteration the tracker or
`--iteration` names, an HF folder's own files), each object in chunks of its listed size (the
store's retries; an object that changes size meanwhile is refused), the listed total checked
against the folder's free space before any byte; the copy is removed at the end, also on
failure. A torch_dist checkpoint for a store is written into a staging folder and uploaded,
the tracker last: a reader that follows the tracker (megatron's `--load msc://...` under
`--enable-msc`, a later download) never finds a partial iteration; a failed upload deletes
what it uploaded (as store_output.py's publication does). An HF model folder for a store
(export-hf) is written in a staging folder too and uploaded into an empty prefix, its
config.json last.
"""

import contextlib
import os
import shutil
import tempfile

from megatron_ucp.errors import ConfigError, IncompleteCheckpointError, IntegrityError, SaveError
from megatron_ucp.format import safe_files, storage, stores, tensor_io
from megatron_ucp.format.folder import TRACKER, iteration_dir

CHUNK_BYTES = 64 * 2**20  # one ranged GET of a download: what one thread holds at once


def staging_root(staging_dir=None) -> str:
    """A fresh private folder under `staging_dir` (default TMPDIR)."""
    if staging_dir is not None and not os.path.isdir(staging_dir):
        raise ConfigError(f"--staging-dir {staging_dir}: no such folder")
    return tempfile.mkdtemp(prefix="ucp-staging-", dir=staging_dir)


def _check_room(folder: str, needed: int, source: str) -> None:
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise SaveError(f"{folder}: disk full: {free / 1e9:.3f} GB free, {source} takes {needed / 1e9:.3f} GB; "
                        "nothing was downloaded: free space or choose another --staging-dir")


def download(prefix: str, dest: str, keep=None) -> int:
    """Copy the objects under the store prefix `prefix` whose relative names `keep` accepts
    (default: all) into the folder `dest`, same names; returns the bytes copied."""
    store = stores.store_for(prefix)
    root = prefix.rstrip("/")
    jobs = []
    for path, size in store.list(root):
        rel = path[len(root) + 1:]
        if keep is None or keep(rel):
            jobs.append((path, size, safe_files.safe_join(dest, rel, f"the listing of {prefix}")))
    if not jobs:
        raise IncompleteCheckpointError(f"{prefix}: no objects under this prefix (or none of those the command reads)")
    os.makedirs(dest, exist_ok=True)
    _check_room(dest, sum(size for _, size, _ in jobs), f"the input {prefix}")
    tensor_io.in_parallel(lambda job: _fetch(store, *job), jobs, getattr(store, "threads", 8))
    return sum(size for _, size, _ in jobs)


def _fetch(store, path: str, size: int, local: str) -> None:
    """One object into `local`: ranged reads of exactly its listed size (a shorter object is
    refused by the read), then its size again (a longer one now is refused too)."""
    os.makedirs(os.path.dirname(local), exist_ok=True)
    with open(local, "wb") as f:
        for data in store.iter_ranges(path, [(lo, min(lo + CHUNK_BYTES, size)) for lo in range(0, size, CHUNK_BYTES)]):
            f.write(data)
    now = store.size(path)
    if now != size:
        raise IntegrityError(f"{path}: object changed while it was downloaded ({now} bytes, listed {size})")


@contextlib.contextmanager
def local_input(path: str, staging_dir=None, keep=None):
    """`path` itself for a folder; for a store prefix, its local copy (named as the prefix's
    last component, e.g. iter_0000002), removed when the body ends."""
    if not storage.is_remote(path):
        yield path
        return
    tmp = staging_root(staging_dir)
    try:
        local = os.path.join(tmp, path.rstrip("/").rpartition("/")[2] or "input")
        download(path, local, keep)
        yield local
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_prefix_keep(prefix: str, iteration=None):
    """(iteration, keep) for a save prefix a converter of one iteration reads: the iteration
    the tracker (megatron's, read from the store) or `iteration` names, and a filter of the
    tracker and that iteration's objects; (None, None) (everything) for a prefix without a
    tracker (an iter_ prefix, a folder of another kind), which the converter then judges."""
    from megatron_ucp.format.folder import read_tracker

    if iteration is None:
        if not stores.exists(storage.join(prefix.rstrip("/"), TRACKER)):
            return None, None
        iteration = read_tracker(prefix.rstrip("/"))
    folder = os.path.basename(iteration_dir("", iteration)) + "/"
    return iteration, lambda rel: rel == TRACKER or rel.startswith(folder)


def check_output(output: str, iteration: int, flag: str = "OUT") -> None:
    """A store prefix can take a torch_dist iteration: its tracker not moved back, nothing
    under that iteration yet."""
    from megatron_ucp.format.folder import read_tracker

    root = output.rstrip("/")
    if stores.exists(storage.join(root, TRACKER)) and read_tracker(root) > iteration:
        raise ConfigError(f"{flag} {output} is a save prefix at iteration {read_tracker(root)}; writing iteration "
                          f"{iteration} there would move its tracker back: choose another prefix")
    if stores.store_for(output).list(iteration_dir(root, iteration)):
        raise ConfigError(f"{iteration_dir(root, iteration)} exists already; choose another {flag}")


def upload(local: str, output: str, iteration: int, flag: str = "OUT") -> None:
    """The save folder `local` (its iteration folder, then its tracker) to the store prefix
    `output`; a failure deletes what was uploaded and leaves the tracker as it was."""
    from megatron_ucp.engine import store_owner, store_save

    root, store = output.rstrip("/"), stores.store_for(output)
    source, final = iteration_dir(local, iteration), iteration_dir(root, iteration)
    files = sorted(os.path.relpath(os.path.join(d, f), source).replace(os.sep, "/")
                   for d, _, names in os.walk(source) for f in names)
    store_owner.claim(root, what=flag)
    try:
        check_output(root, iteration, flag)
        try:
            tensor_io.in_parallel(lambda rel: store.upload(storage.join(final, rel), os.path.join(source, rel)),
                                  files, getattr(store, "threads", 8))
            store.upload(storage.join(root, TRACKER), os.path.join(local, TRACKER))  # last: the commit
        except Exception as e:
            store_save.discard(store, final)
            raise SaveError(f"upload of iteration {iteration} to {output} failed, nothing committed (the "
                            f"tracker still names the previous checkpoint): {e}") from e
    finally:
        store_owner.release(root)


def check_empty(output: str, flag: str = "output") -> None:
    """A store prefix for a folder that has no commit protocol of its own (an HF model folder)
    must hold nothing yet: another model's files beside ours would be read as one model."""
    if stores.store_for(output).list(output.rstrip("/")):
        raise ConfigError(f"{flag} {output}: the prefix holds objects already; choose an empty prefix")


def upload_folder(local: str, output: str, last=(), flag: str = "output") -> None:
    """Every file of the folder `local` to the empty store prefix `output`, the names in `last`
    after all others (what a reader opens first: an HF folder's config.json); a failure
    deletes what was uploaded."""
    root, store = output.rstrip("/"), stores.store_for(output)
    files = sorted(os.path.relpath(os.path.join(d, f), local).replace(os.sep, "/")
                   for d, _, names in os.walk(local) for f in names)
    first = [rel for rel in files if rel not in last]
    check_empty(root, flag)
    try:
        tensor_io.in_parallel(lambda rel: store.upload(storage.join(root, rel), os.path.join(local, rel)),
                              first, getattr(store, "threads", 8))
        for rel in (r for r in last if r in files):
            store.upload(storage.join(root, rel), os.path.join(local, rel))
    except Exception as e:
        from megatron_ucp.engine import store_save

        store_save.discard(store, root)
        raise SaveError(f"upload of {local} to {output} failed; what was uploaded is deleted: {e}") from e
