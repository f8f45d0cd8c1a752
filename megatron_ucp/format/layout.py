"""Layout rules: which part of an atomic tensor a rank's local tensor holds. Pure functions.

An *atomic tensor* is one parameter of one layer (one expert), fully consolidated. A rank's
local tensor is made of *pieces*: each piece is a contiguous range of the local tensor's flat
(row-major) elements that holds one box of the atomic tensor. Every rule used by megatron-core
GPT models yields pieces of that form, which makes distributed-optimizer fragments (contiguous
ranges of the flattened local tensor) easy to map: intersect, then walk the box.

Vocabulary tensors carry a second part, "padding": the rows Megatron adds to make the
vocabulary divisible by `make_vocab_size_divisible_by x TP`. They are not part of the model, but
they take part in the softmax, so we keep the rows that were saved and restore those that fit.
"""

from dataclasses import dataclass
from math import prod
from typing import List, Optional, Tuple

import numpy as np

from megatron_ucp.errors import LayoutError

MAIN = ""  # the atomic tensor proper
PADDING = "padding"  # vocabulary padding rows, kept beside it


@dataclass(frozen=True)
class Rule:
    """How megatron-core shards one parameter over tensor parallelism.

    kind: "replicated" (every TP rank holds all of it), "split" (even split along `dim`),
    "gated" (SwiGLU fc1: each rank holds [gate_r; up_r] along dim 0), "vocab" (split along dim 0
    of the padded vocabulary; the atomic tensor holds the true rows only).
    """

    kind: str
    dim: int = 0

    def __post_init__(self):
        if self.kind not in ("replicated", "split", "gated", "vocab"):
            raise LayoutError(f"unknown layout rule {self.kind!r}")
        if self.kind in ("gated", "vocab") and self.dim != 0:
            raise LayoutError(f"rule {self.kind!r} splits dim 0, got dim {self.dim}")

    def to_json(self) -> dict:
        return {"kind": self.kind, "dim": self.dim}

    @classmethod
    def from_json(cls, obj: dict) -> "Rule":
        return cls(kind=obj["kind"], dim=int(obj.get("dim", 0)))


class _Extent:
    """The element count of a record with a `shape`."""

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class Piece(_Extent):
    """Local flat elements [local_start, local_start + numel) hold `box` of atomic `part`."""

    local_start: int
    part: str
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]


def _even(size: int, parts: int, what: str) -> int:
    if parts < 1 or size % parts:
        raise LayoutError(f"{what}: size {size} does not split evenly over {parts} ranks")
    return size // parts


def local_shape(rule: Rule, atomic_shape, tp: int, padded_rows: Optional[int] = None) -> tuple:
    """Shape of the tensor a rank holds under `rule` with TP size `tp`."""
    shape = list(atomic_shape)
    if rule.kind == "replicated":
        return tuple(shape)
    if rule.kind == "vocab":
        if padded_rows is None or padded_rows < shape[0]:
            raise LayoutError(f"vocab rule needs padded rows >= {shape[0]}, got {padded_rows}")
        shape[0] = _even(padded_rows, tp, "padded vocabulary")
        return tuple(shape)
    if rule.kind == "gated":
        half = _even(shape[0], 2, "gated (SwiGLU) tensor")
        shape[0] = 2 * _even(half, tp, "gated (SwiGLU) half")
        return tuple(shape)
    shape[rule.dim] = _even(shape[rule.dim], tp, f"dim {rule.dim}")
    return tuple(shape)


def atomic_shape_from_local(rule: Rule, local, tp: int, vocab_rows: Optional[int] = None) -> tuple:
    """Inverse of `local_shape` (for vocab, the true number of rows must be given)."""
    shape = list(local)
    if rule.kind == "vocab":
        shape[0] = vocab_rows
    elif rule.kind in ("gated", "split"):
        shape[rule.dim] *= tp
    return tuple(shape)


def _row_stride(shape) -> int:
    return prod(shape[1:])


def pieces(rule: Rule, atomic_shape, tp: int, tp_rank: int, padded_rows: Optional[int] = None,
           padding_rows_held: Optional[int] = None) -> List[Piece]:
    """The pieces of rank `tp_rank`'s local tensor, in local order.

    For the vocab rule, `padding_rows_held` is how many padding rows the padding part has (on
    load: how many were saved); local rows beyond them belong to no piece (they start at zero).
    """
    if not 0 <= tp_rank < tp:
        raise LayoutError(f"tensor-parallel rank {tp_rank} outside 0..{tp - 1}")
    atomic_shape = tuple(atomic_shape)
    loc = local_shape(rule, atomic_shape, tp, padded_rows)
    zeros = (0,) * len(atomic_shape)
    if rule.kind == "replicated":
        return [Piece(0, MAIN, zeros, atomic_shape)]
    if rule.kind == "split":
        offset = list(zeros)
        offset[rule.dim] = tp_rank * loc[rule.dim]
        return [Piece(0, MAIN, tuple(offset), loc)]
    stride = _row_stride(atomic_shape)
    if rule.kind == "gated":
        rows = loc[0] // 2
        half = atomic_shape[0] // 2
        return [
            Piece(0, MAIN, (tp_rank * rows,) + zeros[1:], (rows,) + loc[1:]),
            Piece(rows * stride, MAIN, (half + tp_rank * rows,) + zeros[1:], (rows,) + loc[1:]),
        ]
    # vocab
    vocab = atomic_shape[0]
    held = padded_rows - vocab if padding_rows_held is None else padding_rows_held
    first, last = tp_rank * loc[0], (tp_rank + 1) * loc[0]
    out = []
    true_end = min(last, vocab)
    if first < true_end:
        out.append(Piece(0, MAIN, (first,) + zeros[1:], (true_end - first,) + loc[1:]))
    pad_start, pad_end = max(first, vocab), min(last, vocab + held)
    if pad_start < pad_end:
        out.append(Piece((pad_start - first) * stride, PADDING, (pad_start - vocab,) + zeros[1:],
                         (pad_end - pad_start,) + loc[1:]))
    return out


@dataclass(frozen=True)
class Box(_Extent):
    """Local flat elements [local_start, local_start + numel) hold `box` (offset, shape) of a
    global tensor, the padded one for vocabulary tensors: one megatron ShardedTensor."""

    local_start: int
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]


def box_pieces(boxes, atomic_shape, padded_rows: Optional[int] = None,
               padding_rows_held: Optional[int] = None) -> List[Piece]:
    """The pieces of a local tensor described by its boxes, in local order.

    Without `padded_rows` each box is one piece of the atomic tensor. A vocabulary tensor's
    boxes are rows of the padded vocabulary: rows below the true vocabulary (atomic_shape[0])
    belong to the tensor, the next `padding_rows_held` (default: all) to its padding part, any
    further rows to no piece (on load they start at zero).
    """
    atomic_shape = tuple(atomic_shape)
    if padded_rows is None:
        for b in boxes:
            _check_box(b, atomic_shape)
        return [Piece(b.local_start, MAIN, tuple(b.offset), tuple(b.shape))
                for b in sorted(boxes, key=lambda b: b.local_start)]
    vocab = atomic_shape[0]
    held = padded_rows - vocab if padding_rows_held is None else padding_rows_held
    rest = atomic_shape[1:]
    stride = _row_stride(atomic_shape)
    out = []
    for b in sorted(boxes, key=lambda b: b.local_start):
        _check_box(b, (padded_rows,) + rest)
        if any(b.offset[1:]) or tuple(b.shape[1:]) != rest:
            raise LayoutError(f"a vocabulary box must hold whole rows, got offset {b.offset} shape {b.shape} "
                              f"of {(padded_rows,) + rest}")
        first, last = b.offset[0], b.offset[0] + b.shape[0]
        zeros = (0,) * len(rest)
        if first < min(last, vocab):
            out.append(Piece(b.local_start, MAIN, (first,) + zeros, (min(last, vocab) - first,) + rest))
        pad_start, pad_end = max(first, vocab), min(last, vocab + held)
        if pad_start < pad_end:
            out.append(Piece(b.local_start + (pad_start - first) * stride, PADDING,
                             (pad_start - vocab,) + zeros, (pad_end - pad_start,) + rest))
    return out


def _check_box(b: Box, shape) -> None:
    if len(b.offset) != len(shape) or len(b.shape) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(b.offset, b.shape, shape)):
        raise LayoutError(f"box offset {tuple(b.offset)} shape {tuple(b.shape)} outside tensor {tuple(shape)}")


def boxes_of(rule: Rule, atomic_shape, tp: int, tp_rank: int, padded_rows: Optional[int] = None) -> List[Box]:
    """The boxes megatron gives rank `tp_rank` under `rule` (the rules are the oracle of the
    mapping from megatron's sharded state dict, and describe converted source layouts)."""
    if rule.kind != "vocab":
        return [Box(p.local_start, p.offset, p.shape) for p in pieces(rule, atomic_shape, tp, tp_rank)]
    loc = local_shape(rule, atomic_shape, tp, padded_rows)
    return [Box(0, (tp_rank * loc[0],) + (0,) * (len(loc) - 1), tuple(loc))]


def infer_rule(atomic_shape, part_shape, halves: bool, vocab: bool) -> Rule:
    """The tensor-parallel rule of a source layout whose ranks hold `part_shape` of a tensor:
    the rank's local tensor, or one chunk a torch_dist checkpoint saved of it. `halves`: megatron
    packs two halves in the parameter (SwiGLU fc1: two boxes at TP 1); `vocab`: it pads the
    vocabulary. A converter reads the geometry of a layout it does not run this way, from what
    megatron's description of the model (at TP 1) and the saved shapes say."""
    if vocab:
        return Rule("vocab")
    atomic_shape, part_shape = tuple(atomic_shape), tuple(part_shape)
    if len(atomic_shape) != len(part_shape):
        raise LayoutError(f"a part of shape {list(part_shape)} of a tensor of shape {list(atomic_shape)}")
    cut = [d for d, (a, p) in enumerate(zip(atomic_shape, part_shape)) if a != p]
    if not cut:
        return Rule("replicated")
    if len(cut) > 1 or part_shape[cut[0]] > atomic_shape[cut[0]] or atomic_shape[cut[0]] % part_shape[cut[0]]:
        raise LayoutError(f"a part of shape {list(part_shape)} does not evenly split one dimension of a tensor "
                          f"of shape {list(atomic_shape)}")
    if halves:
        if cut != [0]:
            raise LayoutError(f"a packed (SwiGLU) tensor of shape {list(atomic_shape)} split along dim {cut[0]}")
        return Rule("gated")
    return Rule("split", cut[0])


def padding_shape(atomic_shape, padding_rows: int) -> tuple:
    return (padding_rows,) + tuple(atomic_shape[1:])


@dataclass(frozen=True)
class Region:
    """Box-flat elements [start, stop) of `box` (offset, shape) of atomic `part`.

    Layout-free: two ranks holding the same Region hold the same bytes.
    """

    part: str
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def fragment_regions(piece_list: List[Piece], start: int, stop: int) -> List[Tuple[int, Region]]:
    """The regions that local flat elements [start, stop) hold, each with its local start."""
    out = []
    for p in piece_list:
        lo, hi = max(start, p.local_start), min(stop, p.local_start + p.numel)
        if lo < hi:
            out.append((lo, Region(p.part, p.offset, p.shape, lo - p.local_start, hi - p.local_start)))
    return out


def region_runs(part_shape, region: Region) -> np.ndarray:
    """Contiguous runs of `region` in the part's row-major layout.

    Returns an int64 array of rows (region_pos, part_flat_start, length), region_pos counted
    from region.start, sorted, adjacent runs merged.
    """
    part_shape = tuple(part_shape)
    box_shape, offset = region.shape, region.offset
    for d, (o, s, n) in enumerate(zip(offset, box_shape, part_shape)):
        if o < 0 or s < 0 or o + s > n:
            raise LayoutError(f"box offset {offset} shape {box_shape} outside tensor {part_shape}")
    if not 0 <= region.start <= region.stop <= prod(box_shape):
        raise LayoutError(f"range [{region.start}, {region.stop}) outside box of {prod(box_shape)}")
    if region.start == region.stop:
        return np.zeros((0, 3), dtype=np.int64)
    ndim = len(part_shape)
    # Innermost dims where the box spans the whole tensor are contiguous with the one before.
    k = ndim - 1
    while k > 0 and box_shape[k] == part_shape[k]:
        k -= 1
    inner = prod(box_shape[k:]) if ndim else 1
    strides = [prod(part_shape[d + 1:]) for d in range(ndim)]
    base = sum(o * s for o, s in zip(offset, strides))
    outer_shape = box_shape[:k]
    first_row, last_row = region.start // inner, (region.stop - 1) // inner
    rows = np.arange(first_row, last_row + 1, dtype=np.int64)
    idx = np.array(np.unravel_index(rows, outer_shape)) if outer_shape else np.zeros((0, len(rows)), dtype=np.int64)
    dst = base + (np.array(strides[:k], dtype=np.int64) @ idx if k else 0)
    src = rows * inner
    length = np.full(len(rows), inner, dtype=np.int64)
    # Clip the first and last rows to [start, stop).
    head = region.start - src[0]
    src[0] += head
    dst = np.asarray(dst + np.zeros(len(rows), dtype=np.int64))
    dst[0] += head
    length[0] -= head
    length[-1] -= (rows[-1] + 1) * inner - region.stop
    runs = np.stack([src - region.start, dst, length], axis=1)
    return merge_runs(runs)


def merge_runs(runs: np.ndarray) -> np.ndarray:
    """Merge runs adjacent in both source and destination (rows of (src, dst, length))."""
    if len(runs) <= 1:
        return runs
    src, dst, length = runs[:, 0], runs[:, 1], runs[:, 2]
    breaks = np.flatnonzero((src[1:] != src[:-1] + length[:-1]) | (dst[1:] != dst[:-1] + length[:-1])) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(runs)]])
    sums = np.add.reduceat(length, starts)
    return np.stack([src[starts], dst[starts], sums], axis=1) if len(ends) else runs


def layer_offset(num_layers: int, pp: int, pp_rank: int, vpp: Optional[int] = None,
                 vp_stage: Optional[int] = None) -> int:
    """Global index of the first layer of (pp_rank, vp_stage), Megatron's even interleaving.

    With virtual stages, chunk v of rank r holds layers starting at (v x pp + r) x L / (pp x vpp).
    """
    chunks = pp * (vpp or 1)
    per_chunk = _even(num_layers, chunks, "layers over pipeline chunks")
    return ((vp_stage or 0) * pp + pp_rank) * per_chunk


def split_local(full: np.ndarray, rule: Rule, tp: int, tp_rank: int, padded_rows=None,
                padding: Optional[np.ndarray] = None) -> np.ndarray:
    """Reference split: the local tensor of `tp_rank` cut from the atomic tensor (for tests/tools)."""
    loc = local_shape(rule, full.shape, tp, padded_rows)
    out = np.zeros(loc, dtype=full.dtype).reshape(-1)
    held = 0 if padding is None else padding.shape[0]
    parts = {MAIN: full, PADDING: padding}
    for p in pieces(rule, full.shape, tp, tp_rank, padded_rows, held if rule.kind == "vocab" else None):
        src = parts[p.part]
        box = tuple(slice(o, o + s) for o, s in zip(p.offset, p.shape))
        out[p.local_start:p.local_start + p.numel] = src[box].reshape(-1)
    return out.reshape(loc)
