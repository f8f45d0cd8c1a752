"""Per-rank random-number-generator state: restored exactly on the same layout, else reseeded.

Stored as JSON lists of integers (no pickle): python's `random`, numpy's legacy global state,
torch's CPU generator, the CUDA generator when present, and megatron's named tracker states.
"""

import os
import random

import numpy as np
import torch
from megatron.core import tensor_parallel

from megatron_ucp.errors import FormatError, IncompleteCheckpointError
from megatron_ucp.format import durability, manifest as mf, safe_files
from megatron_ucp.format.folder import rng_file


def _bytes(t: torch.Tensor) -> list:
    return t.to(torch.uint8).tolist()


def capture() -> dict:
    version, keys, pos, has_gauss, cached = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [version, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": _bytes(torch.get_rng_state()),
        "cuda": _bytes(torch.cuda.get_rng_state()) if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
        "tracker": {k: _bytes(v) for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }


def restore(state: dict) -> None:
    """Set every generator from `state` (as `read` returns it: checked)."""
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    version, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((version, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.set_states({k: torch.tensor(v, dtype=torch.uint8) for k, v in state["tracker"].items()})


def problems(state) -> list:
    """What makes `state` unusable by `restore` in this process (manifest.rng_problems), with
    the lengths of this process's own generators and its tracker's names: the generators'
    setters fail with bare TypeErrors or, worse, accept a short state."""
    tracker = {k: v.numel() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    return mf.rng_problems(state, torch.get_rng_state().numel(), tracker)


def save(directory: str, rank: int, state: dict = None) -> None:
    """Write `state` (by default, the state now) as this rank's RNG file."""
    durability.atomic_write_json(rng_file(directory, rank), state if state is not None else capture())


def read(directory: str, rank: int) -> dict:
    """This rank's RNG state, checked: FormatError naming the file and key, or
    IncompleteCheckpointError naming --no-load-rng when the file is missing."""
    path = rng_file(directory, rank)
    if not os.path.lexists(path):
        raise IncompleteCheckpointError(
            f"{path}: RNG state of rank {rank} is missing; load with load_rng=False (--no-load-rng) "
            "to reseed instead")
    return checked(safe_files.read_json(path, f"RNG state of rank {rank}"), path)


def checked(state, path: str) -> dict:
    """`state` if `restore` can use it, else FormatError naming `path` and the key at fault."""
    found = problems(state)
    if found:
        raise FormatError(mf.rng_problem_message(path, found[0]))
    return state


def load(directory: str, rank: int) -> None:
    restore(read(directory, rank))
