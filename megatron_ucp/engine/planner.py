"""Planning at scale: each atomic tensor planned by one owner rank, from the offers sent to it.

Gathering every rank's offers costs every rank ranks x tensors objects. Instead each atomic
tensor has an owner, a rank picked by a hash of its name: every rank sends its offers of a
tensor (and the tensor's manifest entry) to the tensor's owner, the owner plans that tensor
alone (row merges, writers, coverage: plan.py) and sends each rank what it writes. A rank
handles its own offers, plus the offers of the few tensors it owns: the work follows what it
holds, not the world. The real save chains these pure steps with all-to-all exchanges
(save._plan); benchmarks/bench_scale.py computes the exchanges' results directly.
"""

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from megatron_ucp.engine.plan import (ColumnBlock, RowMerge, WriteItem, assign_files, coverage_errors,
                                      merge_rows, region_sort_key)
from megatron_ucp.format.layout import Region, padding_shape
from megatron_ucp.format.tensor_entry import TensorEntry


def stable_hash(obj) -> int:
    """A hash that is the same on every rank and in every run (Python's str hash is salted)."""
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=8).digest(), "little")


MIN_SHARE_BYTES = 4 * 2**20  # a region held by several ranks is split into shares this large


def owner_of(name: str, world: int) -> int:
    """The rank that plans atomic tensor `name`: a stable hash, the same on every rank and run."""
    return stable_hash(name) % world


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


def route_offers(offers: Sequence[WriteItem], entries: Dict[str, TensorEntry], world: int) -> Dict[int, tuple]:
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


def part_shapes_of(entries: Dict[str, TensorEntry]) -> Dict[Tuple[str, str], tuple]:
    """(tensor, part) -> shape of every part the entries describe (the padding rows too)."""
    from megatron_ucp.format.layout import PADDING

    out = {}
    for name, e in entries.items():
        out[(name, "")] = e.shape
        if e.padding_rows:
            out[(name, PADDING)] = padding_shape(e.shape, e.padding_rows)
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
    first = stable_hash(_encode(item)) % k
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
    for key in sorted(items, key=lambda k: (k[0], region_sort_key(k[1]))):
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
    return stable_hash(_encode_key(key)) % k


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
    entries: Dict[str, TensorEntry]  # rank 0: every tensor's entry (the manifest's); else empty
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
    items.sort(key=lambda i: (i.name, region_sort_key(i.region)))
    merges.sort(key=lambda m: (m.item.name, region_sort_key(m.item.region), m.writer))
    return RankPlan(items, merges, ends, entries, sorted(set(errors)))


def file_creators(entries: Dict[str, TensorEntry], sizes: Dict[str, int],
                  world: int) -> Dict[int, Dict[str, TensorEntry]]:
    """On rank 0: what it sends each rank that creates (and checksums) files: their entries."""
    out: Dict[int, Dict[str, TensorEntry]] = {}
    for rank, names in enumerate(assign_files(sizes, world)):
        if names:
            out[rank] = {name: entries[name] for name in names}
    return out


def plan_save(offers: Sequence[WriteItem], entries: Dict[str, TensorEntry], rank: int, world: int,
              exchange, file_size, merging: bool = True) -> Tuple[RankPlan, Dict[str, TensorEntry]]:
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


def plan_in_memory(offers: Dict[int, Sequence[WriteItem]], entries: Dict[int, Dict[str, TensorEntry]], world: int,
                   file_size, merging: bool = True) -> Tuple[Dict[int, RankPlan], Dict[int, Dict[str, TensorEntry]]]:
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


def unclaimed(owned, told) -> List[str]:
    """On an owner: the checkpoint's tensors it owns (`owned`: names_by_owner of the manifest's
    names, this rank's list) that no rank said it holds (`told`: the name lists the ranks sent
    it)."""
    claimed = set().union(*map(set, told)) if told else set()
    return sorted(n for n in owned if n not in claimed)
