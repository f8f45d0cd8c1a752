"""Write a universal checkpoint from atomic tensors assembled one at a time: the converters'
shared output half.

A converter supplies, per atomic tensor, its manifest entry (shape, vocabulary mark, padding rows, states)
and a function that assembles one state at a time as `{part: array}` ('' for the tensor,
layout.PADDING for its vocabulary padding rows). Each file is written once, sequentially, with
its block checksums computed from memory; `workers` forked processes write tensors in
parallel. The commit is the save's (folder.begin/commit), so a failed or killed conversion
leaves no half checkpoint behind.
"""

import dataclasses
import math
import multiprocessing
import os
import shutil
import time
from typing import Callable, Dict

import numpy as np

from megatron_ucp.convert import output_folder
from megatron_ucp.errors import ConfigError, FormatError, SaveError
from megatron_ucp.format import checksums, durability, folder, manifest as mf
from megatron_ucp.format.folder import iteration_dir
from megatron_ucp.format.layout import PADDING
from megatron_ucp.format.tensor_entry import TensorEntry, file_layout


class _CrcWriter:
    """Sequential writes with block CRC-32s of the data section computed on the way."""

    def __init__(self, f):
        self.f, self.crcs, self.crc, self.filled = f, [], 0, 0

    def write(self, array: np.ndarray) -> None:
        raw = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        self.f.write(raw)
        pos, block = 0, checksums.BLOCK_BYTES
        while pos < len(raw):
            take = min(block - self.filled, len(raw) - pos)
            self.crc = checksums.crc32(raw[pos:pos + take], self.crc)
            self.filled += take
            pos += take
            if self.filled == block:
                self.crcs.append(f"{self.crc:08x}")
                self.crc, self.filled = 0, 0

    def finish(self) -> list:
        if self.filled:
            self.crcs.append(f"{self.crc:08x}")
        return self.crcs


def write_tensor_file(path: str, meta: TensorEntry, assemble: Callable[[str], Dict[str, np.ndarray]]) -> list:
    """One atomic file: each state as `assemble(state)` gives it, the small padding parts kept
    for the end of the file (their place in the layout); returns the block checksums."""
    layout = file_layout(meta)
    padding = {}
    with open(path, "wb") as f:
        f.write(layout.header)
        out = _CrcWriter(f)
        for state in meta.states:
            parts = assemble(state)
            out.write(parts.pop(""))
            if PADDING in parts:
                padding[state] = parts.pop(PADDING)
            del parts
        for state in meta.states:
            if state in padding:
                out.write(padding.pop(state))
        f.flush()
        os.fsync(f.fileno())
    if os.path.getsize(path) != layout.file_size:
        raise FormatError(f"{path}: wrote {os.path.getsize(path)} bytes, its layout needs {layout.file_size}")
    return out.finish()


_JOB = None  # (metas, opener) set in the parent before the pool forks; workers read it


def worker_count(asked: int, tensors: int) -> int:
    """The writer processes to start: as many as asked, but no more than there are tensors to
    write or CPUs this process may run on (a process more is memory, not speed)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(asked, tensors, cpus))


def _write_one(args):
    name, tmp = args
    metas, opener = _JOB
    meta = metas[name]
    crcs = write_tensor_file(os.path.join(tmp, meta.file), meta, opener(name))
    return name, meta.written(file_layout(meta).file_size, checksums.BLOCK_BYTES, crcs)


def write_checkpoint(output_dir: str, iteration: int, metas: Dict[str, TensorEntry], opener, head: mf.Manifest,
                     rng: Dict[int, dict], workers: int = 1, progress: bool = True, started: float = None) -> dict:
    """Write every tensor of `metas` (`opener(name)` returns its state assembler), the RNG files
    and the manifest (`head` plus the tensors' entries); commit; return the summary, timed from
    `started` (a `time.perf_counter()` value: the conversion's start, planning included)."""
    start = time.perf_counter() if started is None else started
    final = iteration_dir(output_dir, iteration)
    if os.path.exists(final):
        raise ConfigError(f"{final} exists already; choose another --output")
    mf.check_written(head, final)  # before any file: a value the reader would refuse is never written
    with output_folder.owned(output_dir, iteration, "universal"):
        entries = _write_all(output_dir, iteration, metas, opener, head, rng, workers, progress)
    seconds = time.perf_counter() - start
    nbytes = sum(e.file_size for e in entries.values())
    return {"iteration": iteration, "output": final, "tensors": len(entries), "bytes": nbytes,
            "seconds": seconds, "GB/s": nbytes / seconds / 1e9}


def _check_room(folder: str, needed: int) -> None:
    """Before any file: a SaveError when `folder`'s file system has less room than the tensor
    files take (an object-store output is staged on local disk whole: store_output.py)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if free < needed:
        raise SaveError(f"{folder}: disk full: {free / 1e9:.3f} GB free, the checkpoint's tensor files take "
                        f"{needed / 1e9:.3f} GB; nothing was written: free space or choose another folder "
                        "(--staging-dir for an object-store output)")


def _write_all(output_dir, iteration, metas, opener, head, rng, workers, progress) -> dict:
    """Write into a temporary folder and commit it; the entries written."""
    global _JOB
    from tqdm import tqdm

    tmp = folder.begin(output_dir, iteration)
    # Largest first: the pool's tail is short, and memory peaks early where it shows.
    names = sorted(metas, key=lambda n: -math.prod(metas[n].shape))
    total = sum(file_layout(m).file_size for m in metas.values())
    entries = {}
    workers = worker_count(workers, len(names))
    _JOB = (metas, opener)
    try:
        _check_room(tmp, total)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="converting", disable=not progress)
        jobs = [(n, tmp) for n in names]
        if workers > 1:
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                results = pool.imap_unordered(_write_one, jobs)
                for name, meta in results:
                    entries[name] = meta
                    bar.update(meta.file_size)
        else:
            for job in jobs:
                name, meta = _write_one(job)
                entries[name] = meta
                bar.update(meta.file_size)
        bar.close()
        for rank, state in rng.items():
            durability.atomic_write_json(folder.rng_file(os.path.join(tmp, "rng"), rank), state)
        manifest = dataclasses.replace(head, tensors=dict(sorted(entries.items())))
        folder.commit(output_dir, tmp, iteration, manifest.to_json())
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        full = output_folder.disk_full(e, output_dir)
        if full is not None:
            raise full from e
        raise
    finally:
        _JOB = None
    return entries
