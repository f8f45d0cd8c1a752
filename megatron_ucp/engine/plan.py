"""Save plans as data: who writes which region of which atomic tensor, and who creates each file.

Every rank offers the regions it holds (`offer_items`); identical regions held by several ranks
(replicas over data parallelism, TP-replicated norms, ...) are written once, balanced by bytes
(`assign_writers`); a plan must cover every atomic tensor exactly once (`coverage_errors`); TP
column blocks become whole rows (`merge_rows`). Pure functions, no torch.distributed; which rank
computes which part of the plan, at any scale, is planner.py.
"""

import heapq
from collections import defaultdict
from dataclasses import dataclass
from math import prod
from typing import Dict, List, Sequence, Tuple

import numpy as np

from megatron_ucp.errors import IncompleteCheckpointError
from megatron_ucp.format.layout import Region


@dataclass(frozen=True)
class WriteItem:
    """Region `region` of atomic tensor `name`; `nbytes` is its cost (all states together)."""

    name: str
    region: Region
    nbytes: int

    @property
    def key(self) -> Tuple:
        return (self.name, self.region)


def offer_items(tensors, n_states: int, with_optimizer: bool, numel=lambda t: t.param.numel()) -> list:
    """What a rank offers: (item, tensor, offset of the item's first element in the tensor's
    sources) for every region it holds. With an optimizer, the distributed optimizer's fragment
    (`t.fragment.start/stop`, `n_states` states) of each tensor; without one, or without a
    fragment, the whole local tensor (the parameter alone). Copies of another stage's tensor
    (`writes` false) are never offered; with an optimizer, neither are tensors whose state
    another data-parallel rank owns (no fragment), stateless buffers aside."""
    from megatron_ucp.format.layout import fragment_regions

    out = []
    for t in tensors:
        if not t.writes or (with_optimizer and t.fragment is None and not t.stateless):
            continue
        if t.fragment is None:
            start, stop, n = 0, numel(t), 1
        else:
            start, stop, n = t.fragment.start, t.fragment.stop, n_states
        for local_start, region in fragment_regions(t.pieces(), start, stop):
            out.append((WriteItem(t.name, region, region.numel * 4 * n), t, local_start - start))
    return out


def assign_writers(offers: Sequence[Sequence[WriteItem]]) -> List[List[WriteItem]]:
    """offers[rank] -> plan[rank]: each distinct region exactly once, balanced by bytes."""
    holders: Dict[Tuple, List[int]] = defaultdict(list)
    items: Dict[Tuple, WriteItem] = {}
    for rank, offer in enumerate(offers):
        for item in offer:
            holders[item.key].append(rank)
            items[item.key] = item
    load = [0] * len(offers)
    plan: List[List[WriteItem]] = [[] for _ in offers]
    order = sorted(items, key=lambda k: (-items[k].nbytes, k[0], region_sort_key(k[1])))
    for key in order:
        rank = min(holders[key], key=lambda r: (load[r], r))
        load[rank] += items[key].nbytes
        plan[rank].append(items[key])
    return plan


def region_sort_key(region: Region):
    return (region.part, region.offset, region.shape, region.start, region.stop)


def assign_files(sizes: Dict[str, int], world_size: int) -> List[List[str]]:
    """Spread file creation (and later checksumming) over ranks by size, largest first, each
    to the least loaded rank (the lower on ties): a heap of at most one rank per file (the
    ranks past the files' count would get nothing), so files x log(min(files, world))."""
    heap = [(0, r) for r in range(min(world_size, len(sizes)))]
    out: List[List[str]] = [[] for _ in range(world_size)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, rank = heapq.heappop(heap)
        out[rank].append(name)
        heapq.heappush(heap, (load + sizes[name], rank))
    return out


def coverage_errors(part_shapes: Dict[Tuple[str, str], tuple],
                    plan: Sequence[Sequence[WriteItem]]) -> List[str]:
    """Messages for every atomic part not covered exactly once by the plan (empty if sound).

    Interval arithmetic over sorted runs, so the cost follows the number of runs, not elements.
    """
    from megatron_ucp.format.layout import region_runs

    runs: Dict[Tuple[str, str], list] = {key: [] for key in part_shapes}
    for rank_items in plan:
        for item in rank_items:
            key = (item.name, item.region.part)
            if key not in runs:
                return [f"{item.name}: region of unknown part {item.region.part!r}"]
            runs[key].append(region_runs(part_shapes[key], item.region)[:, 1:])
    errors = []
    for key in sorted(runs):
        name, part = key
        label = name if not part else f"{name} [{part}]"
        numel = prod(part_shapes[key])
        spans = np.concatenate(runs[key]) if runs[key] else np.zeros((0, 2), dtype=np.int64)
        spans = spans[np.argsort(spans[:, 0], kind="stable")]
        starts, ends = spans[:, 0], spans[:, 0] + spans[:, 1]
        covered_to = np.maximum.accumulate(ends) if len(ends) else ends
        previous_end = np.concatenate([[0], covered_to[:-1]])
        gaps = np.clip(starts - previous_end, 0, None).sum() + max(0, numel - (covered_to[-1] if len(ends) else 0))
        overlap = np.clip(np.minimum(previous_end, ends) - starts, 0, None).sum()
        if gaps:
            errors.append(f"{label}: {int(gaps)} of {numel} elements held by no rank")
        if overlap:
            errors.append(f"{label}: {int(overlap)} elements planned to be written more than once")
    return errors


def check_coverage(part_shapes, plan) -> None:
    errors = coverage_errors(part_shapes, plan)
    if errors:
        raise IncompleteCheckpointError("save plan does not cover the model: " + "; ".join(errors[:5]))


# Whole rows from split columns. Under TP a column-split tensor (row-parallel linears) gives
# each rank a few KiB of every row; ranks writing interleaved halves into the same pages cost
# the save about a fifth of the disk's rate. Instead, the ranks holding the column blocks of the
# same rows exchange them, and each writes a share of the rows whole.

SHORT_ROW_BYTES = 256 * 2**10  # column blocks narrower than this are merged into whole rows


@dataclass(frozen=True)
class ColumnBlock:
    """Rank `rank`'s columns [columns) of a merged item's rows, taken from its offered item
    `source` (a region of box shape (rows, width); None in another rank's plan), box rows [rows)."""

    rank: int
    source: Tuple
    rows: Tuple[int, int]
    columns: Tuple[int, int]


@dataclass(frozen=True)
class RowMerge:
    """`writer` writes `item` (whole rows) once every block has reached it."""

    item: WriteItem
    writer: int
    blocks: Tuple[ColumnBlock, ...]


def _is_column_block(item: WriteItem, part_shape) -> bool:
    region = item.region
    return (len(part_shape) == 2 and len(region.shape) == 2 and region.offset[0] == 0
            and region.shape[0] == part_shape[0] and 0 < region.shape[1] < part_shape[1]
            and part_shape[1] % region.shape[1] == 0 and region.offset[1] % region.shape[1] == 0
            and region.shape[1] * 4 < SHORT_ROW_BYTES)


def merge_rows(offers, part_shapes: Dict[Tuple[str, str], tuple]):
    """Offers in which each complete set of column blocks of the same rows (same tensor, range
    and width, one rank per column offset) becomes whole-row items, one share per member, plus
    the partial rows at the range's ends, which stay as they were.

    Returns (offers, sets, ends): sets[(merged key, rank)] holds the blocks the rank needs to
    write that merged item; ends[(end key, rank)] is the offered item whose data an end's
    partial rows are part of. Ranks holding the same block (replicas) form separate sets, so
    that the writer the plan picks receives only from its own set. `offers`: a list indexed by
    rank, or a dict rank -> offer (an owner's share of the ranks); the result has its form.
    """
    ranked = list(offers.items()) if isinstance(offers, dict) else list(enumerate(offers))
    by_rows: Dict[Tuple, Dict[int, List[Tuple[int, WriteItem]]]] = defaultdict(lambda: defaultdict(list))
    for rank, offer in ranked:
        for item in offer:
            shape = part_shapes.get((item.name, item.region.part))
            if shape is not None and _is_column_block(item, shape):
                r = item.region
                by_rows[(item.name, r.part, r.shape, r.start, r.stop)][r.offset[1]].append((rank, item))
    removed, added, sets, ends = set(), defaultdict(list), {}, {}
    for (name, part, (rows, width), start, stop), columns in by_rows.items():
        full_width = part_shapes[(name, part)][1]
        holders = {len(h) for h in columns.values()}
        if sorted(columns) != list(range(0, full_width, width)) or len(holders) != 1:
            continue  # some column block is missing or held unevenly: leave them as they are
        first, last = -(-start // width), stop // width  # whole rows of the range
        members = full_width // width
        if last - first < members:
            continue
        # Each member takes the same number of whole rows; the rows that do not split evenly
        # stay with the partial rows at the end, each member writing its own columns of them.
        # So every member writes exactly as many bytes as it holds.
        last = first + (last - first) // members * members
        for group in zip(*(columns[c] for c in sorted(columns))):  # one holder per column block
            for q, (rank, item) in enumerate(group):
                removed.add((rank, item.key))
                states = item.nbytes // (item.region.numel * 4)
                lo = first + (last - first) * q // members
                hi = first + (last - first) * (q + 1) // members
                merged = WriteItem(name, Region(part, (lo, 0), (hi - lo, full_width), 0, (hi - lo) * full_width),
                                   (hi - lo) * full_width * 4 * states)
                added[rank].append(merged)
                sets[(merged.key, rank)] = tuple(
                    ColumnBlock(r, it.key, (lo, hi), (it.region.offset[1], it.region.offset[1] + width))
                    for r, it in group)
                for a, b in ((start, first * width), (last * width, stop)):
                    if a < b:
                        end = WriteItem(name, Region(part, item.region.offset, item.region.shape, a, b),
                                        (b - a) * 4 * states)
                        added[rank].append(end)
                        ends[(end.key, rank)] = item.key
    out = [(rank, [item for item in offer if (rank, item.key) not in removed] + added[rank])
           for rank, offer in ranked]
    return (dict(out) if isinstance(offers, dict) else [o for _, o in out]), sets, ends


def row_merges(plan: Sequence[Sequence[WriteItem]], sets) -> List[RowMerge]:
    """The exchanges a plan needs: for each merged item, its writer and its set's blocks."""
    return [RowMerge(item, rank, sets[(item.key, rank)])
            for rank, items in enumerate(plan) for item in items if (item.key, rank) in sets]
