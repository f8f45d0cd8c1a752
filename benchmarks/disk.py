"""The disk baselines' primitives, shared by the benchmarks."""

import os

from megatron_ucp.format import durability

CHUNK = 64 * 2**20


def sequential_write(path, nbytes: int, block: bytes, kick: bool) -> None:
    """Write `nbytes` of `block` repeated, then fsync. With `kick`, writeback is started after
    each block, as the universal save does per file: on this VM that was 4-7x faster at times."""
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[:min(len(block), left)])
            if kick:
                f.flush()
                durability.start_writeback(path)
        f.flush()
        os.fsync(f.fileno())


def sequential_read(path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        while f.readinto(buf):
            pass


def drop_cache(path) -> None:
    """Evict a file's (or a folder's files') clean pages, so the next read comes from the disk."""
    path = str(path)
    paths = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs] if os.path.isdir(path) else [path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
