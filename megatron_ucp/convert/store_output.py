"""A converter's or an import's output in an object store (s3://, msc://): built on local disk,
then committed to the store by the save's own protocol.

The converters write files at offsets from many sources (writer.py, the workers' saves), which
an object store cannot take, so the checkpoint is first written whole, with the folder's own
code and commit, into a staging folder (`--staging-dir`, default TMPDIR; the writer checks its
free space first), then published by engine/store_save.py's steps: the prefix claimed and dead
saves' leftovers removed (`prepare`), every tensor object and RNG state uploaded, then the
manifest, then the tracker (`commit`). A failure before the manifest removes what was uploaded
(`discard`); a kill leaves objects without a manifest, which no load takes and the next save
removes. The tracker never moves back and a committed iteration is never replaced, as for a
folder (output_folder.check_save_folder).
"""

import contextlib
import os
import shutil
import tempfile

from megatron_ucp.engine import store_owner, store_save
from megatron_ucp.errors import ConfigError, SaveError
from megatron_ucp.format import safe_files, storage, stores, tensor_io
from megatron_ucp.format.folder import MANIFEST, TRACKER, iteration_dir, iteration_of, read_tracker


def check(output: str, iteration: int, flag: str = "--output") -> None:
    """`output` (a store prefix) can take iteration `iteration`: not inside a checkpoint, its
    tracker not moved back, that iteration not committed there already."""
    store = stores.store_for(output)
    _, _, key = storage.split(output)
    parts = key.split("/") if key else []
    for i, name in enumerate(parts):
        if iteration_of(name) is not None:
            inside = output.split("://", 1)[0] + "://" + "/".join([storage.split(output)[1]] + parts[:i + 1])
            if store.exists(storage.join(inside, MANIFEST)):
                raise ConfigError(f"{flag} {output} lies inside the checkpoint {inside}; writing there would "
                                  "change that checkpoint: choose a prefix outside it")
    if store.exists(storage.join(output, TRACKER)):
        latest = read_tracker(output)
        if latest > iteration:
            raise ConfigError(f"{flag} {output} is a save prefix at iteration {latest}; writing iteration "
                              f"{iteration} there would move its tracker back and a later --load would resume "
                              "from it: choose another prefix")
    if store.exists(storage.join(iteration_dir(output, iteration), MANIFEST)):
        raise ConfigError(f"{iteration_dir(output, iteration)} exists already; choose another {flag}")


def publish(local: str, output: str, flag: str = "--output") -> str:
    """Commit the checkpoint the local save folder `local` tracks to the store prefix `output`
    (store_save's protocol); returns its iteration prefix there."""
    iteration = read_tracker(local)
    source = iteration_dir(local, iteration)
    store = stores.store_for(output)
    final = iteration_dir(output, iteration)
    files = sorted(os.path.relpath(os.path.join(d, f), source).replace(os.sep, "/")
                   for d, _, names in os.walk(source) for f in names)
    store_owner.claim(output, what=flag)  # one writer per prefix (a live training job refuses this)
    try:
        _upload(store, output, iteration, source, final, files, flag)
    finally:
        store_owner.release(output)  # this command's claim, at its end as a training run's
    return final


def _upload(store, output, iteration, source, final, files, flag) -> None:
    check(output, iteration, flag)
    store_save.prepare(store, output, iteration)  # removes dead saves' objects
    try:
        tensor_io.in_parallel(lambda rel: store.upload(storage.join(final, rel), os.path.join(source, rel)),
                              [rel for rel in files if rel != MANIFEST], getattr(store, "threads", 8))
        manifest = safe_files.read_bounded(os.path.join(source, MANIFEST), "manifest",
                                           safe_files.MAX_MANIFEST_BYTES, source)
        store_save.commit(store, output, iteration, manifest)
    except Exception as e:
        store_save.discard(store, final)
        raise SaveError(f"upload of iteration {iteration} to {output} failed, nothing committed "
                        f"(the tracker still names the previous checkpoint): {e}") from e


@contextlib.contextmanager
def staged(output: str, flag: str = "--output", staging_dir=None):
    """A local save folder for the body to write into, published to `output` when the body
    returns, removed in any case. The store is first touched by the publication: a body that
    fails (bad input) leaves it alone."""
    if staging_dir is not None and not os.path.isdir(staging_dir):
        raise ConfigError(f"--staging-dir {staging_dir}: no such folder")
    tmp = tempfile.mkdtemp(prefix="ucp-staging-", dir=staging_dir)
    try:
        local = os.path.join(tmp, "out")
        yield local
        publish(local, output, flag)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_to(output: str, write, flag: str = "--output", staging_dir=None) -> dict:
    """`write(folder)` -> summary, into `output` itself, or for an object store into a staging
    folder then published; the summary's `output` names where the checkpoint is."""
    if not storage.is_remote(output):
        return write(output)
    with staged(output, flag, staging_dir) as local:
        summary = write(local)
    summary["output"] = iteration_dir(output, summary["iteration"])
    return summary
