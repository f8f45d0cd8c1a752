"""Reading a torch DCP (`torch_dist`) checkpoint without a process group: its metadata, the
boxes of its global tensors chunk by chunk, its sharded objects, and megatron's common state.

Each chunk is a `torch.save` blob at a recorded offset of a `.distcp` file; the metadata and
the blobs are unpickled by safe_pickle's restricted reader (a checkpoint is input from
strangers), the files opened as regular files only (safe_files).
"""

import math
import os
from typing import Dict

import numpy as np

from megatron_ucp.errors import FormatError, IncompleteCheckpointError
from megatron_ucp.format import safe_files

class DcpReader:
    """Boxes of a torch DCP checkpoint's global tensors, read chunk by chunk (`pread`, no
    process group). Each chunk is a `torch.save` blob at a recorded offset of a `.distcp` file."""

    def __init__(self, iter_dir: str):
        from megatron_ucp.convert.safe_pickle import read_dcp_metadata

        self.dir = iter_dir
        path = os.path.join(iter_dir, ".metadata")
        if not os.path.lexists(path):
            raise IncompleteCheckpointError(f"{path}: missing; is {iter_dir} a torch_dist checkpoint?")
        self.meta = read_dcp_metadata(iter_dir)  # restricted unpickling: no code runs from it
        self._fds: Dict[str, int] = {}
        self._bounds: Dict[str, set] = {}

    def keys(self):
        return self.meta.state_dict_metadata.keys()

    def tensor(self, fqn: str):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = self.meta.state_dict_metadata.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise FormatError(f"{self.dir}: the checkpoint has no tensor {fqn!r}")
        return md

    def has_tensor(self, fqn: str) -> bool:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        return isinstance(self.meta.state_dict_metadata.get(fqn), TensorStorageMetadata)

    def shape(self, fqn: str) -> tuple:
        return tuple(self.tensor(fqn).size)

    def chunk_bounds(self, fqn: str) -> set:
        """Start and end of every saved chunk of a 1-D tensor."""
        if fqn not in self._bounds:
            out = set()
            for c in self.tensor(fqn).chunks:
                out.update((c.offsets[0], c.offsets[0] + c.sizes[0]))
            self._bounds[fqn] = out
        return self._bounds[fqn]

    def _raw(self, fqn: str, index) -> bytes:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.meta.storage_data.get(MetadataIndex(fqn, index))
        if info is None:
            raise IncompleteCheckpointError(f"{self.dir}: no storage recorded for {fqn!r} at {index}")
        if info.transform_descriptors:
            raise FormatError(f"{self.dir}: {fqn!r} is stored with transforms {info.transform_descriptors}; "
                              "not supported")
        path = safe_files.safe_join(self.dir, info.relative_path)  # the metadata is data: no escapes
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = safe_files.open_regular(path, f"torch_dist data file (holding {fqn!r})")
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0
                and 0 <= info.length <= os.fstat(fd).st_size - info.offset):
            raise IncompleteCheckpointError(f"{path}: {fqn!r} is recorded at bytes {info.offset}+{info.length}, "
                                            f"beyond the file's {os.fstat(fd).st_size} (truncated?)")
        raw = os.pread(fd, info.length, info.offset)
        if len(raw) != info.length:
            raise IncompleteCheckpointError(f"{path}: truncated, {fqn!r} needs bytes {info.offset}.."
                                            f"{info.offset + info.length}")
        return raw

    def _load(self, raw: bytes, where: str, stand_ins=()):
        from megatron_ucp.convert.safe_pickle import torch_load

        return torch_load(raw, where, stand_ins=stand_ins)

    def read_object(self, fqn: str, stand_ins=()):
        """A sharded object; `stand_ins` as safe_pickle.torch_load takes them (inert classes in
        place of another program's)."""
        return self._load(self._raw(fqn, None), f"{self.dir}: {fqn!r}", stand_ins)

    def read_box(self, fqn: str, offsets, sizes) -> np.ndarray:
        """The fp32 box [offsets, offsets + sizes) of global tensor `fqn`."""
        import torch

        md = self.tensor(fqn)
        if any(o < 0 or o + n > g for o, n, g in zip(offsets, sizes, md.size)) or len(offsets) != len(md.size):
            raise FormatError(f"{self.dir}: {fqn!r} has shape {list(md.size)}, the model needs the box at "
                              f"{list(offsets)} of size {list(sizes)}")
        out, covered = None, 0
        for c in md.chunks:
            lo = [max(a, b) for a, b in zip(c.offsets, offsets)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(c.offsets, c.sizes, offsets, sizes)]
            if any(x >= y for x, y in zip(lo, hi)):
                continue
            t = self._load(self._raw(fqn, c.offsets), f"{self.dir}: {fqn!r} chunk at {list(c.offsets)}")
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(c.sizes):
                raise FormatError(f"{self.dir}: {fqn!r} chunk at {list(c.offsets)} is not a tensor of "
                                  f"shape {list(c.sizes)}")
            if t.dtype != torch.float32:
                raise FormatError(f"{self.dir}: {fqn!r} is {t.dtype}; the converter reads fp32 state (an "
                                  "fp32 master copy, where the optimizer keeps one)")
            if tuple(c.offsets) == tuple(offsets) and tuple(c.sizes) == tuple(sizes):
                return t.numpy()  # the chunk is the box: no copy
            if out is None:
                out = np.empty(tuple(sizes), dtype=np.float32)
            src = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, c.offsets))
            dst = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, offsets))
            out[dst] = t.numpy()[src]
            covered += math.prod(y - x for x, y in zip(lo, hi))
            del t
        if covered != math.prod(sizes):
            raise IncompleteCheckpointError(f"{self.dir}: {fqn!r}: the saved chunks cover {covered} of the "
                                            f"{math.prod(sizes)} elements at {list(offsets)} size {list(sizes)}")
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


COMMON_STATE = "common_state/shard_0_1"  # megatron-core 0.19's common state, inside the DCP files


def read_common(iter_dir: str) -> dict:
    """A torch_dist checkpoint's common (not sharded) state: arguments, iteration, scheduler,
    optimizer param groups. megatron-core 0.16 writes it to `common.pt`; 0.19 stores it as the
    sharded object `common_state` in the checkpoint's own files (serialization.save). Chosen by
    what the folder holds, not by the installed release: either converts under either."""
    from megatron_ucp.convert.safe_pickle import load_file

    path = os.path.join(iter_dir, "common.pt")
    if os.path.lexists(path):
        common = load_file(path, "torch_dist common state")
        if not isinstance(common, dict):
            raise FormatError(f"{path}: holds {type(common).__name__}, expected a dict (the common state)")
        return common
    if not os.path.lexists(os.path.join(iter_dir, ".metadata")):
        raise IncompleteCheckpointError(f"{path}: missing (and no .metadata that could hold the common state); "
                                        f"is {iter_dir} a torch_dist checkpoint?")
    reader = DcpReader(iter_dir)
    try:
        if COMMON_STATE not in reader.keys():
            raise IncompleteCheckpointError(f"{iter_dir}: neither common.pt nor {COMMON_STATE!r} in .metadata: "
                                            "the checkpoint's common state (arguments, iteration) is missing")
        common = unwrap_object(reader.read_object(COMMON_STATE))
    finally:
        reader.close()
    if not isinstance(common, dict):
        raise FormatError(f"{iter_dir}: {COMMON_STATE!r} holds {type(common).__name__}, expected a dict")
    return common


def unwrap_object(obj):
    """megatron's sharded objects come back inside a one-element list."""
    while isinstance(obj, list) and len(obj) == 1 and isinstance(obj[0], (list, dict)):
        obj = obj[0]
    return obj
