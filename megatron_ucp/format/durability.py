"""Durable writes: what a crash or a full disk may and may not leave behind.

Blocks reserved before a file is written (a full disk fails before any data), writeback started
early, fsync of files and of the folders that name them, and small files replaced atomically.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os


def libc_function(name: str, argtypes: list):
    """A Linux libc call through ctypes (errno kept), or None where there is none."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = argtypes
    return fn


_FALLOCATE = libc_function("fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])


_NOT_SUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def reserve_space(fd: int, size: int, path) -> bool:
    """Allocate the blocks of [0, size) (fallocate, Linux), keeping the contents. Returns False
    where the file system cannot (the file stays sparse); a full disk or quota raises OSError
    naming the file."""
    if _FALLOCATE is None or size == 0:
        return False
    if _FALLOCATE(fd, 0, 0, size) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NOT_SUPPORTED:
        return False
    raise OSError(err, f"{os.strerror(err)}: reserving {size} bytes for {path}")


_SYNC_FILE_RANGE_WRITE = 2


_SYNC_RANGE = libc_function("sync_file_range", [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint])


def start_writeback(path) -> bool:
    """Start writing the file's dirty pages to the disk without waiting (Linux), so the disk
    works while the caller hashes; below the kernel's dirty-background threshold nothing would
    reach it before the fsync. Best effort (durability comes from fsync_file): returns whether
    writeback was started."""
    if _SYNC_RANGE is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        return _SYNC_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) == 0
    finally:
        os.close(fd)


def fsync_file(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path) -> None:
    """Make a rename or file creation in `path` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # some filesystems cannot sync directories; nothing more to do
            raise
    finally:
        os.close(fd)


def atomic_write_bytes(path, data: bytes) -> None:
    """Write via a temp file, fsync, rename and fsync the directory: a crash at any point leaves
    either the old file or the complete new one, never a torn mix."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_json(path, obj) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode("utf-8"))
