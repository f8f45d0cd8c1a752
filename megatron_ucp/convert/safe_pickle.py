"""Pickled checkpoint bytes, read without running code from them: the one way in.

Megatron's formats pickle: torch_dist's `.metadata` (torch DCP's `Metadata`, a plain
`pickle.load` in torch's `FileSystemReader`), the objects inside `.distcp` files (megatron's
RNG state and other `ShardedObject`s, which torch's loader unpickles with `weights_only=False`),
`common.pt` and the legacy per-rank `model_optim_rng.pt` / `distrib_optim.pt` (`torch.save`).
A pickle may call any function it names, so a checkpoint from a stranger could run code. Here:

- raw pickles (`.metadata`) go through an unpickler that resolves only the classes DCP metadata
  is made of (listed below, found by saving real checkpoints: tests/test_hostile_files.py
  checks the list against a fresh save);
- `torch.save` files and blobs go through `torch.load(weights_only=True)`, with the few extra
  classes Megatron-LM's files hold (its `argparse.Namespace` arguments, numpy RNG state), after
  format/zip_bounds.py has bounded what their zip entries inflate to (a DEFLATEd pickle of
  GBs fits in a file of MBs); `torch_load` is the package's only torch.load;
- megatron's own loader reads through `megatron_reader()` (DCP metadata and objects as above,
  data files only if regular files inside the checkpoint), after `check_torch_file` has
  vetted the `torch.save` files it loads itself (`common.pt`, `distrib_optim.pt`; bounded too).

Anything else is refused with a FormatError naming the file and the class.
"""

import argparse
import contextlib
import io
import os
import pickle
import re

from megatron_ucp.errors import FormatError
from megatron_ucp.format import safe_files, zip_bounds

# What torch DCP's `.metadata` pickle names (torch 2.13; megatron-core 0.16 adds no class of its own).
# Calling any of them builds plain data; none runs a command or opens a file.
_DCP = "torch.distributed.checkpoint"
DCP_METADATA_CLASSES = frozenset({
    ("torch", "Size"), ("torch", "float32"), ("torch", "float16"), ("torch", "bfloat16"),
    ("torch", "float64"), ("torch", "int64"), ("torch", "int32"), ("torch", "int16"), ("torch", "int8"),
    ("torch", "uint8"), ("torch", "bool"), ("torch", "strided"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of torch's own dcp.save(checkpoint_id=Path)
    (f"{_DCP}.filesystem", "_StorageInfo"),
    (f"{_DCP}.metadata", "Metadata"), (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "StorageMeta"), (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"), (f"{_DCP}.metadata", "BytesStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"), (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
    (f"{_DCP}.planner", "SavePlan"), (f"{_DCP}.planner", "WriteItem"),
    (f"{_DCP}.planner", "WriteItemType"), (f"{_DCP}.planner", "TensorWriteData"),
})
MAX_DCP_METADATA_BYTES = 2**30  # a few MB for billions of parameters; the file is held in memory


def _numpy_classes() -> list:
    """numpy's RNG state as Megatron-LM saves it (`np.random.get_state()`: an array of uint32)."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return [np.ndarray, np.dtype, _reconstruct, type(np.dtype(np.uint32))]


def torch_load_classes() -> list:
    """Classes torch.load(weights_only=True) is allowed beyond torch's own tensors and dtypes."""
    return [argparse.Namespace] + _numpy_classes()


def _allowed_torch_names() -> set:
    return {f"{c.__module__}.{c.__qualname__}" for c in torch_load_classes()}


class _Restricted(pickle.Unpickler):
    def __init__(self, file, path, allowed):
        super().__init__(file)
        self._path, self._allowed = path, allowed

    def find_class(self, module, name):
        if (module, name) not in self._allowed:
            raise FormatError(f"{self._path}: refused to unpickle {module}.{name}: not a class this "
                              "checkpoint format holds (a checkpoint must not run code)")
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise FormatError(f"{self._path}: refused a persistent id in the pickle (not DCP metadata)")


def loads_restricted(raw: bytes, path, allowed=DCP_METADATA_CLASSES):
    """Unpickle `raw` resolving only the (module, name) pairs in `allowed`."""
    try:
        return _Restricted(io.BytesIO(raw), path, allowed).load()
    except FormatError:
        raise
    except Exception as e:  # noqa: BLE001 -- any damage in the pickle: one error naming the file
        raise FormatError(f"{path}: not a readable pickle ({type(e).__name__}: {e})") from None


def read_dcp_metadata(iter_dir: str):
    """torch DCP's `Metadata` of a torch_dist checkpoint folder, unpickled restrictedly."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(iter_dir, ".metadata")
    raw = safe_files.read_bounded(path, "torch_dist metadata", MAX_DCP_METADATA_BYTES, iter_dir)
    meta = loads_restricted(raw, path)
    if not isinstance(meta, Metadata):
        raise FormatError(f"{path}: holds a {type(meta).__name__}, expected torch DCP Metadata")
    return meta


_UNSUPPORTED = re.compile(r"(?:GLOBAL|global|Unsupported class|unsupported global:?)\s+([\w.]+)")


def _refused_class(message: str) -> str:
    found = _UNSUPPORTED.search(message)
    return found.group(1) if found else ""


def torch_load(source, where, mmap: bool = False, stand_ins=(), max_bytes: int = zip_bounds.MAX_LOADED_BYTES,
               tensor_data_on_disk: bool = False):
    """torch.load(weights_only=True) of a file path or bytes, with torch_load_classes() allowed;
    a refused class or damaged bytes -> FormatError naming `where` (and the class).
    `stand_ins`: (our class, "module.Name") pairs: a pickle naming `module.Name` gets our class
    (inert data holders for another program's records), never the named one.
    What it may inflate is bounded first (zip_bounds: `max_bytes`, the entry count): tensor
    records stored as they are count only when read from a path without `mmap` (bytes in
    memory or a mapping cost nothing more) and not `tensor_data_on_disk` (a checkpoint's own
    tensors, as large as its file)."""
    import torch

    in_memory = isinstance(source, (bytes, bytearray, memoryview))
    zip_bounds.check(source, where, max_bytes, count_stored_data=not (in_memory or mmap or tensor_data_on_disk))
    if in_memory:
        source = io.BytesIO(source)
    try:
        with torch.serialization.safe_globals(torch_load_classes() + list(stand_ins)):
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 -- any unpickling failure: refused, naming the file
        cls = _refused_class(str(e))
        what = f"refused to unpickle {cls} (weights_only)" if cls else f"cannot be read safely (weights_only): {e}"
        raise FormatError(f"{where}: {what}") from None


def load_file(path: str, what: str, root=None, mmap: bool = False, stand_ins=(), tensor_data_on_disk: bool = False):
    """torch_load of a regular file inside `root` (its folder by default)."""
    root = os.path.dirname(os.path.abspath(path)) if root is None else root
    os.close(safe_files.open_regular(path, what, root))
    return torch_load(path, f"{what} {path}", mmap=mmap, stand_ins=stand_ins, tensor_data_on_disk=tensor_data_on_disk)


def check_torch_file(path: str, what: str, root=None, tensor_data_on_disk: bool = False) -> None:
    """Vet a torch.save file that megatron loads itself: a regular file inside `root` whose
    pickle names only classes torch_load allows (reads the pickle, not the tensor data), and
    whose loading inflates no more than torch_load allows (`tensor_data_on_disk`: its stored
    tensor records are the checkpoint's own data, as large as the file, and not counted)."""
    import torch

    root = os.path.dirname(os.path.abspath(path)) if root is None else root
    os.close(safe_files.open_regular(path, what, root))
    zip_bounds.check(path, f"{what} {path}", count_stored_data=not tensor_data_on_disk)
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # noqa: BLE001 -- not a torch.save zip file
        raise FormatError(f"{what} {path}: not a torch.save file ({type(e).__name__}: {e})") from None
    refused = sorted(set(unsafe) - _allowed_torch_names())
    if refused:
        raise FormatError(f"{what} {path}: refused to unpickle {', '.join(refused)} "
                          "(not a class this checkpoint format holds; a checkpoint must not run code)")


# ---------------------------------------------------------------- megatron's own loader


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType

    class _CheckedFileSystem(FileSystem):
        """Reads only regular files inside the checkpoint folder (metadata paths are data)."""

        def __init__(self, root):
            self._root = os.fspath(root)

        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if "r" not in mode or "+" in mode:
                raise FormatError(f"{path}: the checkpoint reader does not write")
            fd = safe_files.open_regular(path, "torch_dist data file", self._root)
            with os.fdopen(fd, "rb") as stream:
                yield stream

    class _SafeBytes:
        """The load planner, but DCP byte items (megatron's ShardedObjects: RNG state...) are
        unpickled by torch_load instead of torch's `torch.load(weights_only=False)`."""

        def __init__(self, planner, where):
            if type(planner).load_bytes is not DefaultLoadPlanner.load_bytes:
                raise FormatError(f"{where}: planner {type(planner).__name__} loads bytes its own way; "
                                  "megatron_ucp.convert.safe_pickle cannot vouch for it")
            self._planner, self._where = planner, where

        def __getattr__(self, name):
            return getattr(self._planner, name)

        def load_bytes(self, read_item, value):
            from torch.distributed.checkpoint._traverse import set_element

            p, fqn = self._planner, read_item.dest_index.fqn
            obj = torch_load(value.getvalue(), f"{self._where}: object {fqn!r}")
            if p.flatten_state_dict:
                set_element(p.original_state_dict, p.mappings[fqn], obj)
            else:
                p.state_dict[fqn] = obj

    class SafeFileSystemReader(FileSystemReader):
        """torch's FileSystemReader with restricted unpickling and checked files (see module)."""

        def __init__(self, path):
            super().__init__(path)
            self.fs = _CheckedFileSystem(self.path)
            self._cached_metadata = None

        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:
                raise FormatError(f"{self.path}: per-rank DCP metadata files are not read")
            if self._cached_metadata is None:
                meta = read_dcp_metadata(os.fspath(self.path))
                if getattr(meta, "storage_meta", None) is None:
                    meta.storage_meta = StorageMeta()
                meta.storage_meta.load_id = self.load_id
                self._cached_metadata = meta
            return self._cached_metadata

        def read_data(self, plan, planner):
            self._check_items(plan)
            if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
                planner = _SafeBytes(planner, os.fspath(self.path))
            return super().read_data(plan, planner)

        def _check_items(self, plan):
            """torch's reader torch.loads each tensor item itself: every item's blob bounded
            first (zip_bounds: what it inflates to; its stored bytes are the file's own), inside
            its file, and none through a transform (a decompressing extension) either."""
            per_file = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                where = f"{os.fspath(self.path)}: {item.storage_index.fqn!r}"
                if info.transform_descriptors:
                    raise FormatError(f"{where} is stored with transforms {info.transform_descriptors}; not read")
                per_file.setdefault(info.relative_path, []).append((info, where))
            for relative_path, infos in per_file.items():
                path = self.fs.concat_path(self.path, relative_path)
                with self.fs.create_stream(path, "rb") as stream:
                    size = os.fstat(stream.fileno()).st_size
                    for info, where in infos:
                        if not (isinstance(info.offset, int) and isinstance(info.length, int)
                                and 0 <= info.offset and 0 <= info.length <= size - info.offset):
                            raise FormatError(f"{where} is recorded at bytes {info.offset}+{info.length} of "
                                              f"{path}, beyond its {size}")
                        zip_bounds.check_zip(zip_bounds.Window(stream, info.offset, info.length), where,
                                             count_stored_data=False)

    return SafeFileSystemReader


@contextlib.contextmanager
def megatron_reader():
    """While active, megatron-core's torch_dist loader reads through SafeFileSystemReader."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as strategies

    reader = _reader_class()
    # megatron-core 0.19's serialization imports it by name too (it reads the common state, kept
    # inside the DCP files since then, through it); 0.16's does not have it.
    modules = [m for m in (strategies, serialization) if hasattr(m, "_get_filesystem_reader")]
    originals = [m._get_filesystem_reader for m in modules]
    for m in modules:
        # (checkpoint_dir, cache_metadata) in 0.16, and async_strategy since 0.19: a reader either way
        m._get_filesystem_reader = lambda checkpoint_dir, *args, **kwargs: reader(checkpoint_dir)
    try:
        yield
    finally:
        for m, original in zip(modules, originals):
            m._get_filesystem_reader = original
