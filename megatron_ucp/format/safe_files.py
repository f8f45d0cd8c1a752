"""Reading files a stranger wrote: checkpoints are input from anyone.

Only regular files are opened (a FIFO would block forever, a device never end), paths from a
manifest must stay inside the checkpoint, small files are read up to a bound, and JSON is taken
strictly (no repeated keys, no NaN). Positional reads and writes resume after short transfers.
"""

from __future__ import annotations

import json
import os
import stat

from megatron_ucp.errors import FormatError, IncompleteCheckpointError, IntegrityError

IOV_MAX = 1024  # Linux's UIO_MAXIOV; also the POSIX minimum most systems exceed


# Size bounds of the small files a checkpoint holds: what their format can need, with room to
# spare; a larger one is damaged or hostile (a symlink to /dev/zero would read until memory ran out).
MAX_MANIFEST_BYTES = 256 * 2**20  # 1 TB of tensors in 4 MiB blocks records about 3 MB of checksums


MAX_RNG_BYTES = 16 * 2**20  # one rank's RNG states as JSON: 150 KB on CPU


MAX_TRACKER_BYTES = 1024  # an iteration number


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def check_inside(root, path, what: str) -> None:
    """Refuse `path` when it resolves (through symlinks) outside `root`."""
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise FormatError(f"{what} {path} resolves outside {root} (to {real}); expected a file inside it")


def open_regular(path, what: str, root=None) -> int:
    """A read-only descriptor of `path`, if it is a regular file (inside `root`, when given).

    Checkpoints are input from strangers: a FIFO would block a read forever, a device (a symlink
    to /dev/zero) would never end, a directory fails later with a traceback. O_NONBLOCK keeps the
    open itself from blocking on a FIFO; fstat then judges what was opened, not a name that could
    change after a check.
    """
    path = os.fspath(path)
    if root is not None:
        check_inside(root, path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{what} {path} is missing") from None
    except OSError as e:  # a socket (ENXIO), a symlink loop, no permission
        raise FormatError(f"{what} {path} cannot be opened: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FormatError(f"{what} {path} is a {_kind(mode)}, expected a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(path, what: str, max_bytes: int, root=None) -> bytes:
    """The whole of a small regular file, refused (FormatError) beyond `max_bytes`."""
    fd = open_regular(path, what, root)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise FormatError(f"{what} {path} has {size} bytes; expected at most {max_bytes}")
        chunks, total = [], 0
        while total <= max_bytes:  # the file may grow while read: read one byte past the bound
            chunk = os.read(fd, max_bytes + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        os.close(fd)
    if total > max_bytes:
        raise FormatError(f"{what} {path} grew past {max_bytes} bytes while read")
    return b"".join(chunks)


def vector_io(write: bool, fd: int, views: list, offset: int) -> tuple[int, int]:
    """Transfer byte views to/from consecutive file bytes from `offset`, resuming after short
    transfers; stops early only at end of file (reads). Returns (bytes moved, syscalls)."""
    vector = getattr(os, "pwritev" if write else "preadv", None)
    done = calls = i = 0
    while i < len(views):
        if vector is not None:
            k = vector(fd, views[i:i + IOV_MAX], offset + done)
        elif write:
            k = os.pwrite(fd, views[i], offset + done)
        else:
            chunk = os.pread(fd, len(views[i]), offset + done)
            k = len(chunk)
            views[i][:k] = chunk
        calls += 1
        if k <= 0:
            break
        done += k
        while i < len(views) and k >= len(views[i]):
            k -= len(views[i])
            i += 1
        if k:
            views[i] = views[i][k:]
    return done, calls


def read_exact(fd: int, nbytes: int, offset: int, path, what: str, into: memoryview = None):
    """nbytes from offset, into the start of `into` when given (returns that slice)."""
    buf = memoryview(bytearray(nbytes)) if into is None else into[:nbytes]
    done, _ = vector_io(False, fd, [buf], offset)
    if done < nbytes:
        raise IntegrityError(f"{path}: file ends at byte {offset + done} while reading {what} "
                             f"(bytes {offset}..{offset + nbytes})")
    return buf


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs):
    """object_pairs_hook: a repeated key is an error, not "the last one wins" (a hostile file
    could show one value to a reviewer's tool and another to the loader)."""
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise _DuplicateKey(k)
        obj[k] = v
    return obj


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes, path, what: str):
    """JSON text as a checkpoint holds it: UTF-8, no repeated keys, no NaN or Infinity."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"{what} {path} is not UTF-8 text (byte {e.start}); damaged or not a JSON file") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except _DuplicateKey as e:
        raise FormatError(f"{what} {path}: key {e.args[0]!r} appears twice in one object; "
                          "expected each key once") from None
    except (ValueError, RecursionError) as e:
        raise FormatError(f"{what} {path} is not valid JSON (truncated or corrupt?): {e}") from None


def read_json(path, what: str, max_bytes: int = MAX_RNG_BYTES, root=None) -> dict:
    """Load a JSON object from a regular file of at most `max_bytes` (inside `root`, by default
    the file's folder); missing -> IncompleteCheckpointError, anything else wrong -> FormatError."""
    root = os.path.dirname(os.path.abspath(path)) if root is None else root
    obj = parse_json(read_bounded(path, what, max_bytes, root), path, what)
    if not isinstance(obj, dict):
        raise FormatError(f"{what} {path} holds a JSON {type(obj).__name__}, expected an object")
    return obj


def safe_join(root, relpath, source: str = "manifest") -> str:
    """Join a manifest's relative path under root, refusing anything that could escape it.

    Manifests are data, possibly hostile: absolute paths, '..', '.', empty components, NUL,
    backslashes and symlinks leading outside root are all refused with FormatError. `source`:
    the file the path came from, for the message.
    """
    if not isinstance(relpath, str) or not relpath:
        raise FormatError(f"path {relpath!r} in {source} is not a non-empty string")
    parts = relpath.split("/")
    if ("\x00" in relpath or "\\" in relpath or os.path.isabs(relpath)
            or any(p in ("", ".", "..") for p in parts)):
        raise FormatError(f"path {relpath!r} in {source} must be relative, without '..', '.', "
                          "empty components, backslashes or NUL bytes")
    root = os.fspath(root)
    joined = os.path.join(root, *parts)
    real_root = os.path.realpath(root)
    real = os.path.realpath(joined)
    if os.path.commonpath([real_root, real]) != real_root:
        raise FormatError(f"{joined}: path {relpath!r} in {source} resolves outside {root} (through a "
                          f"symlink, to {real})")
    return joined
