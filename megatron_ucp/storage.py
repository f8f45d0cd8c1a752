"""Byte-level I/O for atomic tensor files.

Each consolidated parameter ("atomic tensor") lives in its own safetensors file holding several
equally-shaped tensors (param, exp_avg, exp_avg_sq, ...). The header is a pure function of the
entries, so every process computes the same data offsets without reading the file: one process
creates the file at full (sparse) size, then any number of processes write disjoint element runs
with positional writes, and readers fetch only the runs they need. Nothing here knows about
torch.distributed; arrays are numpy (callers pass ``tensor.numpy()``).
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import json
import math
import mmap
import os
import stat
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError, IntegrityError, LayoutError

# safetensors dtype string -> numpy dtype (safetensors data is little-endian), and back.
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
DTYPE_NAMES: dict[np.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def _crc32():
    """zlib-ng's crc32 where installed: the same sums, 8x faster here (21 vs 2.5 GB/s) with
    carry-less multiplication; on two cores the checksums were the largest CPU cost of a save."""
    try:
        from zlib_ng import zlib_ng

        return zlib_ng.crc32
    except ImportError:
        return zlib.crc32


crc32 = _crc32()  # crc32(data, value=0) -> int, as zlib.crc32; both release the GIL

MAX_HEADER_BYTES = 100 * 2**20
BLOCK_BYTES = 4 * 2**20
_IOV_MAX = 1024  # Linux's UIO_MAXIOV; also the POSIX minimum most systems exceed


def _normalize_entries(entries) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """Check entries given by our own code and return them as hashable tuples."""
    out, seen = [], set()
    for entry in entries:
        try:
            name, shape, dtype = entry
            shape = tuple(int(d) for d in shape)
        except (TypeError, ValueError) as e:
            raise LayoutError(f"tensor entry {entry!r} is not (name, shape, dtype): {e}") from None
        if not isinstance(name, str) or not name or name == "__metadata__" or name in seen:
            raise LayoutError(f"tensor name {name!r} is empty, reserved or repeated")
        if dtype not in SAFETENSORS_DTYPES:
            raise LayoutError(f"tensor {name!r}: unknown dtype {dtype!r} (known: {sorted(SAFETENSORS_DTYPES)})")
        if any(d < 0 for d in shape):
            raise LayoutError(f"tensor {name!r}: negative dimension in shape {shape}")
        seen.add(name)
        out.append((name, shape, dtype))
    return tuple(out)


def safetensors_header(entries) -> bytes:
    """Header for tensors laid out back to back in the order given.

    Compact JSON in insertion order, space-padded so the data section starts 8-byte aligned: the
    bytes depend only on the entries, so every process computes identical offsets.
    """
    meta, offset = {}, 0
    for name, shape, dtype in _normalize_entries(entries):
        nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = json.dumps(meta, separators=(",", ":")).encode("ascii")
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


@dataclass(frozen=True)
class TensorFileLayout:
    """Where each named tensor's bytes live inside one file: computed purely from entries.

    ``header`` may be a foreign one (from read_header); data offsets then still follow from the
    entries because read_header has checked that the tensors lie back to back in entry order.
    """

    entries: tuple
    header: bytes
    _index: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        entries, header = _normalize_entries(self.entries), bytes(self.header)
        if len(header) < 8 or struct.unpack_from("<Q", header)[0] != len(header) - 8:
            raise LayoutError("header bytes do not start with their own length")
        index, offset = {}, len(header)
        for name, shape, dtype in entries:
            itemsize = SAFETENSORS_DTYPES[dtype].itemsize
            index[name] = (offset, math.prod(shape), SAFETENSORS_DTYPES[dtype])
            offset += math.prod(shape) * itemsize
        object.__setattr__(self, "entries", entries)
        object.__setattr__(self, "header", header)
        object.__setattr__(self, "_index", index)

    @classmethod
    def build(cls, entries) -> TensorFileLayout:
        entries = _normalize_entries(entries)
        return cls(entries, safetensors_header(entries))

    def _get(self, name):
        try:
            return self._index[name]
        except KeyError:
            raise LayoutError(f"no tensor {name!r} in this file (has {sorted(self._index)})") from None

    def __contains__(self, name) -> bool:
        return name in self._index

    def data_offset(self, name) -> int:
        return self._get(name)[0]

    def numel(self, name) -> int:
        return self._get(name)[1]

    def dtype(self, name) -> np.dtype:
        return self._get(name)[2]

    def itemsize(self, name) -> int:
        return self._get(name)[2].itemsize

    def byte_range(self, name) -> tuple[int, int]:
        start, numel, dtype = self._get(name)
        return start, start + numel * dtype.itemsize

    @property
    def file_size(self) -> int:
        sizes = (numel * dt.itemsize for _, numel, dt in self._index.values())
        return len(self.header) + sum(sizes)


@dataclass
class ReadCounter:
    """Bytes and syscalls spent by read_runs: lets tests prove a rank reads only what it owns."""

    bytes: int = 0
    calls: int = 0


# Files in flight per rank (positional reads and writes, fsync and crc32 release the GIL);
# UCP_IO_THREADS overrides it, e.g. for a parallel file system that wants more.
def positive_int_env(name: str, default: int) -> int:
    """The positive integer in environment variable `name` (`default` when unset)."""
    raw = os.environ.get(name, str(default))
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ConfigError(f"environment variable {name}={raw!r}: expected a positive integer")
    return int(raw)


IO_THREADS = positive_int_env("UCP_IO_THREADS", 4)


def _mapped_writes() -> bool:
    raw = os.environ.get("UCP_MAPPED_WRITES", "1").strip()
    if raw not in ("0", "1"):
        raise ConfigError(f"environment variable UCP_MAPPED_WRITES={raw!r}: expected 0 or 1")
    return raw == "1"


# Many small runs (a TP rank's half of every row) are copied through a shared mapping of the
# file where its blocks are reserved; UCP_MAPPED_WRITES=0 keeps every write a pwrite.
MAPPED_WRITES = _mapped_writes()
MAPPED_RUN_BYTES = 256 * 2**10  # groups smaller than this on average go through the mapping


def read_threads() -> int:
    """Threads for reads: a read served from the page cache or a fast disk is a memory copy that
    keeps a core busy, so the ranks of this node share its cores (at most IO_THREADS each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(IO_THREADS, cores // max(1, local_ranks)))


def in_parallel(fn, jobs, threads: int = IO_THREADS) -> list:
    """fn over jobs on up to `threads` threads, results in order; the first error is raised."""
    if len(jobs) <= 1 or threads <= 1:
        return [fn(job) for job in jobs]
    with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="ucp-io") as pool:
        return list(pool.map(fn, jobs))


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


def _vector_io(write: bool, fd: int, views: list, offset: int) -> tuple[int, int]:
    """Transfer byte views to/from consecutive file bytes from `offset`, resuming after short
    transfers; stops early only at end of file (reads). Returns (bytes moved, syscalls)."""
    vector = getattr(os, "pwritev" if write else "preadv", None)
    done = calls = i = 0
    while i < len(views):
        if vector is not None:
            k = vector(fd, views[i:i + _IOV_MAX], offset + done)
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


def _read_exact(fd: int, nbytes: int, offset: int, path, what: str, into: memoryview = None):
    """nbytes from offset, into the start of `into` when given (returns that slice)."""
    buf = memoryview(bytearray(nbytes)) if into is None else into[:nbytes]
    done, _ = _vector_io(False, fd, [buf], offset)
    if done < nbytes:
        raise IntegrityError(f"{path}: file ends at byte {offset + done} while reading {what} "
                             f"(bytes {offset}..{offset + nbytes})")
    return buf


def _plan(runs, file_col: int, file_numel: int, buf_numel: int, dest_is_file: bool, where: str):
    """Validate runs and group them for vectored I/O.

    Returns [(file_elem_start, [(buf_elem_start, length), ...])]: each group is contiguous in the
    file (one pwritev/preadv), with runs adjacent in both file and buffer already merged.
    """
    try:
        r = np.asarray(runs, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise LayoutError(f"{where}: runs must be integer (start, start, length) triples: {e}") from None
    if r.size == 0:
        return []
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
        return []
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
    n, f, b = np.add.reduceat(n, starts), f[starts], b[starts]
    groups = []  # [file_start, file_length, parts]
    for fs, bs, ln in zip(f.tolist(), b.tolist(), n.tolist()):
        g = groups[-1] if groups else None
        if g is not None and fs == g[0] + g[1] and len(g[2]) < _IOV_MAX:
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
            done, _ = _vector_io(True, fd, views, base + fstart * isz)
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
    if not MAPPED_WRITES or len(groups) < 8 or not hasattr(st, "st_blocks"):
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


def read_spans(layout: TensorFileLayout, name: str, runs) -> list[tuple[int, int]]:
    """The file byte ranges [lo, hi) that read_runs(..., runs, ...) reads, one per preadv."""
    groups = _plan(runs, 0, layout.numel(name), 1 << 62, False, f"tensor {name!r}")
    isz, base = layout.itemsize(name), layout.data_offset(name)
    return [(base + fs * isz, base + (fs + sum(ln for _, ln in parts)) * isz) for fs, parts in groups]


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
            done, c = _vector_io(False, fd, views, base + fstart * isz)
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


def create_tensor_file(path, layout: TensorFileLayout) -> None:
    """Write the header, extend the file to full size and reserve its blocks where the file
    system can, so writers can then write in any order, and a full disk fails here, before
    any tensor is written. Truncates an existing file: stale bytes must not survive a new save."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done, _ = _vector_io(True, fd, [memoryview(layout.header)], 0)
        if done != len(layout.header):
            raise OSError(errno.EIO, f"{path}: wrote {done} of {len(layout.header)} header bytes")
        os.ftruncate(fd, layout.file_size)
        reserve_space(fd, layout.file_size, path)
    finally:
        os.close(fd)


def _reject_duplicate_keys(pairs):
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise ValueError(f"duplicate key {k!r}")
        obj[k] = v
    return obj


def _is_uint(x) -> bool:
    return type(x) is int and x >= 0


def read_header(path, max_header_bytes: int = MAX_HEADER_BYTES) -> TensorFileLayout:
    """Parse and check a safetensors header, trusting nothing in it.

    Sizes are checked against max_header_bytes and the file size before anything is read or
    allocated. Bad structure -> FormatError; a self-consistent header describing more data than
    the file holds -> IntegrityError (truncated file). Entries come back in data-offset order.
    """
    fd = open_regular(path, "tensor file")
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise FormatError(f"{path}: {size} bytes is too short for a safetensors file")
        (n,) = struct.unpack("<Q", _read_exact(fd, 8, 0, path, "header length"))
        if n > max_header_bytes or n > size - 8:
            raise FormatError(f"{path}: header claims {n} bytes; the limit is {max_header_bytes} "
                              f"and the file has {size}")
        raw = bytes(_read_exact(fd, n, 8, path, "header"))
    finally:
        os.close(fd)
    try:
        meta = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(f"{path}: safetensors header is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise FormatError(f"{path}: safetensors header is a {type(meta).__name__}, not an object")
    extra = meta.pop("__metadata__", None)
    if extra is not None and not (isinstance(extra, dict) and all(isinstance(v, str) for v in extra.values())):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    spans = []
    for name, info in meta.items():
        what = f"{path}: tensor {name!r}"
        if not name or not isinstance(info, dict):
            raise FormatError(f"{what}: empty name or entry is not an object")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            raise FormatError(f"{what}: unknown dtype {dtype!r} (known: {sorted(SAFETENSORS_DTYPES)})")
        if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
            raise FormatError(f"{what}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_uint(o) for o in offs) and offs[0] <= offs[1]):
            raise FormatError(f"{what}: data_offsets {offs!r} is not [begin, end] with 0 <= begin <= end")
        if math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize != offs[1] - offs[0]:
            raise FormatError(f"{what}: shape {shape} of {dtype} does not fill data_offsets {offs}")
        spans.append((offs[0], offs[1], name, tuple(shape), dtype))
    spans.sort()
    end = 0
    for begin, stop, name, _, _ in spans:
        if begin != end:
            kind = "overlaps the previous tensor" if begin < end else "leaves a gap after the previous tensor"
            raise FormatError(f"{path}: tensor {name!r} at data_offsets [{begin}, {stop}] {kind} (ending at {end})")
        end = stop
    data_size = size - 8 - n
    if end > data_size:
        raise IntegrityError(f"{path}: header describes {end} data bytes but the file holds only "
                             f"{data_size}; the file is truncated")
    if end < data_size:
        raise FormatError(f"{path}: {data_size - end} trailing bytes after the last tensor")
    return TensorFileLayout(tuple((nm, sh, dt) for _, _, nm, sh, dt in spans), struct.pack("<Q", n) + raw)


def _crc_blocks(fd: int, path, start: int, stop: int, block_bytes: int):
    """Yield (index, lo, hi, crc) for block_bytes-sized blocks of [start, stop), reusing one buffer."""
    buf = memoryview(bytearray(min(block_bytes, max(stop - start, 0))))
    for i, lo in enumerate(range(start, stop, block_bytes)):
        hi = min(lo + block_bytes, stop)
        done, _ = _vector_io(False, fd, [buf[:hi - lo]], lo)
        if done < hi - lo:
            raise IntegrityError(f"{path}: file ends at byte {lo + done}, inside checksummed block {i} "
                                 f"(bytes {lo}..{hi})")
        yield i, lo, hi, f"{crc32(buf[:hi - lo]):08x}"


def _check_span(start: int, stop: int, block_bytes: int) -> None:
    if block_bytes <= 0 or not 0 <= start <= stop:
        raise ValueError(f"bad byte range [{start}, {stop}) or block size {block_bytes}")


def block_checksums(path, start: int, stop: int, block_bytes: int = BLOCK_BYTES) -> list[str]:
    """crc32 (8 hex chars) of each block of [start, stop), the last one shorter.

    Per-block sums let a reader verify just the blocks it reads; ranks may checksum disjoint
    block-aligned pieces and concatenate the lists.
    """
    _check_span(start, stop, block_bytes)
    fd = open_regular(path, "tensor file")
    try:
        return [crc for _, _, _, crc in _crc_blocks(fd, path, start, stop, block_bytes)]
    finally:
        os.close(fd)


def crc_spans(path, spans) -> list[int]:
    """crc32 of each file byte range [lo, hi) of `spans`; a range past the end raises."""
    fd = open_regular(path, "tensor file")
    try:
        buf = memoryview(bytearray(max((hi - lo for lo, hi in spans), default=0)))
        return [crc32(_read_exact(fd, hi - lo, lo, path, "bytes to hash", buf)) for lo, hi in spans]
    finally:
        os.close(fd)


def verify_range(path, start: int, stop: int, checksums, block_bytes: int = BLOCK_BYTES, *,
                 base: int = 0, end: int | None = None) -> None:
    """Re-hash the blocks intersecting [start, stop) and compare with `checksums`.

    `checksums` is block_checksums(path, base, end); end defaults to the file size (the usual
    whole-file case is base=0). Mismatch -> IntegrityError naming block, bytes and both sums.
    """
    _check_span(start, stop, block_bytes)
    if start == stop:
        return
    fd = open_regular(path, "tensor file")
    try:
        if end is None:
            end = os.fstat(fd).st_size
            if stop > end:
                raise IntegrityError(f"{path}: file has {end} bytes, cannot verify bytes {start}..{stop}")
        if start < base or stop > end:
            raise ValueError(f"{path}: bytes {start}..{stop} lie outside the checksummed range {base}..{end}")
        first, last = (start - base) // block_bytes, (stop - 1 - base) // block_bytes
        if last >= len(checksums):
            raise FormatError(f"{path}: {len(checksums)} block checksums recorded, block {last} needed")
        lo = base + first * block_bytes
        hi = min(base + (last + 1) * block_bytes, end)
        for i, b_lo, b_hi, found in _crc_blocks(fd, path, lo, hi, block_bytes):
            expected = str(checksums[first + i]).lower()
            if found != expected:
                raise IntegrityError(f"{path}: block {first + i} (bytes {b_lo}..{b_hi}) has crc32 {found}, "
                                     f"expected {expected}")
    finally:
        os.close(fd)


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


def safe_join(root, relpath) -> str:
    """Join a manifest's relative path under root, refusing anything that could escape it.

    Manifests are data, possibly hostile: absolute paths, '..', '.', empty components, NUL,
    backslashes and symlinks leading outside root are all refused with FormatError.
    """
    if not isinstance(relpath, str) or not relpath:
        raise FormatError(f"path {relpath!r} in manifest is not a non-empty string")
    parts = relpath.split("/")
    if ("\x00" in relpath or "\\" in relpath or os.path.isabs(relpath)
            or any(p in ("", ".", "..") for p in parts)):
        raise FormatError(f"path {relpath!r} in manifest must be relative, without '..', '.', "
                          "empty components, backslashes or NUL bytes")
    root = os.fspath(root)
    joined = os.path.join(root, *parts)
    real_root = os.path.realpath(root)
    real = os.path.realpath(joined)
    if os.path.commonpath([real_root, real]) != real_root:
        raise FormatError(f"{joined}: path {relpath!r} in manifest resolves outside {root} (through a "
                          f"symlink, to {real})")
    return joined
