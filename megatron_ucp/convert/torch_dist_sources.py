"""Where an atomic tensor's states lie in a torch_dist checkpoint, and one state read from there.

The plan (torch_dist_plan.py) gives each atomic tensor its boxes: the parts of the whole (TP = 1)
parameter under megatron's checkpoint keys, in the model's coordinates, where the weights and
optimizer state kept in model space are read. Under `dp_reshardable` the optimizer state lies
instead in the source ranks' bucket tensors, one TP-local slice per rank (torch_dist_buckets.py),
reassembled here through the layout rules (`layout.pieces`). Only the chunks that overlap what is
wanted are read (`DcpReader.read_box`).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from megatron_ucp.convert.dcp_reader import DcpReader
from megatron_ucp.format.layout import PADDING, Rule, pieces


@dataclass
class Box:
    """A piece of the whole (TP = 1) parameter: checkpoint key, global box, flat destination."""

    key: str
    offsets: tuple
    sizes: tuple
    dest: int
    numel: int


@dataclass
class FlatSource:
    """One source rank's TP-local parameter inside a `dp_reshardable` bucket tensor."""

    bucket: str  # the bucket's key without the state suffix
    offset: int
    numel: int
    tp_rank: int
    tp: int  # its TP size (expert TP for experts)


@dataclass
class Atomic:
    """One atomic tensor: how the source split it, its shape, and where its states lie."""

    name: str
    rule: Rule
    shape: tuple
    padded_rows: Optional[int]  # vocabulary rows with padding (vocab rule), else None
    states: tuple
    buffer: bool
    boxes: List[Box] = field(default_factory=list)
    flat: List[FlatSource] = field(default_factory=list)
    prefixes: Dict[str, str] = field(default_factory=dict)  # model space: state -> key prefix

    @property
    def padding_rows(self) -> int:
        return (self.padded_rows - self.shape[0]) if self.padded_rows else 0


def from_buckets(entry: Atomic, reader: DcpReader, state: str) -> Dict[str, np.ndarray]:
    """One state from every source rank's TP-local slice in its bucket tensor (`dp_reshardable`)."""
    parts = {"": np.empty(entry.shape, dtype=np.float32)}
    if entry.padding_rows:
        parts[PADDING] = np.empty((entry.padding_rows,) + tuple(entry.shape[1:]), dtype=np.float32)
    for src in entry.flat:
        flat = reader.read_box(f"{src.bucket}.{state}", (src.offset,), (src.numel,))
        for p in pieces(entry.rule, entry.shape, src.tp, src.tp_rank, entry.padded_rows):
            box = tuple(slice(o, o + n) for o, n in zip(p.offset, p.shape))
            parts[p.part][box] = flat[p.local_start:p.local_start + p.numel].reshape(p.shape)
    return parts


def from_boxes(entry: Atomic, reader: DcpReader, prefix: str, suffix: str = "") -> Dict[str, np.ndarray]:
    """The whole (TP = 1) tensor from its boxes, each read at `prefix + key + suffix`, split into
    tensor and padding."""
    rows = entry.padded_rows or (entry.shape[0] if entry.shape else None)
    full_shape = ((rows,) + tuple(entry.shape[1:])) if entry.shape else ()
    if len(entry.boxes) == 1:  # one box holds the whole parameter: use it as read
        b = entry.boxes[0]
        whole = reader.read_box(prefix + b.key + suffix, b.offsets, b.sizes).reshape(full_shape)
    else:
        whole = np.empty(full_shape, dtype=np.float32)
        flat = whole.reshape(-1)
        for b in entry.boxes:
            flat[b.dest:b.dest + b.numel] = reader.read_box(prefix + b.key + suffix, b.offsets, b.sizes).reshape(-1)
    if not entry.padding_rows:
        return {"": whole}
    return {"": whole[:entry.shape[0]], PADDING: whole[entry.shape[0]:]}
