"""One atomic tensor's manifest entry (docs/FORMAT.md 4.3), typed: what its file holds and, once
the file is written, its size and block checksums.

An entry is frozen: a writer makes it with `TensorEntry.new` before the file exists and takes a
copy with the file's size and checksums (`written`) once they are known. `from_json` checks what
every reader relies on (file name, shape, padding rows, states, the vocabulary mark) and names
the file and the tensor at fault; the size and checksums are kept as recorded, for
inspection.check_header and check_file to judge against the file itself.
"""

import re
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from megatron_ucp.errors import FormatError, LayoutError
from megatron_ucp.format.layout import PADDING, Rule, padding_shape
from megatron_ucp.format.tensor_file import TensorFileLayout

STATES = ("param", "exp_avg", "exp_avg_sq")
DTYPE = "F32"  # every tensor of every file (docs/FORMAT.md 3)
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def tensor_file(name: str) -> str:
    if not _SAFE_NAME.match(name) or ".." in name:
        raise FormatError(f"atomic tensor name {name!r} is not a safe file name")
    return f"tensors/{name}.safetensors"


@dataclass(frozen=True)
class TensorEntry:
    """The manifest entry of one atomic tensor. `vocab`: its rows are the vocabulary (the
    padding part holds `padding_rows` more); `buffer`: a model buffer without optimizer state.
    `file_size`, `block_bytes`, `checksums`: None until the file is written; read, as the
    manifest records them (inspection.check_file judges them)."""

    file: str
    shape: Tuple[int, ...]
    padding_rows: int
    states: Tuple[str, ...]
    vocab: bool = False
    buffer: bool = False
    dtype: str = DTYPE
    file_size: Optional[int] = None
    block_bytes: Optional[int] = None
    checksums: Optional[Tuple[str, ...]] = None  # 8 hex digits per block of the data section

    @classmethod
    def new(cls, name: str, shape, vocab: bool, padding_rows: int, states, buffer: bool = False) -> "TensorEntry":
        """The entry of tensor `name` before its file's size and checksums are known."""
        return cls(file=tensor_file(name), shape=tuple(int(d) for d in shape), padding_rows=int(padding_rows),
                   states=tuple(states), vocab=bool(vocab), buffer=bool(buffer))

    def written(self, file_size: int, block_bytes: int, checksums) -> "TensorEntry":
        """This entry once its file is written: its size and block checksums recorded."""
        return replace(self, file_size=file_size, block_bytes=block_bytes, checksums=tuple(checksums))

    def to_json(self) -> dict:
        """The entry as the manifest records it: the marks only when true, the file's facts
        only once known."""
        out = {"file": self.file, "shape": list(self.shape), "dtype": self.dtype,
               "padding_rows": self.padding_rows, "states": list(self.states)}
        if self.vocab:
            out["vocab"] = True
        if self.buffer:
            out["buffer"] = True
        if self.file_size is not None:
            out["file_size"] = self.file_size
        if self.block_bytes is not None:
            out["block_bytes"] = self.block_bytes
        if self.checksums is not None:
            out["checksums"] = list(self.checksums) if isinstance(self.checksums, tuple) else self.checksums
        return out

    @classmethod
    def from_json(cls, name: str, obj, path: str, version: int) -> "TensorEntry":
        """The entry of tensor `name` in the manifest `path` (format `version`), checked: a
        FormatError names the file, the tensor and the key at fault. A version-1 entry's
        vocabulary rule becomes the `vocab` mark (its other rules were the layout's: dropped);
        its file keeps the version-1 name (format_v1.upgrade_tensors renames the entry)."""
        def bad(message):  # the message is made only for an entry refused: a manifest has many
            return FormatError(f"{path}: tensor {name!r}: {message}")

        if not isinstance(obj, dict):
            raise bad("not an object")
        file = tensor_file(name)
        if obj.get("file") != file:
            raise bad(f"file {obj.get('file')!r}, expected {file!r}")
        shape = obj.get("shape")
        if not (isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < 2**40 for d in shape)):
            raise bad(f"bad shape {shape!r}")
        padding_rows = obj.get("padding_rows", 0)
        if not (isinstance(padding_rows, int) and padding_rows >= 0):
            raise bad("bad padding_rows")
        states = obj.get("states")
        if not (isinstance(states, list) and states and all(s in STATES for s in states)):
            raise bad(f"bad states {states!r}")
        if tuple(states) not in (STATES, STATES[:1]):
            raise bad(f"states {states!r}, expected {list(STATES)} or {list(STATES[:1])} (docs/FORMAT.md)")
        dtype = obj.get("dtype", DTYPE)
        if dtype != DTYPE:
            raise bad(f"dtype {dtype!r}, expected {DTYPE!r} (the format holds fp32 states)")
        if version == 1:
            try:
                vocab = Rule.from_json(obj.get("rule") or {}).kind == "vocab"
            except (KeyError, LayoutError, TypeError, ValueError) as e:
                raise bad(f"bad rule {obj.get('rule')!r} ({e})") from None
        else:
            vocab = obj.get("vocab", False)
            if not isinstance(vocab, bool):
                raise bad("'vocab' is not true or false")
        sums = obj.get("checksums")
        return cls(file=file, shape=tuple(shape), padding_rows=padding_rows, states=tuple(states),
                   vocab=vocab, buffer=bool(obj.get("buffer", False)), dtype=dtype,
                   file_size=obj.get("file_size"), block_bytes=obj.get("block_bytes"),
                   checksums=tuple(sums) if isinstance(sums, list) else sums)


def file_entries(shape, states, padding_rows: int) -> list:
    """The tensors inside one atomic file: each state, then each state's vocabulary padding."""
    entries = [(s, tuple(shape), DTYPE) for s in states]
    if padding_rows:
        entries += [(f"{PADDING}.{s}", padding_shape(shape, padding_rows), DTYPE) for s in states]
    return entries


def file_tensor_name(state: str, part: str) -> str:
    """The name inside the file of one state of one part ('' the tensor, or the padding)."""
    return state if not part else f"{part}.{state}"


def file_layout(entry: TensorEntry) -> TensorFileLayout:
    """Where each tensor of the entry's file lies: the header and offsets every writer produces."""
    return TensorFileLayout.build(file_entries(entry.shape, entry.states, entry.padding_rows))
