"""The memory a `torch.save` file may take when loaded, bounded before torch reads it.

A `torch.save` file is a zip archive; `torch.load` reads each entry (the pickle `data.pkl`,
the tensor records `data/<n>`) into a buffer of the size the central directory declares and
inflates DEFLATEd entries into it. A bound on the file's size on disk is therefore no bound:
DEFLATE reaches ~1000:1, so a 2 MB file can declare a 2 GB pickle. `check` reads the central
directory with zipfile (itself bounded: its size and the entry count, before zipfile parses it)
and refuses, before anything is inflated,

- more entries than any checkpoint file holds, or a count the end record and directory disagree on;
- entries torch cannot read as they claim (not stored or DEFLATEd; a stored entry whose sizes
  differ, or which ends past the file);
- a total of declared sizes over `max_bytes`, counting every entry torch reads into memory: all
  of them, less the stored tensor records when they cost no more than their bytes on disk (a
  memory-mapped load, or bytes the caller holds already; `count_stored_data=False`).

A lying directory cannot take more: torch allocates the declared size and inflates into it
without growing it. Each DEFLATEd entry is still read through zipfile once, in chunks, up to
its declared size, so that its stream and checksum agree with what it declares.
"""

import io
import os
import zipfile

from megatron_ucp.errors import FormatError

MAX_ENTRIES = 2**18  # torch.save writes one entry per storage (+5): 20,000 tensors are 20,006
MAX_CENTRAL_DIRECTORY = 16 * 2**20  # ~64 bytes an entry as torch writes them: 2**18 fit
MAX_LOADED_BYTES = 256 * 2**20  # a pickle of arguments, RNG and optimizer records, small tensors
_CHUNK = 2**20


def is_zip(f) -> bool:
    """What torch.load takes for its zip format (the local header's magic, as torch checks)."""
    f.seek(0)
    return f.read(4) == b"PK\x03\x04"


def _end_record(f, where: str) -> list:
    try:
        end = zipfile._EndRecData(f)  # zipfile's own reader of the end record (3.8 .. 3.13)
    except OSError as e:
        raise FormatError(f"{where}: not a readable zip file ({e})") from None
    if end is None:
        raise FormatError(f"{where}: a zip file without its end record (truncated?); not a torch.save file")
    return end


def _is_tensor_record(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 3 and parts[1] == "data"


def _entries(f, where: str, size: int) -> list:
    end = _end_record(f, where)
    count, directory = end[zipfile._ECD_ENTRIES_TOTAL], end[zipfile._ECD_SIZE]
    if count > MAX_ENTRIES or directory > MAX_CENTRAL_DIRECTORY:
        raise FormatError(f"{where}: its zip directory lists {count} entries in {directory} bytes; expected "
                          f"at most {MAX_ENTRIES} entries in {MAX_CENTRAL_DIRECTORY} bytes")
    try:
        infos = zipfile.ZipFile(f).infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise FormatError(f"{where}: not a readable zip file ({e})") from None
    if len(infos) != count:
        raise FormatError(f"{where}: its zip directory holds {len(infos)} entries, its end record says {count}")
    for i in infos:
        if i.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise FormatError(f"{where}: zip entry {i.filename!r} uses compression method {i.compress_type}; "
                              "torch reads stored or DEFLATEd entries only")
        if i.compress_type == zipfile.ZIP_STORED and i.compress_size != i.file_size:
            raise FormatError(f"{where}: stored zip entry {i.filename!r} declares {i.file_size} bytes and holds "
                              f"{i.compress_size}")
        if i.header_offset + i.compress_size > size:
            raise FormatError(f"{where}: zip entry {i.filename!r} ends past the file's {size} bytes")
    return infos


def entries(path: str, where: str) -> list:
    """The zip entries (zipfile.ZipInfo) of a torch.save file, its directory bounded before
    zipfile parses it (`_entries`)."""
    try:
        with open(path, "rb") as f:
            return _entries(f, where, f.seek(0, os.SEEK_END))
    except OSError as e:
        raise FormatError(f"{where}: not a readable zip file ({e})") from None


def _inflates_as_declared(archive: zipfile.ZipFile, info, where: str) -> None:
    """Read a DEFLATEd entry through zipfile, never past its declared size (zipfile stops there
    and checks the CRC-32 at the end)."""
    left = info.file_size
    try:
        with archive.open(info) as stream:
            while left > 0:
                chunk = stream.read(min(_CHUNK, left))
                if not chunk:
                    break
                left -= len(chunk)
    except Exception as e:  # noqa: BLE001 -- BadZipFile (CRC), zlib.error, EOFError: a damaged stream
        raise FormatError(f"{where}: zip entry {info.filename!r} does not inflate ({type(e).__name__}: {e})") from None
    if left:
        raise FormatError(f"{where}: zip entry {info.filename!r} inflates to {info.file_size - left} bytes, "
                          f"declares {info.file_size}")


def check_zip(f, where: str, max_bytes: int = MAX_LOADED_BYTES, count_stored_data: bool = True) -> None:
    """Refuse a torch.save zip (an open binary file) whose loading could take more than
    `max_bytes`, before anything is inflated (see the module docstring)."""
    size = f.seek(0, os.SEEK_END)
    infos = _entries(f, where, size)
    counted = [i for i in infos
               if count_stored_data or i.compress_type != zipfile.ZIP_STORED or not _is_tensor_record(i.filename)]
    total = sum(i.file_size for i in counted)
    if total > max_bytes:
        largest = max(counted, key=lambda i: i.file_size)
        raise FormatError(f"{where}: its zip entries inflate to {total} bytes ({largest.filename!r} alone to "
                          f"{largest.file_size}, {largest.compress_size} on disk); expected at most {max_bytes} "
                          "(refused before inflating)")
    deflated = [i for i in infos if i.compress_type == zipfile.ZIP_DEFLATED]
    if deflated:
        archive = zipfile.ZipFile(f)
        for i in deflated:
            _inflates_as_declared(archive, i, where)


class Window(io.RawIOBase):
    """Bytes [offset, offset + length) of a seekable binary file, read as a file of their own
    (a torch DCP item inside its `.distcp` file)."""

    def __init__(self, f, offset: int, length: int):
        super().__init__()
        self._f, self._start, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if not n:
            return 0
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)


def check(source, where: str, max_bytes: int = MAX_LOADED_BYTES, count_stored_data: bool = True) -> None:
    """check_zip of a path or of bytes; a file in torch's older (not zip) format is bounded by its
    size, which its unpickling reads as it is."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        f = io.BytesIO(source)
    else:
        f = open(source, "rb")  # noqa: SIM115 -- closed below
    with f:
        if is_zip(f):
            check_zip(f, where, max_bytes, count_stored_data)
        elif f.seek(0, os.SEEK_END) > max_bytes:
            raise FormatError(f"{where}: {f.tell()} bytes of a pickle (not torch's zip format); expected at most "
                              f"{max_bytes}")
