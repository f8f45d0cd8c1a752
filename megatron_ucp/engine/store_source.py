"""A universal checkpoint in an object store, read as load.py reads a folder (its `source`):
the manifest and RNG states as whole small objects, tensor bytes as ranged GETs of exactly the
runs this rank owns (runs closer than UCP_S3_COALESCE_BYTES, default 0, fetched by one GET
that spans the gap: fewer requests for more bytes), and the checks of a verified load (size,
header, block checksums: verify.py) through the same ranged reads. Every byte a GET returns is
counted in the load's ReadCounter (`calls`: GETs).
"""

import bisect
import os

import numpy as np

from megatron_ucp.errors import IncompleteCheckpointError, IntegrityError
from megatron_ucp.format import manifest as mf, safe_files, storage, stores, tensor_io
from megatron_ucp.format.checksums import crc32
from megatron_ucp.format.folder import rng_file
from megatron_ucp.format.store_inspection import check_object
from megatron_ucp.mcore import rng


def coalesce_bytes() -> int:
    raw = os.environ.get("UCP_S3_COALESCE_BYTES", "0").strip()
    return int(raw) if raw.isdigit() else 0


def coalesce(spans, gap: int) -> list:
    """Pure: sorted disjoint byte spans [lo, hi) merged where at most `gap` bytes apart."""
    out = []
    for lo, hi in sorted(spans):
        if out and lo - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [tuple(s) for s in out]


class StoreSource:
    """load_universal's `source` for an iteration folder `root` in an object store."""

    verifies = True  # verify.py's checks run through check_file / crc_spans

    @property
    def threads(self) -> int:
        """Reads in flight per rank: a GET waits on the network, not on a core."""
        return getattr(self.store, "threads", 1)

    def __init__(self, root: str):
        self.root, self.store = root, stores.store_for(root)
        self.manifest = mf.read_manifest(root)

    def rng(self, rank: int) -> dict:
        path = rng_file(storage.join(self.root, "rng"), rank)
        if not self.store.exists(path):
            raise IncompleteCheckpointError(
                f"{path}: RNG state of rank {rank} is missing; load with load_rng=False (--no-load-rng) "
                "to reseed instead")
        what = f"RNG state of rank {rank}"
        state = safe_files.parse_json(self.store.read(path, safe_files.MAX_RNG_BYTES, what), path, what)
        return rng.checked(state, path)

    def path(self, tensor: str) -> str:
        return storage.join(self.root, self.manifest.tensors[tensor].file)

    def read_runs(self, tensor: str, layout, name: str, runs, out: np.ndarray, counter=None,
                  hash_spans=(), hashes=None) -> int:
        """tensor_io.read_runs's interface, `tensor` (the atomic tensor's name) in place of the
        file's path: ranged GETs of the runs' bytes, hashing the `hash_spans` they cover."""
        path = self.path(tensor)
        groups = tensor_io.read_groups(layout, name, runs, out, f"{path}, tensor {name!r}")
        if not groups:
            return 0
        spans = [(lo, lo + sum(n for _, n in parts)) for lo, parts in groups]
        fetch = coalesce(spans, coalesce_bytes())
        blobs = self.store.read_ranges(path, fetch)
        raw = memoryview(out.reshape(-1).view(np.uint8))
        starts = [lo for lo, _ in fetch]
        for (lo, parts), (_, hi) in zip(groups, spans):
            k = bisect.bisect_right(starts, lo) - 1
            blob, at = memoryview(blobs[k]), lo - fetch[k][0]
            for dest, n in parts:
                raw[dest:dest + n] = blob[at:at + n]
                at += n
            if hash_spans:
                i = bisect.bisect_left(hash_spans, (lo, lo))
                while i < len(hash_spans) and hash_spans[i][1] <= hi:
                    a, b = hash_spans[i]
                    hashes.append((a, b, crc32(blob[a - fetch[k][0]:b - fetch[k][0]])))
                    i += 1
        requested = sum(hi - lo for lo, hi in fetch)
        if counter is not None:
            counter.bytes += requested
            counter.calls += len(fetch)
        return requested

    def check_file(self, name: str, entry) -> list:
        """inspection.check_file's problems, from the object's size and header bytes."""
        return check_object(self.store, self.root, name, entry)

    def check_header(self, name: str, entry) -> None:
        problems = self.check_file(name, entry)
        if problems and "manifest records bad checksums" not in problems[0]:
            raise IntegrityError(problems[0])

    def crc_spans(self, name: str, spans) -> list:
        return [crc32(b) for b in self.store.read_ranges(self.path(name), spans)]
