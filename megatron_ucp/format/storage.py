"""Where a checkpoint's bytes live, chosen by the path's scheme (PyTorch DCP's split: the engine
plans which bytes go where; a store only moves them).

A store does what a save and a load need and nothing more: write an object whole (from memory
or from a local file, multipart where large), read byte ranges of one, its size, whether it
exists, list and delete under a prefix. Paths stay strings everywhere: `s3://bucket/prefix/...`
(boto3: s3_store.py) and `msc://PROFILE/path` (NVIDIA's Multi-Storage Client, Megatron-LM's
`--enable-msc` profiles: msc_store.py) name objects; anything else is a local path, whose
checkpoints keep the folder's own code (folder.py, tensor_io.py: fallocate, pwritev, fsync,
rename), unchanged. PosixStore is that folder seen through this interface, for the callers
that take either (the tracker, the manifest, tools).

An object store has no rename: the commit protocol of a save into one is store_save.py's
(docs/object_storage.md).
"""

from __future__ import annotations

import os

from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError, IntegrityError
from megatron_ucp.format import durability, safe_files

SCHEMES = {"s3": "boto3", "msc": "multi-storage-client"}  # scheme -> the package it needs


def scheme_of(path) -> str | None:
    """'s3' / 'msc' for an object-store path, None for a local one."""
    path = os.fspath(path) if not isinstance(path, str) else path
    head, sep, _ = path.partition("://")
    return head if sep and head in SCHEMES else None


def is_remote(path) -> bool:
    return isinstance(path, str) and scheme_of(path) is not None


def split(path: str) -> tuple[str, str, str]:
    """(scheme, bucket or profile, key) of an object-store path; keys never start with '/'."""
    scheme, _, rest = path.partition("://")
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise FormatError(f"{path}: expected {scheme}://BUCKET/PREFIX")
    return scheme, bucket, key.strip("/")


def join(root: str, relpath: str, source: str = "manifest") -> str:
    """An object under `root` named by a manifest's relative path, refusing any that could
    leave it (as safe_files.safe_join does for folders); local paths go to safe_join."""
    if not is_remote(root):
        return safe_files.safe_join(root, relpath, source)
    if not isinstance(relpath, str) or not relpath:
        raise FormatError(f"path {relpath!r} in {source} is not a non-empty string")
    parts = relpath.split("/")
    if "\x00" in relpath or "\\" in relpath or relpath.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise FormatError(f"path {relpath!r} in {source} must be relative, without '..', '.', "
                          "empty components, backslashes or NUL bytes")
    return root.rstrip("/") + "/" + relpath


def whole_object(path: str, size, max_bytes: int, what: str, fetch) -> bytes:
    """An object stores read whole: its listed `size` (None: missing) refused past `max_bytes`
    before `fetch()` gets it, and what came checked against that size."""
    if size is None:
        raise IncompleteCheckpointError(f"{path}: {what} is missing from the store")
    if size > max_bytes:
        raise IntegrityError(f"{path}: {what} has {size} bytes, more than the {max_bytes} it may have")
    data = fetch()
    if len(data) != size:
        raise IntegrityError(f"{path}: {what} changed while it was read ({len(data)} bytes, listed {size})")
    return data


class Store:
    """What a save and a load need from storage. Paths are full paths (or URLs) of objects;
    errors are UCPErrors naming the object (a missing one: IncompleteCheckpointError)."""

    def read(self, path: str, max_bytes: int, what: str) -> bytes:
        """A whole small object (tracker, manifest, RNG state), refused past `max_bytes`."""
        raise NotImplementedError

    def read_ranges(self, path: str, spans) -> list:
        """The bytes of each [lo, hi) of `spans` (sorted, disjoint), each exactly hi - lo long:
        a short object is an IntegrityError naming it."""
        raise NotImplementedError

    def iter_ranges(self, path: str, spans):
        """read_ranges' bytes one span at a time (a large object downloaded in chunks without
        holding it whole); stores that can insist on one version across the GETs do."""
        for span in spans:
            yield self.read_ranges(path, [span])[0]

    def size(self, path: str):
        """The object's size in bytes; None where there is none."""
        raise NotImplementedError

    def head(self, path: str, nbytes: int):
        """(its first `nbytes` bytes or fewer, its size) in one request; None where there is
        no object (a file's header and size: the checks of every load)."""
        size = self.size(path)
        if size is None:
            return None
        return self.read_ranges(path, [(0, min(nbytes, size))])[0], size

    def exists(self, path: str) -> bool:
        return self.size(path) is not None

    def write(self, path: str, data: bytes) -> None:
        """Put a small object whole: readers see the old one or the new one, never a mix."""
        raise NotImplementedError

    def upload(self, path: str, local_file: str) -> None:
        """Put a local file as one object (multipart and parallel where large)."""
        raise NotImplementedError

    def list(self, prefix: str) -> list:
        """[(path, size)] of every object under `prefix`/."""
        raise NotImplementedError

    def delete(self, paths) -> None:
        raise NotImplementedError

    def read_meta(self, path: str, max_bytes: int):
        """(bytes, version tag, seconds since written) of a small object; None where there is
        none (an owner record: its age says whether its job is stale)."""
        raise NotImplementedError

    def write_if(self, path: str, data: bytes, tag) -> bool:
        """Put `data` only if the object is still the version `tag` names (None: only if there
        is no object); False when another writer got there first. Stores without conditional
        writes write unconditionally (True): no mutual exclusion there."""
        self.write(path, data)
        return True

    def abort_uploads(self, prefix: str) -> int:
        """Abort unfinished multipart uploads under `prefix` (a killed save's); how many."""
        return 0


class PosixStore(Store):
    """A local folder: small files replaced atomically (durability.py), bounded reads of
    regular files only (safe_files.py)."""

    def read_meta(self, path, max_bytes):
        import time

        if self.size(path) is None:
            return None
        data = self.read(path, max_bytes, "object")
        return data, None, time.time() - os.path.getmtime(path)

    def read(self, path, max_bytes, what):
        return safe_files.read_bounded(path, what, max_bytes)

    def read_ranges(self, path, spans):
        fd = safe_files.open_regular(path, "tensor file")
        try:
            return [bytes(safe_files.read_exact(fd, hi - lo, lo, path, "bytes")) for lo, hi in spans]
        finally:
            os.close(fd)

    def size(self, path):
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None

    def write(self, path, data):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        durability.atomic_write_bytes(path, data)

    def upload(self, path, local_file):
        import shutil

        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        shutil.copyfile(local_file, path)
        durability.fsync_file(path)

    def list(self, prefix):
        out = []
        for folder, _, files in os.walk(prefix):
            out += [(os.path.join(folder, f), os.path.getsize(os.path.join(folder, f))) for f in files]
        return sorted(out)

    def delete(self, paths):
        for p in paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def need(module: str, path: str):
    """Import `module` for `path`'s scheme, or one line naming the package to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = SCHEMES[scheme_of(path)]
        raise ConfigError(
            f"{path}: {scheme_of(path)}:// paths need the package {package!r} "
            f"(pip install {package}, or megatron-ucp[s3])") from None
