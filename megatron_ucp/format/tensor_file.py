"""The safetensors file of one atomic tensor: its header and where each state's bytes lie.

Each consolidated parameter ("atomic tensor") lives in its own safetensors file holding several
equally-shaped tensors (param, exp_avg, exp_avg_sq, ...). The header is a pure function of the
entries, so every process computes the same data offsets without reading the file; a header
read from disk is trusted in nothing (read_header).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from megatron_ucp.errors import FormatError, IntegrityError, LayoutError
from megatron_ucp.format.safe_files import open_regular, read_exact

# safetensors dtype string -> numpy dtype (safetensors data is little-endian), and back.
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}


DTYPE_NAMES: dict[np.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}


MAX_HEADER_BYTES = 100 * 2**20


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
        (n,) = struct.unpack("<Q", read_exact(fd, 8, 0, path, "header length"))
        if n > max_header_bytes or n > size - 8:
            raise FormatError(f"{path}: header claims {n} bytes; the limit is {max_header_bytes} "
                              f"and the file has {size}")
        raw = bytes(read_exact(fd, n, 8, path, "header"))
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
