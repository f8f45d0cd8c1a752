"""Save plans as data: who writes which region of which atomic tensor, and who creates each file.

Every rank offers the regions it holds; identical regions held by several ranks (replicas over
data parallelism, TP-replicated norms, ...) are written once, by the candidate with the fewest
bytes assigned so far, largest regions first. All ranks compute the same plan from the same
gathered offers, so no second collective is needed. Pure functions, no torch.distributed.
"""

import hashlib
import heapq
from collections import defaultdict
from dataclasses import dataclass
from math import prod
from typing import Dict, List, Sequence, Tuple

import numpy as np

from megatron_ucp.errors import IncompleteCheckpointError
from megatron_ucp.format.layout import Region, padding_shape


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
    order = sorted(items, key=lambda k: (-items[k].nbytes, k[0], _region_sort_key(k[1])))
    for key in order:
        rank = min(holders[key], key=lambda r: (load[r], r))
        load[rank] += items[key].nbytes
        plan[rank].append(items[key])
    return plan


def _stable_hash(obj) -> int:
    """A hash that is the same on every rank and in every run (Python's str hash is salted)."""
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=8).digest(), "little")


def _region_sort_key(region: Region):
    return (region.part, region.offset, region.shape, region.start, region.stop)


def assign_files(sizes: Dict[str, int], world_size: int) -> List[List[str]]:
    """Spread file creation (and later checksumming) over ranks by size, largest first, each
    to the least loaded rank (the lower on ties): a heap, so files x log(world)."""
    heap = [(0, r) for r in range(world_size)]
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


# Planning at scale. Gathering every rank's offers costs every rank ranks x tensors objects.
# Instead each atomic tensor has an owner, a rank picked by a hash of its name: every rank sends
# its offers of a tensor (and the tensor's manifest entry) to the tensor's owner, the owner plans
# that tensor alone (row merges, writers, coverage) and sends each rank what it writes. A rank
# handles its own offers, plus the offers of the few tensors it owns: the work follows what it
# holds, not the world. The real save chains these pure steps with all-to-all exchanges
# (save._plan); benchmarks/bench_scale.py computes the exchanges' results directly.

MIN_SHARE_BYTES = 4 * 2**20  # a region held by several ranks is split into shares this large


def owner_of(name: str, world: int) -> int:
    """The rank that plans atomic tensor `name`: a stable hash, the same on every rank and run."""
    return _stable_hash(name) % world


def _encode(item: WriteItem) -> tuple:
    r = item.region
    return (item.name, r.part, r.offset, r.shape, r.start, r.stop, item.nbytes)


def _decode(t: tuple) -> WriteItem:
    return WriteItem(t[0], Region(t[1], tuple(t[2]), tuple(t[3]), t[4], t[5]), t[6])


def _encode_key(key: Tuple) -> tuple:
    name, r = key
    return (name, r.part, r.offset, r.shape, r.start, r.stop)


def _decode_key(t: tuple) -> Tuple:
    return (t[0], Region(t[1], tuple(t[2]), tuple(t[3]), t[4], t[5]))


def route_offers(offers: Sequence[WriteItem], entries: Dict[str, dict], world: int) -> Dict[int, tuple]:
    """What this rank sends each owner: (its offers of the owner's tensors, the entries of those
    tensors, the names of the owner's tensors it holds but offers nothing of). Names alone for
    the last (a distributed optimizer gives most ranks nothing of most tensors they hold): the
    owner learns that the tensor exists, and fails the plan if nobody offers it."""
    out: Dict[int, tuple] = {}
    offered = set()
    for item in offers:
        out.setdefault(owner_of(item.name, world), ([], {}, []))[0].append(_encode(item))
        offered.add(item.name)
    for name, entry in entries.items():
        payload = out.setdefault(owner_of(name, world), ([], {}, []))
        if name in offered:
            payload[1][name] = entry
        else:
            payload[2].append(name)
    return out


def part_shapes_of(entries: Dict[str, dict]) -> Dict[Tuple[str, str], tuple]:
    """(tensor, part) -> shape of every part the entries describe (the padding rows too)."""
    from megatron_ucp.format.layout import PADDING

    out = {}
    for name, e in entries.items():
        out[(name, "")] = tuple(e["shape"])
        if e["padding_rows"]:
            out[(name, PADDING)] = padding_shape(e["shape"], e["padding_rows"])
    return out


def _shares(item: WriteItem, holders: List[int]) -> List[Tuple[int, WriteItem]]:
    """A region held by several ranks, cut into contiguous shares (at most one per holder, none
    under MIN_SHARE_BYTES unless it is whole), each given to one holder; the first share goes to
    a holder picked by a hash of the region, so that replicas share the bytes without knowing
    what other owners assigned."""
    k = len(holders)
    r = item.region
    per_element = item.nbytes // max(1, r.numel)
    count = max(1, min(k, item.nbytes // MIN_SHARE_BYTES)) if r.numel else 1
    first = _stable_hash(_encode(item)) % k
    out = []
    for i in range(count):
        lo = r.start + r.numel * i // count
        hi = r.start + r.numel * (i + 1) // count
        if lo < hi or count == 1:
            share = item if count == 1 else WriteItem(
                item.name, Region(r.part, r.offset, r.shape, lo, hi), (hi - lo) * per_element)
            out.append((holders[(first + i) % k], share))
    return out


def plan_owned(received: Dict[int, tuple], world: int, merging: bool = True) -> Dict[int, dict]:
    """On an owner: what each rank sent it (rank -> route_offers' payload) -> what it sends back
    (rank -> reply). A reply holds `items` (what the rank writes), `merges` (the row exchanges
    it takes part in), `ends` (item key -> the offered item whose data it is part of), `errors`
    (sent to every rank when the owner's tensors are not covered exactly once) and, for rank 0,
    `entries` (the owner's tensors, for the manifest)."""
    entries, errors, named = {}, [], set()
    for rank in sorted(received):
        for name, entry in received[rank][1].items():
            if name in entries and entries[name] != entry:
                errors.append(f"{name}: ranks describe it differently ({entries[name]} and {entry} on rank {rank})")
            entries.setdefault(name, entry)
        named.update(received[rank][2])
    errors += [f"{name}: held by ranks, but no rank offered any of it" for name in sorted(named - entries.keys())]
    part_shapes = part_shapes_of(entries)
    offers = {rank: [_decode(t) for t in received[rank][0]] for rank in sorted(received)}
    for rank, offer in offers.items():
        errors += [f"{i.name}: offered by rank {rank}, which sent no entry for it" for i in offer
                   if i.name not in entries][:1]
    sets, ends = {}, {}
    if merging and not errors:
        offers, sets, ends = merge_rows(offers, part_shapes)
    holders: Dict[Tuple, List[int]] = defaultdict(list)
    items: Dict[Tuple, WriteItem] = {}
    for rank, offer in offers.items():
        for item in offer:
            holders[item.key].append(rank)
            items[item.key] = item
    replies: Dict[int, dict] = defaultdict(lambda: {"items": [], "merges": [], "ends": {}})
    plan: Dict[int, List[WriteItem]] = defaultdict(list)
    for key in sorted(items, key=lambda k: (k[0], _region_sort_key(k[1]))):
        item = items[key]
        if any((key, rank) in sets for rank in holders[key]):  # whole rows: one set writes them
            pick = holders[key][_spread(key, len(holders[key]))]
            chosen = [(pick, item)]
        else:
            chosen = _shares(item, sorted(holders[key]))
        for rank, share in chosen:
            plan[rank].append(share)
            source = ends.get((key, rank), key)
            if share.key != source:
                replies[rank]["ends"][_encode_key(share.key)] = _encode_key(source)
    errors += coverage_errors(part_shapes, [plan[r] for r in sorted(plan)]) if not errors else []
    for rank, mine in plan.items():
        replies[rank]["items"] = [_encode(i) for i in mine]
    for m in row_merges_of(plan, sets):
        for rank in {m.writer} | {b.rank for b in m.blocks}:
            replies[rank]["merges"].append(_encode_merge(m, rank))
    out = dict(replies)
    if entries:
        out.setdefault(0, {"items": [], "merges": [], "ends": {}})["entries"] = entries
    if errors:
        for rank in range(world):
            out.setdefault(rank, {"items": [], "merges": [], "ends": {}})["errors"] = errors
    return out


def _spread(key: Tuple, k: int) -> int:
    return _stable_hash(_encode_key(key)) % k


def row_merges_of(plan: Dict[int, List[WriteItem]], sets) -> List[RowMerge]:
    return [RowMerge(item, rank, sets[(item.key, rank)])
            for rank in sorted(plan) for item in plan[rank] if (item.key, rank) in sets]


def _encode_merge(m: RowMerge, rank: int) -> tuple:
    """A merge as `rank` needs it: the source of its own blocks only (a writer takes the others'
    blocks by their place, a sender sends only its own)."""
    return (_encode(m.item), m.writer, tuple((b.rank, _encode_key(b.source) if b.rank == rank else None,
                                              b.rows, b.columns) for b in m.blocks))


def _decode_merge(t: tuple) -> RowMerge:
    return RowMerge(_decode(t[0]), t[1], tuple(ColumnBlock(r, None if s is None else _decode_key(s), tuple(rows),
                                                           tuple(cols)) for r, s, rows, cols in t[2]))


@dataclass
class RankPlan:
    """One rank's part of the save plan."""

    items: List[WriteItem]  # what it writes, in a fixed order
    merges: List[RowMerge]  # the row exchanges it takes part in, in the same order on every rank
    ends: Dict[Tuple, Tuple]  # item key -> key of the offered item whose data it is part of
    entries: Dict[str, dict]  # rank 0: every tensor's entry (the manifest's); else empty
    errors: List[str]


def finish_plan(replies: Dict[int, dict]) -> RankPlan:
    """What the owners sent this rank (owner -> reply), as its plan."""
    items, merges, ends, entries, errors = [], [], {}, {}, []
    for owner in sorted(replies):
        reply = replies[owner]
        items += [_decode(t) for t in reply["items"]]
        merges += [_decode_merge(t) for t in reply["merges"]]
        ends.update({_decode_key(k): _decode_key(v) for k, v in reply["ends"].items()})
        entries.update(reply.get("entries", {}))
        errors += reply.get("errors", [])
    items.sort(key=lambda i: (i.name, _region_sort_key(i.region)))
    merges.sort(key=lambda m: (m.item.name, _region_sort_key(m.item.region), m.writer))
    return RankPlan(items, merges, ends, entries, sorted(set(errors)))


def file_creators(entries: Dict[str, dict], sizes: Dict[str, int], world: int) -> Dict[int, Dict[str, dict]]:
    """On rank 0: what it sends each rank that creates (and checksums) files: their entries."""
    out: Dict[int, Dict[str, dict]] = {}
    for rank, names in enumerate(assign_files(sizes, world)):
        if names:
            out[rank] = {name: entries[name] for name in names}
    return out


def plan_save(offers: Sequence[WriteItem], entries: Dict[str, dict], rank: int, world: int,
              exchange, file_size, merging: bool = True) -> Tuple[RankPlan, Dict[str, dict]]:
    """This rank's save plan, and the entries of the files it creates (and checksums).

    `exchange(payloads)` is an all-to-all (payloads[dest] -> {source: object}); `file_size(entry)`
    the size of a tensor's file. Three exchanges: offers to owners, replies from them (every
    entry to rank 0), file creators from rank 0. An error raised while planning is sent to
    every rank, so that all raise it together."""
    replies = exchange(route_offers(offers, entries, world))
    try:
        answers = plan_owned(replies, world, merging)
    except Exception as e:  # every rank must hear of it, or the others would wait forever
        answers = {r: {"items": [], "merges": [], "ends": {}, "errors": [f"rank {rank}: {e}"]}
                   for r in range(world)}
    mine = finish_plan(exchange(answers))
    sends = {}
    if rank == 0 and not mine.errors:
        sends = file_creators(mine.entries, {n: file_size(e) for n, e in mine.entries.items()}, world)
    created = exchange(sends).get(0, {})
    return mine, created


def plan_in_memory(offers: Dict[int, Sequence[WriteItem]], entries: Dict[int, Dict[str, dict]], world: int,
                   file_size, merging: bool = True) -> Tuple[Dict[int, RankPlan], Dict[int, Dict[str, dict]]]:
    """plan_save on every rank of a world at once, its exchanges delivered in memory (tests and
    the simulator): rank -> plan, rank -> entries of the files it creates."""
    def deliver(sent: Dict[int, Dict[int, object]]) -> Dict[int, Dict[int, object]]:
        got: Dict[int, Dict[int, object]] = defaultdict(dict)
        for source, payloads in sent.items():
            for dest, obj in payloads.items():
                got[dest][source] = obj
        return got

    ranks = range(world)
    at_owner = deliver({r: route_offers(offers.get(r, ()), entries.get(r, {}), world) for r in ranks})
    replies = deliver({owner: plan_owned(received, world, merging) for owner, received in at_owner.items()})
    plans = {r: finish_plan(replies.get(r, {})) for r in ranks}
    created = {}
    if not plans[0].errors:
        sizes = {n: file_size(e) for n, e in plans[0].entries.items()}
        created = file_creators(plans[0].entries, sizes, world)
    return plans, created


def names_by_owner(names, world: int) -> Dict[int, List[str]]:
    """Tensor names grouped by their owner rank (what a rank tells each owner it holds)."""
    out: Dict[int, List[str]] = {}
    for name in sorted(names):
        out.setdefault(owner_of(name, world), []).append(name)
    return out


def unclaimed(saved, told, rank: int, world: int) -> List[str]:
    """On an owner: the checkpoint's tensors it owns that no rank said it holds (`told`: the
    name lists the ranks sent it)."""
    claimed = set().union(*map(set, told)) if told else set()
    return sorted(n for n in saved if owner_of(n, world) == rank and n not in claimed)

