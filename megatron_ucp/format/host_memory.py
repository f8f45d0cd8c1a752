"""Host buffers that are filled at once: a load's optimizer moments and read buffers, an
asynchronous save's staging copies.

Fresh anonymous memory costs a page fault per 4 KiB on first touch, and filling a few hundred
MiB that way costs more CPU than the copy itself. Such buffers are advised to use transparent
huge pages (one fault per 2 MiB) where the kernel leaves that to the program
(`/sys/kernel/mm/transparent_hugepage/enabled` = madvise, the common default). Best effort: off
Linux, or with `UCP_HUGE_PAGES=0`, the buffers are plain allocations.
"""

import ctypes
from typing import Optional

import numpy as np
import torch

from megatron_ucp import settings
from megatron_ucp.format.durability import libc_function

HUGE_PAGE = 2 * 2**20
_MADV_HUGEPAGE = 14
_MADVISE = libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def huge_range(address: int, nbytes: int, page: int = HUGE_PAGE) -> Optional[tuple[int, int]]:
    """The whole `page`-aligned pages inside [address, address + nbytes), as (start, length);
    None when there is not one (madvise needs aligned starts; a huge page must lie inside)."""
    start = -(-address // page) * page
    stop = (address + nbytes) // page * page
    return (start, stop - start) if stop > start else None


def _enabled() -> bool:
    return _MADVISE is not None and settings.huge_pages()


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask for huge pages under a CPU tensor's memory; returns whether the advice was taken."""
    if not _enabled() or tensor.device.type != "cpu":
        return False
    span = huge_range(tensor.data_ptr(), tensor.numel() * tensor.element_size())
    if span is None:
        return False
    return _MADVISE(span[0], span[1], _MADV_HUGEPAGE) == 0


def empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """torch.empty_like, on huge pages where it is a CPU tensor spanning whole ones."""
    out = torch.empty_like(tensor)
    advise_huge_pages(out)
    return out


def empty_fp32(numel: int, pinned: bool = False) -> np.ndarray:
    """An uninitialised flat fp32 array on huge pages where possible; page-locked (`pinned`,
    for copies from a GPU: the driver copies them at full speed, without a bounce buffer) where
    CUDA is there. Pinning costs once: callers keep such buffers across saves."""
    if pinned and torch.cuda.is_available():
        return torch.empty(numel, dtype=torch.float32, pin_memory=True).numpy()
    out = torch.empty(numel, dtype=torch.float32)
    advise_huge_pages(out)
    return out.numpy()
