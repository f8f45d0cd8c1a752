"""The local tier's files: one rank's piece of a universal checkpoint on a node's local dir.

    DIR/<host>/iter_0000006/.ucp_local               # the tier wrote this folder, for this job
    DIR/<host>/iter_0000006/rank_00002.safetensors   # the regions rank 2 owns, every state
    DIR/<host>/iter_0000006/rank_00002.json          # its slot (rank, iteration, world, job), size, CRC-32s
    DIR/<host>/iter_0000006/COMPLETE                 # every rank's piece and replicas written

Every record names the job (engine/local_tier.job_identity): a restore takes only its own job's
pieces, and the tier removes only folders it marked as its own job's.

A piece is a valid safetensors file (fp32 tensors "<item>.<state>", no pickle) whose metadata
holds its regions (atomic tensor, part, box, flat range), the saving rank's RNG state and, on
rank 0's, the manifest head: what a universal save would have written, so that pieces of any
layout load as a universal checkpoint that reshards (engine/piece_reads.py). A node keeps its
own ranks' pieces (originals) and other nodes' replicas under the same names (what a restart
receives is staged apart and not kept: engine/local_receive.py).

A sidecar records the piece's CRC-32 and one per chunk of `chunk_bytes` (CHUNK_BYTES, more for
pieces beyond MAX_CHUNKS chunks): a restore reads and checks only the chunks of the bytes it
uses (a rank the regions it loads, a node the spans it sends), never a whole piece for a part
of it. A sidecar of an older release records no chunks: its piece is one chunk.
"""

import hashlib
import json
import mmap
import os
import shutil
import struct
import uuid
from typing import Dict, List, Optional, Tuple

import numpy as np
from safetensors.numpy import save as st_save

from megatron_ucp.errors import FormatError, IncompleteCheckpointError, IntegrityError
from megatron_ucp.format.checksums import crc32  # zlib-ng's where installed: zlib's sums, 10x faster
from megatron_ucp.format.durability import atomic_write_bytes, atomic_write_json, fsync_dir
from megatron_ucp.format.folder import iteration_dir, iteration_of
from megatron_ucp.format.layout import Region
from megatron_ucp.format import storage, stores
from megatron_ucp.format.safe_files import open_regular, parse_json, read_bounded, read_json, vector_io

COMPLETE = "COMPLETE"
MAX_HEADER_BYTES = 256 * 2**20
MAX_SIDECAR_BYTES = 64 * 1024  # a sidecar (its chunk sums) or COMPLETE marker, as JSON
CHUNK_BYTES = 4 * 2**20  # a piece's bytes per recorded CRC-32, at least
MAX_CHUNKS = 4096  # beyond, the chunks grow (a sidecar of 4096 sums is about 45 kB)
MAX_WORLD = 1 << 17  # a COMPLETE marker's world beyond this is not believed
MARK = ".ucp_local"  # in each iteration folder the tier made: the job that made it
JOB_FILE = ".ucp_local_job.json"  # in the --save folder: the job's id, made at its first start


def job_id(folder: str, create: bool) -> Optional[str]:
    """The job id kept in `folder` (a --save or --load folder), made there when `create` and
    absent (the job's first start: exclusively, so that of two starts at once one id wins);
    None when absent otherwise. FormatError naming the record when it is not one. In an
    object store it is an object there, created only where there is none (If-None-Match)."""
    if storage.is_remote(folder):
        return _checked_job(_store_job_record(folder, create), storage.join(folder, JOB_FILE))
    path = os.path.join(folder, JOB_FILE)
    if create and not os.path.lexists(path):
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        atomic_write_json(tmp, {"id": uuid.uuid4().hex})
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another start made it first: its id holds
        finally:
            os.unlink(tmp)
    if not os.path.lexists(path):
        return None
    return _checked_job(read_json(path, "local-tier job record", MAX_SIDECAR_BYTES), path)


def _store_job_record(folder: str, create: bool):
    """The job record object of a --save/--load prefix (a local path would make a folder
    named 's3:' and each node's restart another id); None where there is none."""
    store, path = stores.store_for(folder), storage.join(folder, JOB_FILE)
    if create and not store.exists(path):
        store.write_if(path, json.dumps({"id": uuid.uuid4().hex}).encode(), None)  # of two starts one wins
    if not store.exists(path):
        return None
    return parse_json(store.read(path, MAX_SIDECAR_BYTES, "local-tier job record"), path, "local-tier job record")


def _checked_job(record, path: str) -> Optional[str]:
    if record is None:
        return None
    job = record.get("id") if isinstance(record, dict) else None
    if not (isinstance(job, str) and 0 < len(job) <= 64 and job.isalnum()):
        raise FormatError(f"{path}: job id {job!r}, expected up to 64 letters or digits")
    return job


def piece_path(node_dir: str, iteration: int, rank: int) -> str:
    return os.path.join(iteration_dir(node_dir, iteration), f"rank_{rank:05d}.safetensors")


def encode(items: List[Tuple[str, Region]], arrays: List[Dict[str, np.ndarray]], meta: dict) -> bytes:
    """A piece's bytes: `arrays[i]` (state -> 1-D fp32) are region `items[i]`'s data."""
    tensors = {f"{i}.{state}": np.ascontiguousarray(a, dtype=np.float32)
               for i, states in enumerate(arrays) for state, a in states.items()}
    regions = [[name, r.part, list(r.offset), list(r.shape), r.start, r.stop] for name, r in items]
    return st_save(tensors, metadata={"ucp_local": json.dumps(dict(meta, regions=regions))})


def decode(data: bytes, path: str):
    """(meta, [(name, Region, {state: array})]) of a piece's bytes; FormatError names `path`."""
    from safetensors.numpy import load

    if len(data) < 8:
        raise FormatError(f"{path}: {len(data)} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(MAX_HEADER_BYTES, len(data) - 8):
        raise FormatError(f"{path}: header length {n} does not fit the file of {len(data)} bytes")
    try:
        header = json.loads(data[8:8 + n])
        meta = json.loads(header["__metadata__"]["ucp_local"])
        tensors = load(data)
        out = []
        for i, (name, part, offset, shape, start, stop) in enumerate(meta.pop("regions")):
            region = Region(part, tuple(offset), tuple(shape), int(start), int(stop))
            states = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == str(i)}
            out.append((name, region, states))
    except (ValueError, KeyError, TypeError) as e:
        raise FormatError(f"{path}: not a local-tier piece ({type(e).__name__}: {e})") from None
    return meta, out


def sidecar_path(node_dir: str, iteration: int, rank: int) -> str:
    return piece_path(node_dir, iteration, rank)[: -len(".safetensors")] + ".json"


def chunk_bytes_for(nbytes: int) -> int:
    """Pure: the chunk a piece of `nbytes` is checked by: CHUNK_BYTES, doubled until at most
    MAX_CHUNKS chunks make the piece."""
    chunk = CHUNK_BYTES
    while nbytes > chunk * MAX_CHUNKS:
        chunk *= 2
    return chunk


def write_piece(node_dir: str, iteration: int, rank: int, data: bytes, slot: dict = None) -> None:
    """The piece, then its sidecar (its slot: `slot`'s world and job, the rank and iteration;
    size, CRC-32, the chunks' CRC-32s): a piece without a sidecar does not count."""
    path = piece_path(node_dir, iteration, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_bytes(path, data)
    chunk, view = chunk_bytes_for(len(data)), memoryview(data)
    sums = [crc32(view[i:i + chunk]) for i in range(0, len(data), chunk)]
    atomic_write_json(sidecar_path(node_dir, iteration, rank),
                      dict(slot or {}, rank=rank, iteration=iteration, bytes=len(data), crc32=crc32(data),
                           chunk_bytes=chunk, chunk_crc32=sums))


def _count(record: dict, key: str, path: str, low: int = 0, high: Optional[int] = None) -> int:
    value = record.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"an integer >= {low}" + ("" if high is None else f" and <= {high}")
        raise FormatError(f"{path}: {key!r} is {value!r}, expected {bound}")
    return value


def sidecar(node_dir: str, iteration: int, rank: int) -> dict:
    """A piece's sidecar record (regular file, bounded, strict JSON), its integers checked:
    {"rank", "iteration", "world", "job", "bytes", "crc32", "chunk_bytes", "chunk_crc32"} (an
    older release's, without chunks: the piece as one chunk); FormatError naming the sidecar."""
    path = sidecar_path(node_dir, iteration, rank)
    record = read_json(path, "local-tier sidecar", MAX_SIDECAR_BYTES)
    if not isinstance(record, dict):
        raise FormatError(f"{path}: expected a JSON object")
    for key in ("bytes", "rank", "iteration"):
        _count(record, key, path)
    _count(record, "crc32", path, 0, 2**32 - 1)
    _count(record, "world", path, 1, MAX_WORLD)
    if "chunk_bytes" not in record and "chunk_crc32" not in record:
        return dict(record, chunk_bytes=max(1, record["bytes"]), chunk_crc32=[record["crc32"]] if record["bytes"] else [])
    chunk = _count(record, "chunk_bytes", path, 1)
    sums, count = record.get("chunk_crc32"), -(-record["bytes"] // chunk)
    if not (isinstance(sums, list) and len(sums) == count
            and all(type(c) is int and 0 <= c < 2**32 for c in sums)):
        raise FormatError(f"{path}: 'chunk_crc32' is not {count} CRC-32 values (one per {chunk} bytes "
                          f"of {record['bytes']})")
    return record


def header_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def read_header(path: str) -> Tuple[dict, dict, int, int, str]:
    """(meta, tensor table, header length, file size, header_digest) of a piece, reading its
    header only (a piece's size is judged from its regions before its data is read):
    FormatError naming it."""
    fd = open_regular(path, "local-tier piece")
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise FormatError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise FormatError(f"{path}: header length {n} does not fit the file of {size} bytes "
                              f"(at most {MAX_HEADER_BYTES})")
        raw = os.pread(fd, n, 8)
    finally:
        os.close(fd)
    try:
        table = json.loads(raw)
        meta = json.loads(table.pop("__metadata__")["ucp_local"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"{path}: not a local-tier piece ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or not isinstance(table, dict):
        raise FormatError(f"{path}: not a local-tier piece (its header is not a JSON object)")
    return meta, table, n, size, header_digest(raw)


def read_piece(node_dir: str, iteration: int, rank: int, nbytes: int, expected_crc: int, digest: str = None) -> bytes:
    """A piece's bytes, `nbytes` of them (its size as the plan bounds it) with CRC-32 `expected_crc`
    and, given `digest`, the header that was checked: IntegrityError naming the file otherwise.
    Only regular files are read (a FIFO would hang the restart), never past `nbytes`."""
    path = piece_path(node_dir, iteration, rank)
    try:
        data = read_bounded(path, "local-tier piece", nbytes)
    except (FormatError, IncompleteCheckpointError) as e:
        raise IntegrityError(f"{path}: unreadable ({e})") from None
    if len(data) != nbytes:
        raise IntegrityError(f"{path}: {len(data)} bytes, its sidecar says {nbytes}")
    found = crc32(data)
    if found != expected_crc:
        raise IntegrityError(f"{path}: CRC-32 {found:08x} differs from the saved {expected_crc:08x}")
    if digest is not None:
        n = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else 0
        if header_digest(data[8:8 + n]) != digest:
            raise IntegrityError(f"{path}: its header changed after it was checked")
    return data


def read_chunks(fd: int, path: str, nbytes: int, chunk: int, sums, first: int, last: int, buf) -> memoryview:
    """Chunks `first` .. `last` - 1 of the piece open as `fd` (`nbytes` long, `chunk` bytes per
    CRC-32 of `sums`), read into `buf` and checked (check_chunks): their bytes, a view of `buf`.
    Nothing is read past `nbytes`."""
    lo, hi = first * chunk, min(last * chunk, nbytes)
    view = memoryview(buf).cast("B")[:hi - lo]
    if len(view) < hi - lo:
        raise ValueError(f"read_chunks: a buffer of {len(view)} bytes for {hi - lo}")
    done, _ = vector_io(False, fd, [view], lo)
    check_chunks(view[:done], path, nbytes, chunk, sums, first, last, lo)
    return view


def check_chunks(data, path: str, nbytes: int, chunk: int, sums, first: int, last: int, lo: int = 0) -> None:
    """Chunks `first` .. `last` - 1 of a piece (`nbytes` long, `chunk` bytes per CRC-32 of
    `sums`) checked in `data`, the piece's bytes from byte `lo` on (a buffer read from it, or the
    whole file mapped): IntegrityError naming `path`, the chunk and its bytes, or the byte
    where the file ends short of them."""
    view = memoryview(data).cast("B")
    end = min(last * chunk, nbytes)
    if lo + len(view) < end:
        raise IntegrityError(f"{path}: ends at byte {lo + len(view)}, its sidecar says {nbytes}")
    for i in range(first, last):
        a, b = i * chunk - lo, min((i + 1) * chunk, nbytes) - lo
        found = crc32(view[a:b])
        if found != sums[i]:
            raise IntegrityError(f"{path}: bytes [{lo + a}, {lo + b}) (chunk {i}): CRC-32 {found:08x} differs "
                                 f"from the saved {sums[i]:08x}")


def check_new_chunks(data, path: str, nbytes: int, chunk: int, sums, start: int, end: int, checked: set) -> None:
    """The chunks holding bytes [start, end) of a piece (`data` from its byte 0 on) that are not
    in `checked` checked (check_chunks), each added to it once it passes: a reader or sender
    checks each chunk it touches once."""
    for i in range(*chunk_range(chunk, start, end)):
        if i not in checked:
            check_chunks(data, path, nbytes, chunk, sums, i, i + 1)
            checked.add(i)


class MappedPiece:
    """A piece's file mapped read-only: `data`, its bytes as the node's page cache holds them
    (np.uint8), as long as the file was when mapped. Its chunks are checked where they lie
    (check_chunks) and copied from there: no read into a buffer, then again out of it (on
    this machine's tmpfs: 1.0 GB/s that way, 3.9 GB/s mapped). A file shorter than its sidecar
    says fails the reads past its end, by name; one cut short while mapped would fault its
    reader (SIGBUS), which is why nothing here shortens a file in place: pieces are written
    whole and renamed into place, a staged file is sized once, before anyone maps it.
    `private`: mapped copy-on-write, so that `data` is writeable for APIs that ask it (a
    tensor to send from); a write would stay in this process, never reach the file."""

    def __init__(self, path: str, private: bool = False):
        fd = open_regular(path, "local-tier piece")
        try:
            size = os.fstat(fd).st_size
            flags = dict(flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) if private else dict(
                prot=mmap.PROT_READ)
            self._map = mmap.mmap(fd, size, **flags) if size else None
        finally:
            os.close(fd)  # the mapping keeps the file
        self.data = np.frombuffer(self._map, dtype=np.uint8) if self._map is not None else np.zeros(0, np.uint8)

    def close(self) -> None:
        self.data = None  # the mapping's last export, unless a view of it lives on
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still alive (an exception's frame): unmapped with it
                pass
            self._map = None


def chunk_range(chunk: int, start: int, end: int) -> Tuple[int, int]:
    """Pure: (first, last + 1) of the chunks that hold bytes [start, end)."""
    return start // chunk, -(-end // chunk)


def mark_complete(node_dir: str, iteration: int, world: int, job=None, padded_vocab_size: Optional[int] = None) -> None:
    """The marker names the job and records the saving model's padded vocabulary: a restart
    reads it before it builds its model (padding rows take part in the softmax; local_restore.peek)."""
    record = {"world": world, "job": job}
    if padded_vocab_size is not None:
        record["padded_vocab_size"] = int(padded_vocab_size)
    atomic_write_json(os.path.join(iteration_dir(node_dir, iteration), COMPLETE), record)
    fsync_dir(node_dir)


def marked_padded_vocab(node_dir: str, iteration: int) -> Optional[int]:
    """The padded vocabulary a COMPLETE marker records; None when it records none (a tier of an
    older release) or the marker is unreadable (markers() names those)."""
    try:
        record = read_json(os.path.join(iteration_dir(node_dir, iteration), COMPLETE),
                           "local-tier COMPLETE marker", MAX_SIDECAR_BYTES)
    except (FormatError, IncompleteCheckpointError):
        return None
    padded = record.get("padded_vocab_size") if isinstance(record, dict) else None
    return padded if type(padded) is int and padded > 0 else None


def markers(node_dir: str) -> Dict[int, Tuple[Optional[dict], Optional[str]]]:
    """Iteration -> (its COMPLETE marker {"world", "job"}, None), or (None, why it cannot be
    believed: a symlinked folder, a world beyond MAX_WORLD, an unreadable marker), of the
    iteration folders of this node that hold one."""
    out = {}
    if not os.path.isdir(node_dir):
        return out
    for name in os.listdir(node_dir):
        it = iteration_of(name)
        marker = os.path.join(node_dir, name, COMPLETE)
        if it is None or not os.path.lexists(marker):
            continue
        if os.path.islink(os.path.join(node_dir, name)):
            out[it] = None, f"{os.path.join(node_dir, name)} is a symbolic link (the tier writes folders)"
            continue
        try:
            record = read_json(marker, "local-tier COMPLETE marker", MAX_SIDECAR_BYTES)
            if not isinstance(record, dict):
                raise FormatError(f"{marker}: expected a JSON object")
            _count(record, "world", marker, 1, MAX_WORLD)
        except (FormatError, IncompleteCheckpointError) as e:
            out[it] = None, str(e)
            continue
        out[it] = record, None
    return out


def complete_iterations(node_dir: str) -> Dict[int, int]:
    """Iteration -> saving world size, of the iterations this node marked complete (soundly)."""
    return {it: record["world"] for it, (record, _) in markers(node_dir).items() if record is not None}


def held_ranks(node_dir: str, iteration: int) -> List[int]:
    """The saving ranks whose pieces (with a sidecar) this node holds of `iteration`."""
    folder = iteration_dir(node_dir, iteration)
    out = []
    for name in os.listdir(folder):
        if name.startswith("rank_") and name.endswith(".json"):
            try:
                out.append(int(name[len("rank_"):-len(".json")]))
            except ValueError:
                continue
    return sorted(out)


def _own(node_dir: str, iteration: int, job) -> bool:
    """The folder of `iteration` is a real folder that the tier marked as job `job`'s."""
    path = iteration_dir(node_dir, iteration)
    if os.path.islink(path) or not os.path.isdir(path):
        return False
    try:
        return read_json(os.path.join(path, MARK), "local-tier folder mark", MAX_SIDECAR_BYTES) == {"job": job}
    except (FormatError, IncompleteCheckpointError):
        return False


def own_folders(node_dir: str, job) -> List[str]:
    """The iteration folders of `node_dir` that the tier marked as job `job`'s."""
    if not os.path.isdir(node_dir):
        return []
    return [os.path.join(node_dir, name) for name in sorted(os.listdir(node_dir))
            if iteration_of(name) is not None and _own(node_dir, iteration_of(name), job)]


def prepare(node_dir: str, iteration: int, job) -> Optional[str]:
    """Before a save of `iteration` (the node's leader): a folder of it this job left (an older
    attempt) is removed, then the folder is made and marked as the job's. A folder the tier did
    not write for this job is left alone: returns why (the save of this iteration is skipped)."""
    path = iteration_dir(node_dir, iteration)
    if os.path.lexists(path):
        if not _own(node_dir, iteration, job):
            return (f"{path} exists and is not this job's (another job's local iteration, or a folder the "
                    "tier did not write): left alone, this iteration is not saved locally; remove it")
        shutil.rmtree(path)
    os.makedirs(path)
    atomic_write_json(os.path.join(path, MARK), {"job": job})
    return None


def prune(node_dir: str, keep: int, job) -> None:
    """Keep job `job`'s newest `keep` complete iterations; remove its older ones and its dead
    partial saves. Only folders the tier marked as this job's are removed: never a persistent
    checkpoint, nor another job's."""
    complete = sorted(it for it, (record, _) in markers(node_dir).items()
                      if record is not None and record.get("job") == job and _own(node_dir, it, job))
    if not complete:
        return
    kept = set(complete[-keep:])
    for name in os.listdir(node_dir):
        it = iteration_of(name)
        if it is not None and it not in kept and it < max(kept) and _own(node_dir, it, job):
            shutil.rmtree(os.path.join(node_dir, name), ignore_errors=True)
