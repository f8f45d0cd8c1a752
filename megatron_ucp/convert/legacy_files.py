"""Megatron-LM's legacy per-rank `torch` checkpoint on disk: its folder and file names, and its
files opened for the converter.

`iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt`, with `distrib_optim.pt` beside it under the
distributed optimizer (the training application writes the same names, train/legacy.py). The
converter opens each file once per process with `torch.load(mmap=True, weights_only=True)`
(safe_pickle: no code runs from it): tensor data stays on disk until read, and `release` gives
a tensor's pages back after use, so memory holds the tensors in flight, not the checkpoint.
"""

import os

from megatron_ucp.errors import IncompleteCheckpointError, LayoutError
from megatron_ucp.format.folder import RANK_DIR, is_legacy  # noqa: F401 - is_legacy: the converters' name for it

MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """Megatron-LM's per-rank folder: mp_rank_TT, or mp_rank_TT_PPP with pipeline parallelism."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def parse_rank_dir(name: str):
    """'mp_rank_01_002' -> (tp_rank 1, pp_rank 2); expert-parallel folders are refused."""
    m = RANK_DIR.match(name)
    if not m:
        return None
    if m.group(3) is not None:
        raise LayoutError(f"{name}: expert-parallel legacy checkpoints (mp_rank_TT_PPP_EEE) are not supported")
    return int(m.group(1)), int(m.group(2) or 0)


_LOADED: dict = {}  # path -> the file's objects, tensors mmap'ed (per process)


def torch_load(path: str):
    """torch.load(mmap=True, weights_only=True), once per file and process: tensor data stays
    on disk until read, and `release` gives the pages back after use."""
    from megatron_ucp.convert.safe_pickle import load_file

    if path in _LOADED:
        return _LOADED[path]
    if not os.path.lexists(path):
        raise IncompleteCheckpointError(f"{path}: missing")
    obj = load_file(path, "legacy checkpoint file", mmap=True)  # weights_only: no code runs from it
    _LOADED[path] = obj
    return obj


def forget_loaded() -> None:
    """Forget the files this process opened (after a conversion; a later one opens them anew)."""
    _LOADED.clear()


_PAGE = os.sysconf("SC_PAGE_SIZE")
_MADV_DONTNEED = 4


def release(t) -> None:
    """Drop the resident pages of an mmap'ed tensor (read-only private mapping: they are
    re-read from the file if touched again), so memory stays bounded by the tensors in flight."""
    import ctypes

    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    start = t.data_ptr() // _PAGE * _PAGE
    length = -(-(t.data_ptr() + nbytes - start) // _PAGE) * _PAGE
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED)
