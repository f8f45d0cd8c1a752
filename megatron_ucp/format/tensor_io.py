"""Positional element runs in and out of tensor files.

One process creates a file at full (sparse, then reserved) size; any number of processes then
write disjoint element runs with positional writes, and readers fetch only the runs they need,
hashing what they read on the way (checksums.py). Nothing here knows about torch.distributed;
arrays are numpy (callers pass ``tensor.numpy()``).
"""

from __future__ import annotations

import bisect
import errno
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from megatron_ucp import settings
from megatron_ucp.errors import IntegrityError, LayoutError
from megatron_ucp.format.checksums import crc32
from megatron_ucp.format.durability import reserve_space
from megatron_ucp.format.safe_files import IOV_MAX, open_regular, vector_io
from megatron_ucp.format.tensor_file import TensorFileLayout


@dataclass
class ReadCounter:
    """Bytes and syscalls spent by read_runs: lets tests prove a rank reads only what it owns."""

    bytes: int = 0
    calls: int = 0


# Many small runs (a TP rank's half of every row) are copied through a shared mapping of the
# file where its blocks are reserved; UCP_MAPPED_WRITES=0 keeps every write a pwrite.
MAPPED_RUN_BYTES = 256 * 2**10  # groups smaller than this on average go through the mapping


def read_threads() -> int:
    """Threads for reads: a read served from the page cache or a fast disk is a memory copy that
    keeps a core busy, so the ranks of this node share its cores (at most UCP_IO_THREADS each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(settings.io_threads(), cores // max(1, local_ranks)))


def in_parallel(fn, jobs, threads: int | None = None) -> list:
    """fn over jobs on up to `threads` threads (UCP_IO_THREADS: files in flight per rank;
    positional I/O, fsync and crc32 release the GIL), results in order; the first error is
    raised."""
    threads = settings.io_threads() if threads is None else threads
    if len(jobs) <= 1 or threads <= 1:
        return [fn(job) for job in jobs]
    with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="ucp-io") as pool:
        return list(pool.map(fn, jobs))


def _merged(runs, file_col: int, file_numel: int, buf_numel: int, dest_is_file: bool, where: str):
    """Runs validated, in file order, those adjacent in both file and buffer merged: (lengths,
    file starts, buffer starts) as arrays; None for no runs."""
    try:
        r = np.asarray(runs, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise LayoutError(f"{where}: runs must be integer (start, start, length) triples: {e}") from None
    if r.size == 0:
        return None
    if r.ndim != 2 or r.shape[1] != 3:
        raise LayoutError(f"{where}: runs must be (start, start, length) triples, got shape {r.shape}")
    f, b, n = r[:, file_col], r[:, 1 - file_col], r[:, 2]
    bad = (f < 0) | (b < 0) | (n < 0) | (f > file_numel - n) | (b > buf_numel - n)
    if bad.any():
        run = tuple(r[int(np.flatnonzero(bad)[0])].tolist())
        raise LayoutError(f"{where}: run {run} lies outside the tensor ({file_numel} elements) "
                          f"or the array ({buf_numel} elements)")
    keep = n > 0
    f, b, n = f[keep], b[keep], n[keep]
    if not len(n):
        return None
    dest = f if dest_is_file else b
    order = np.argsort(dest, kind="stable")
    ds, ns = dest[order], n[order]
    clash = np.flatnonzero(ds[1:] < ds[:-1] + ns[:-1])
    if len(clash):
        i = int(clash[0])
        raise LayoutError(f"{where}: runs overlap at destination elements {int(ds[i])}+{int(ns[i])} "
                          f"and {int(ds[i + 1])}+{int(ns[i + 1])}")
    order = np.argsort(f, kind="stable")
    f, b, n = f[order], b[order], n[order]
    both = (f[1:] == f[:-1] + n[:-1]) & (b[1:] == b[:-1] + n[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~both)))
    return np.add.reduceat(n, starts), f[starts], b[starts]


def _plan(runs, file_col: int, file_numel: int, buf_numel: int, dest_is_file: bool, where: str):
    """Validate runs and group them for vectored I/O.

    Returns [(file_elem_start, [(buf_elem_start, length), ...])]: each group is contiguous in the
    file (one pwritev/preadv), with runs adjacent in both file and buffer already merged.
    """
    merged = _merged(runs, file_col, file_numel, buf_numel, dest_is_file, where)
    if merged is None:
        return []
    n, f, b = merged
    groups = []  # [file_start, file_length, parts]
    for fs, bs, ln in zip(f.tolist(), b.tolist(), n.tolist()):
        g = groups[-1] if groups else None
        if g is not None and fs == g[0] + g[1] and len(g[2]) < IOV_MAX:
            g[1] += ln
            g[2].append((bs, ln))
        else:
            groups.append([fs, ln, [(bs, ln)]])
    return [(g[0], g[2]) for g in groups]


def _check_array(arr: np.ndarray, layout: TensorFileLayout, name: str, where: str) -> None:
    if arr.dtype != layout.dtype(name):
        raise LayoutError(f"{where}: array dtype {arr.dtype} does not match the file's {layout.dtype(name)}")


def write_runs(path, layout: TensorFileLayout, name: str, runs, data: np.ndarray) -> int:
    """Positional writes of data.reshape(-1)[src:src+len] to elements dst.. of tensor `name`.

    runs = [(src_start, dst_start, length)] in elements. The file must already exist at full size
    (create_tensor_file), so concurrent writers of disjoint runs never disturb each other.
    Returns bytes written.
    """
    where = f"{path}, tensor {name!r}"
    _check_array(data, layout, name, where)
    flat = np.ascontiguousarray(data).reshape(-1)
    groups = _plan(runs, 1, layout.numel(name), flat.size, True, where)
    raw, isz, base = memoryview(flat.view(np.uint8)), layout.itemsize(name), layout.data_offset(name)
    fd = os.open(path, os.O_RDWR)  # a shared writable mapping needs read access too
    try:
        st = os.fstat(fd)
        if st.st_size != layout.file_size:
            raise LayoutError(f"{where}: file has {st.st_size} bytes but its layout needs {layout.file_size}; "
                              "was it created with create_tensor_file for this layout?")
        if _map_these(groups, isz, st):
            return _write_mapped(fd, raw, isz, base, groups)
        total = 0
        for fstart, parts in groups:
            views = [raw[bs * isz:(bs + ln) * isz] for bs, ln in parts]
            want = sum(len(v) for v in views)
            done, _ = vector_io(True, fd, views, base + fstart * isz)
            if done != want:
                raise OSError(errno.EIO, f"{where}: wrote {done} of {want} bytes at offset {base + fstart * isz}")
            total += done
        return total
    finally:
        os.close(fd)


def _map_these(groups, isz: int, st: os.stat_result) -> bool:
    """Copy through a mapping: many small groups, and every block of the file allocated
    (reserve_space), so that no page fault can fail for want of space: that would be SIGBUS,
    not an error."""
    if not settings.mapped_writes() or len(groups) < 8 or not hasattr(st, "st_blocks"):
        return False
    nbytes = sum(ln for _, parts in groups for _, ln in parts) * isz
    return nbytes < MAPPED_RUN_BYTES * len(groups) and st.st_blocks * 512 >= st.st_size


def _write_mapped(fd: int, raw: memoryview, isz: int, base: int, groups) -> int:
    """The groups' bytes copied into a shared mapping of the file range they span. On ext4 a
    pwrite per 9 KiB run (a TP2 rank's half of a row) costs 4x the CPU per byte of large writes;
    through the mapping it is a page fault per 4 KiB and a memcpy (2.7x less CPU measured).
    Durability is unchanged: the pages are the page cache's, flushed by fsync."""
    first = base + groups[0][0] * isz
    last_start, last_parts = groups[-1]
    end = base + (last_start + sum(ln for _, ln in last_parts)) * isz
    lo = first - first % mmap.ALLOCATIONGRANULARITY
    total = 0
    with mmap.mmap(fd, end - lo, offset=lo) as m:
        for fstart, parts in groups:
            pos = base + fstart * isz - lo
            for bs, ln in parts:
                n = ln * isz
                m[pos:pos + n] = raw[bs * isz:bs * isz + n]
                pos += n
                total += n
    return total


def read_spans(layout: TensorFileLayout, name: str, runs, min_bytes: int = 0) -> list[tuple[int, int]]:
    """The file byte ranges [lo, hi) that read_runs(..., runs, ...) reads, one per preadv (the
    groups of _plan: runs contiguous in the file, at most IOV_MAX each), those of `min_bytes`
    or more. In arrays: a TP rank's column slice is a run per row, thousands per tensor."""
    merged = _merged(runs, 0, layout.numel(name), 1 << 62, False, f"tensor {name!r}")
    if merged is None:
        return []
    n, f, _ = merged
    contiguous = f[1:] == f[:-1] + n[:-1]
    segment = np.cumsum(np.concatenate(([1], ~contiguous))) - 1  # file-contiguous stretch of each run
    first = np.flatnonzero(np.concatenate(([True], ~contiguous)))
    starts = np.flatnonzero((np.arange(len(n)) - first[segment]) % IOV_MAX == 0)  # each group's first run
    lasts = np.concatenate((starts[1:], [len(n)])) - 1
    isz, base = layout.itemsize(name), layout.data_offset(name)
    lo, hi = base + f[starts] * isz, base + (f[lasts] + n[lasts]) * isz
    keep = hi - lo >= min_bytes
    return list(zip(lo[keep].tolist(), hi[keep].tolist()))


def _crc_views(views: list, lo: int, hi: int) -> int:
    """crc32 of bytes [lo, hi) of the concatenated views."""
    crc, pos = 0, 0
    for v in views:
        a, b = max(lo - pos, 0), min(hi - pos, len(v))
        if a < b:
            crc = crc32(v[a:b], crc)
        pos += len(v)
        if pos >= hi:
            break
    return crc


def read_runs(path, layout: TensorFileLayout, name: str, runs, out: np.ndarray,
              counter: ReadCounter | None = None, hash_spans=(), hashes: list | None = None) -> int:
    """Fill out.reshape(-1)[dst:dst+len] from elements src.. of tensor `name`, reading nothing else.

    runs = [(file_elem_start, out_elem_start, length)]. Runs contiguous in the file become one
    preadv. A short read (truncated file) raises IntegrityError. Returns bytes read. Each of the
    sorted file byte ranges `hash_spans` that lies inside one preadv is hashed from the bytes
    read: (lo, hi, crc32) is appended to `hashes`.
    """
    where = f"{path}, tensor {name!r}"
    _check_array(out, layout, name, where)
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise LayoutError(f"{where}: output array must be C-contiguous and writeable")
    groups = _plan(runs, 0, layout.numel(name), out.size, False, where)
    raw, isz, base = memoryview(out.reshape(-1).view(np.uint8)), layout.itemsize(name), layout.data_offset(name)
    fd = open_regular(path, "tensor file")
    total = calls = 0
    try:
        for fstart, parts in groups:
            views = [raw[bs * isz:(bs + ln) * isz] for bs, ln in parts]
            want = sum(len(v) for v in views)
            done, c = vector_io(False, fd, views, base + fstart * isz)
            calls += c
            if done != want:
                raise IntegrityError(f"{where}: file ends at byte offset {base + fstart * isz + done}, "
                                     f"inside the tensor (needed bytes up to {base + fstart * isz + want}); "
                                     "the file is truncated")
            total += done
            if hash_spans:
                lo = base + fstart * isz
                i = bisect.bisect_left(hash_spans, (lo, lo))
                while i < len(hash_spans) and hash_spans[i][1] <= lo + done:
                    a, b = hash_spans[i]
                    hashes.append((a, b, _crc_views(views, a - lo, b - lo)))
                    i += 1
    finally:
        os.close(fd)
        if counter is not None:
            counter.bytes += total
            counter.calls += calls
    return total


def read_groups(layout: TensorFileLayout, name: str, runs, out: np.ndarray, where: str) -> list:
    """The reads read_runs makes, for readers of other storage (an object store's ranged
    GETs): `out` checked, then [(file byte start, [(out byte start, bytes)])], each group
    contiguous in the file."""
    _check_array(out, layout, name, where)
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise LayoutError(f"{where}: output array must be C-contiguous and writeable")
    isz, base = layout.itemsize(name), layout.data_offset(name)
    return [(base + fstart * isz, [(bs * isz, ln * isz) for bs, ln in parts])
            for fstart, parts in _plan(runs, 0, layout.numel(name), out.size, False, where)]


def create_tensor_file(path, layout: TensorFileLayout) -> None:
    """Write the header, extend the file to full size and reserve its blocks where the file
    system can, so writers can then write in any order, and a full disk fails here, before
    any tensor is written. Truncates an existing file: stale bytes must not survive a new save."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done, _ = vector_io(True, fd, [memoryview(layout.header)], 0)
        if done != len(layout.header):
            raise OSError(errno.EIO, f"{path}: wrote {done} of {len(layout.header)} header bytes")
        os.ftruncate(fd, layout.file_size)
        reserve_space(fd, layout.file_size, path)
    finally:
        os.close(fd)
