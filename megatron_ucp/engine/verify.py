"""A verified load's checksums: every byte of every tensor file hashed once, by the rank that
reads it where it can (inline, as the load reads it), the rest after the load; each file's
block hashes checked by one rank (checksums.py), so that a damaged byte fails the load on every
rank before it returns."""

import functools
from dataclasses import dataclass

import torch.distributed as dist

from megatron_ucp import settings
from megatron_ucp.engine.collective import exchange_objects, run_everywhere
from megatron_ucp.engine.plan import assign_files
from megatron_ucp.engine.planner import owner_of
from megatron_ucp.engine.reads import ReadPlan, file_runs
from megatron_ucp.errors import IntegrityError
from megatron_ucp.format import checksums, safe_files, storage, tensor_io
from megatron_ucp.format.inspection import check_file, check_header
from megatron_ucp.format.manifest import Manifest
from megatron_ucp.format.tensor_entry import file_layout


class Layouts(dict):
    """Each tensor file's layout, built from its manifest entry when first asked for: a load
    builds only the layouts of what it reads, and each once."""

    def __init__(self, entries: dict):
        super().__init__()
        self._entries = entries

    def __missing__(self, name):
        self[name] = layout = file_layout(self._entries[name])
        return layout


@dataclass
class HashPlan:
    """Who hashes which bytes of the checkpoint's tensor files (see checksums.py)."""

    inline: dict  # tensor name -> sorted file byte spans this rank hashes as it reads them
    after: list  # (tensor name, lo, hi) this rank hashes by reading, after the load
    checks: list  # tensor names whose blocks this rank checks, from the hashes sent to it
    checker: dict  # tensor name -> the rank that checks its blocks


def file_checkers(entries: dict, world: int):
    """Pure: each rank's share of the tensor files, by size (as file creation): the files whose
    size and header it checks before the load and whose block hashes it checks after. Returns
    (rank -> its file names, file name -> its rank): the same on every rank."""
    shares = assign_files({name: int(e.file_size or 0) for name, e in entries.items()}, world)
    return shares, {name: r for r, names in enumerate(shares) for name in names}


def check_files(root: str, m: Manifest, source=None):
    """Sizes, headers and recorded checksums of this rank's share of the tensor files (through
    `source` where it serves them: store_source.StoreSource); returns file_checkers."""
    shares, checker = file_checkers(m.tensors, dist.get_world_size())
    mine = shares[dist.get_rank()]
    # A cold header read is a disk round trip (10 ms here): several in flight.
    check = source.check_file if source is not None else functools.partial(check_file, root)
    found = tensor_io.in_parallel(lambda name: check(name, m.tensors[name]), mine)
    problems = [p for file_problems in found for p in file_problems]
    if problems:
        raise IntegrityError(f"{root}: checkpoint failed verification: " + "; ".join(problems[:5]))
    return shares, checker


def check_headers(root: str, m: Manifest, tensors, plan: ReadPlan, source=None) -> None:
    """Without verification, the header of each file this rank reads (a few KB) is still
    checked against the manifest: the reads take their offsets from the manifest's layout, so a
    valid file with a longer header would be misread silently. Also refuses FIFOs and devices."""
    names = sorted({t.name for t, reads in zip(tensors, plan.reads) if reads})
    check = source.check_header if source is not None else functools.partial(check_header, root)
    tensor_io.in_parallel(lambda name: check(name, m.tensors[name]), names)


def read_spans(m: Manifest, layouts, tensors, plan: ReadPlan) -> dict:
    """The file byte spans of this rank's load reads, per tensor, long enough to hash inline."""
    out: dict = {}
    shortest = settings.inline_hash_bytes()
    for t, reads in zip(tensors, plan.reads):
        entry = m.tensors[t.name]
        layout = layouts[t.name]
        for state, start, stop, _ in reads:
            for name, runs in file_runs(entry, t, state, start, stop)[0]:
                out.setdefault(t.name, []).extend(tensor_io.read_spans(layout, name, runs, shortest))
    return out


def route_spans(spans: dict, world: int) -> dict:
    """Pure: what this rank tells each file's owner (planner.owner_of): owner -> {tensor name:
    the spans this rank reads of its file}."""
    routed: dict = {}
    for name, s in spans.items():
        routed.setdefault(owner_of(name, world), {})[name] = s
    return routed


def plan_owned_hashes(m: Manifest, layouts, owned, told: dict, world: int, rank: int) -> dict:
    """Pure, on an owner: who hashes each byte of the files it owns (`owned`: their names),
    from the spans the ranks told it (rank -> route_spans' payload): rank -> its share."""
    files = {name: (len(layouts[name].header), m.tensors[name].file_size, m.tensors[name].block_bytes)
             for name in owned}
    return checksums.plan_hashes(files, told, world, rank)


def collect_hash_plan(replies: dict, checkers, rank: int) -> HashPlan:
    """Pure: the owners' replies (owner -> plan_owned_hashes' share for this rank) as this
    rank's HashPlan; `checkers`: file_checkers."""
    shares, checker = checkers
    inline, after = {}, []
    for owner in sorted(replies):
        inline.update(replies[owner]["inline"])
        after += replies[owner]["after"]
    return HashPlan(inline, after, shares[rank], checker)


def hash_plan(root: str, m: Manifest, layouts, tensors, reading: ReadPlan, owned, source=None) -> HashPlan:
    """Collective: files checked (sizes, headers), then every byte of every tensor file given
    one rank to hash, as it loads it where it can (the reads of `reading`: under read-once, each
    replicated byte is read, and so hashed, by one member of its replica group). `owned`: the
    checkpoint's tensors this rank owns (planner.owner_of).

    Each file's hashing is planned by its owner, from the spans its readers send it: a rank
    sends and receives what concerns its own reads and files, not the world's."""
    checkers = run_everywhere(check_files, root, m, source)
    rank, world = dist.get_rank(), dist.get_world_size()
    spans = run_everywhere(read_spans, m, layouts, tensors, reading)
    told = exchange_objects(route_spans(spans, world))
    mine = exchange_objects(run_everywhere(plan_owned_hashes, m, layouts, owned, told, world, rank))
    return collect_hash_plan(mine, checkers, rank)


def route_hashes(hashes: dict, checker: dict) -> dict:
    """Pure: each file's hashes (name -> [(lo, hi, crc)]) to the rank that checks it: checker ->
    {name: sorted pieces}. A set: bytes a rank happens to read twice are hashed twice, and must
    count once."""
    routed: dict = {}
    for name, h in hashes.items():
        if h:
            routed.setdefault(checker[name], {})[name] = sorted(set(h))
    return routed


def hash_problems(m: Manifest, layouts, names, received: dict, path) -> list:
    """Pure, on a checker: the problems of the blocks of files `names`, from the hashes the
    ranks sent it (rank -> route_hashes' payload); `path(entry)`: the file's path, for messages."""
    hashed: dict = {}
    for h in received.values():
        for name, pieces in h.items():
            hashed.setdefault(name, []).extend(pieces)
    problems = []
    for name in names:
        entry = m.tensors[name]
        problems += checksums.check_blocks(path(entry), len(layouts[name].header), entry.file_size,
                                           entry.block_bytes, entry.checksums, hashed.get(name, []))
    return problems


def check_hashes(root: str, m: Manifest, layouts, plan: HashPlan, hashes: dict, source=None) -> int:
    """Collective, after the load: hash what the load did not, send each file's hashes to the
    rank that checks it, and check the blocks of this rank's share of the files. Returns the
    bytes hashed after."""

    def hash_rest():
        todo = list(plan.after)
        for name, spans in plan.inline.items():  # any piece the reads did not meet
            done = {(lo, hi) for lo, hi, _ in hashes.get(name, ())}
            todo += [(name, lo, hi) for lo, hi in spans if (lo, hi) not in done]
        by_file: dict = {}
        for name, lo, hi in todo:
            by_file.setdefault(name, []).append((lo, hi))
        for name, spans in by_file.items():
            if source is not None:
                crcs = source.crc_spans(name, spans)
            else:
                crcs = checksums.crc_spans(safe_files.safe_join(root, m.tensors[name].file), spans)
            hashes.setdefault(name, []).extend((lo, hi, c) for (lo, hi), c in zip(spans, crcs))
        return sum(hi - lo for _, lo, hi in todo)

    rehashed = run_everywhere(hash_rest)
    # Each file's hashes go to its checker only: a rank sends and receives what concerns its
    # own reads and files, not the world's.
    received = exchange_objects(route_hashes(hashes, plan.checker))

    def check():
        problems = hash_problems(m, layouts, plan.checks, received,
                                 lambda entry: storage.join(root, entry.file))
        if problems:
            raise IntegrityError(f"{root}: checkpoint failed verification: " + "; ".join(problems[:5]))

    run_everywhere(check)
    return rehashed
