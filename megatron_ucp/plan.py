"""Save plans as data: who writes which region of which atomic tensor, and who creates each file.

Every rank offers the regions it holds; identical regions held by several ranks (replicas over
data parallelism, TP-replicated norms, ...) are written once, by the candidate with the fewest
bytes assigned so far, largest regions first. All ranks compute the same plan from the same
gathered offers, so no second collective is needed. Pure functions, no torch.distributed.
"""

from collections import defaultdict
from dataclasses import dataclass
from math import prod
from typing import Dict, List, Sequence, Tuple

import numpy as np

from megatron_ucp.errors import IncompleteCheckpointError
from megatron_ucp.layout import Region


@dataclass(frozen=True)
class WriteItem:
    """Region `region` of atomic tensor `name`; `nbytes` is its cost (all states together)."""

    name: str
    region: Region
    nbytes: int

    @property
    def key(self) -> Tuple:
        return (self.name, self.region)


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
    order = sorted(items, key=lambda k: (-items[k].nbytes, k[0], _region_sort_key(k[1])))
    for key in order:
        rank = min(holders[key], key=lambda r: (load[r], r))
        load[rank] += items[key].nbytes
        plan[rank].append(items[key])
    return plan


def _region_sort_key(region: Region):
    return (region.part, region.offset, region.shape, region.start, region.stop)


def assign_files(sizes: Dict[str, int], world_size: int) -> List[List[str]]:
    """Spread file creation (and later checksumming) over ranks by size, largest first."""
    load = [0] * world_size
    out: List[List[str]] = [[] for _ in range(world_size)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += sizes[name]
        out[rank].append(name)
    return out


def coverage_errors(part_shapes: Dict[Tuple[str, str], tuple],
                    plan: Sequence[Sequence[WriteItem]]) -> List[str]:
    """Messages for every atomic part not covered exactly once by the plan (empty if sound).

    Interval arithmetic over sorted runs, so the cost follows the number of runs, not elements.
    """
    from megatron_ucp.layout import region_runs

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
