"""Every `UCP_*` environment variable the package reads, in one place, with one error.

Each is read when asked, not at import, so a launcher or a test sets it per run. A value that
does not parse is a ConfigError naming the variable and what it takes; nothing falls back to the
default silently. The training flags cover what a user sets per job; these are the knobs of the
I/O engine for a machine or file system that wants other values.
"""

import os

from megatron_ucp.errors import ConfigError

# name -> (default, what it does); README and docs/design.md describe them.
VARIABLES = {
    "UCP_IO_THREADS": ("4", "files in flight per rank (reads, writes, fsync, checksums)"),
    "UCP_MAPPED_WRITES": ("1", "0: every write a pwrite, never through a shared mapping"),
    "UCP_MERGE_ROWS": ("1", "0: TP column blocks written where they are, not merged into rows"),
    "UCP_HUGE_PAGES": ("1", "0: no transparent huge pages under staging and read buffers"),
    "UCP_INLINE_HASH_BYTES": (str(256 * 2**10), "reads shorter than this are hashed after the load"),
}


def _raw(name: str) -> str:
    return os.environ.get(name, VARIABLES[name][0]).strip()


def positive_int(name: str) -> int:
    raw = _raw(name)
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"environment variable {name}={raw!r}: expected a positive integer")
    return int(raw)


def switch(name: str) -> bool:
    raw = _raw(name)
    if raw not in ("0", "1"):
        raise ConfigError(f"environment variable {name}={raw!r}: expected 0 or 1")
    return raw == "1"


def io_threads() -> int:
    return positive_int("UCP_IO_THREADS")


def mapped_writes() -> bool:
    return switch("UCP_MAPPED_WRITES")


def merge_rows() -> bool:
    return switch("UCP_MERGE_ROWS")


def huge_pages() -> bool:
    return switch("UCP_HUGE_PAGES")


def inline_hash_bytes() -> int:
    """Reads shorter than this (a TP rank's half rows) are not hashed inline by a verified load
    (engine/verify.py): each would be a piece to gather and combine. The pass after the load
    hashes those bytes, from the page cache the load has just filled."""
    return positive_int("UCP_INLINE_HASH_BYTES")
