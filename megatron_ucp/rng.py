"""Per-rank random-number-generator state: restored exactly on the same layout, else reseeded.

Stored as JSON lists of integers (no pickle): python's `random`, numpy's legacy global state,
torch's CPU generator, the CUDA generator when present, and megatron's named tracker states.
"""

import os
import random

import numpy as np
import torch
from megatron.core import tensor_parallel

from megatron_ucp import storage


def _path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank:05d}.json")


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
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    version, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((version, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.set_states({k: torch.tensor(v, dtype=torch.uint8) for k, v in state["tracker"].items()})


def save(directory: str, rank: int, state: dict = None) -> None:
    """Write `state` (by default, the state now) as this rank's RNG file."""
    storage.atomic_write_json(_path(directory, rank), state if state is not None else capture())


def load(directory: str, rank: int) -> None:
    restore(storage.read_json(_path(directory, rank), f"RNG state of rank {rank}"))
