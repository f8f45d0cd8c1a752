"""The local tier's checks of what its nodes hold, as pure functions of the records (no I/O, no
torch.distributed), run before a piece's data is read and before anything is loaded:

- a sidecar, COMPLETE marker or piece header against its slot: the rank of its file name, the
  iteration of its folder, the world of its marker, the job restoring (`slot_problem`);
- a piece's header against itself: the tensors it lists are exactly its regions' states, in
  fp32, and its size follows from them (`piece_layout`), so that a sidecar cannot make a
  reader take more than the regions a piece must hold;
- the regions against the tensors of the manifest head (`regions_problem`), and the chosen
  pieces against every tensor: each element of every part held exactly once (`coverage`), so
  that a missing region never loads as zeros;
- copies of one piece that differ (a replica is a byte copy of its original): the one that
  completes the coverage is kept, else none (`vet`).

Each problem is one line naming the file and what was expected.
"""

from dataclasses import dataclass
from math import prod
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_ucp.engine.planner import part_shapes_of
from megatron_ucp.errors import FormatError
from megatron_ucp.format.layout import Region, region_runs
from megatron_ucp.format.manifest import FORMAT_VERSION
from megatron_ucp.format.tensor_entry import TensorEntry

F32 = 4  # bytes per element: a piece holds fp32 states


def whose(theirs, ours) -> str:
    """How job record `theirs` differs from this job's `ours` ({"id", "run"}), for a note."""
    if not isinstance(theirs, dict):
        return f"no job recorded ({theirs!r}), this job is {ours.get('id')}"
    if theirs.get("id") != ours.get("id"):
        return f"job {theirs.get('id')}, this job is {ours.get('id')}"
    return (f"this job's id with other run arguments (digest {theirs.get('run')}, this run's "
            f"{ours.get('run')})")


def slot_problem(record: dict, rank: int, iteration: int, world: int, job) -> Optional[str]:
    """What `record` (a sidecar or a piece's metadata) says against the slot it was found in,
    or None."""
    if record.get("job") != job:
        return f"another job's piece ({whose(record.get('job'), job)})"
    wrong = [f"{key} {record.get(key)!r}, expected {want}"
             for key, want in (("rank", rank), ("iteration", iteration), ("world", world))
             if record.get(key) != want or isinstance(record.get(key), bool)]
    return "records " + "; ".join(wrong) if wrong else None


def _ints(value, n=None) -> bool:
    return (isinstance(value, list) and (n is None or len(value) == n)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value))


def piece_layout(meta: dict, table: dict, header_len: int, path: str) -> Tuple[list, int]:
    """([(tensor, Region, states)], the piece's size in bytes) from its header: every listed
    region has one fp32 tensor per state of its length and nothing else is stored. FormatError
    naming `path` otherwise."""
    regions = meta.get("regions")
    if not isinstance(regions, list):
        raise FormatError(f"{path}: its metadata lists no regions")
    out, states, spans = [], {}, []
    for i, r in enumerate(regions):
        if not (isinstance(r, list) and len(r) == 6 and isinstance(r[0], str) and isinstance(r[1], str)
                and _ints(r[2]) and _ints(r[3], len(r[2])) and _ints(r[4:6]) and 0 <= r[4] <= r[5]):
            raise FormatError(f"{path}: region {i} is {str(r)[:200]}, expected [tensor, part, offset, shape, "
                              "start, stop] with 0 <= start <= stop")
        out.append((r[0], Region(r[1], tuple(r[2]), tuple(r[3]), r[4], r[5])))
    for key, t in table.items():
        index, _, state = key.partition(".")
        if not (index.isdigit() and int(index) < len(out) and str(int(index)) == index and state):
            raise FormatError(f"{path}: tensor {key[:100]!r} belongs to no region of its metadata")
        numel = out[int(index)][1].numel
        span = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("dtype") == "F32" and t.get("shape") == [numel] and _ints(span, 2)
                and span[1] - span[0] == F32 * numel):
            raise FormatError(f"{path}: tensor {key!r} is {str(t)[:200]}, expected F32 of shape [{numel}]")
        states.setdefault(int(index), []).append(state)
        spans.append(tuple(span))
    spans.sort()
    end = 0
    for lo, hi in spans:
        if lo != end:
            raise FormatError(f"{path}: its tensors' data offsets leave a gap or overlap at byte {end}")
        end = hi
    missing = [i for i in range(len(out)) if i not in states]
    if missing:
        raise FormatError(f"{path}: region {missing[0]} ({out[missing[0]][0]}) has no data")
    return [(name, region, tuple(sorted(states[i]))) for i, (name, region) in enumerate(out)], 8 + header_len + end


def head_entries(head, path: str) -> Dict[str, TensorEntry]:
    """The tensors of rank 0's manifest head; FormatError naming `path` otherwise."""
    tensors = head.get("tensors") if isinstance(head, dict) else None
    if not isinstance(tensors, dict) or not tensors:
        raise FormatError(f"{path}: rank 0's piece holds no manifest head with tensors")
    return {n: TensorEntry.from_json(n, e, path, FORMAT_VERSION) for n, e in tensors.items()}


def regions_problem(regions, entries: Dict[str, TensorEntry], part_shapes: dict) -> Optional[str]:
    """Why a piece's regions do not belong to the head's tensors (a tensor or part the manifest
    lacks, a box or range outside its part, other states than the tensor's), or None."""
    for name, region, states in regions:
        if name not in entries:
            return f"region of tensor {name[:200]!r}, which the manifest head lacks"
        shape = part_shapes.get((name, region.part))
        if shape is None:
            return f"region of part {region.part[:100]!r} of {name}, which the manifest head lacks"
        if len(region.offset) != len(shape) or any(o < 0 or s < 0 or o + s > n
                                                    for o, s, n in zip(region.offset, region.shape, shape)):
            return (f"region of {name} part {region.part!r}: box offset {list(region.offset)} shape "
                    f"{list(region.shape)} outside the tensor's {list(shape)}")
        if region.stop > prod(region.shape):
            return (f"region of {name} part {region.part!r}: range [{region.start}, {region.stop}) outside "
                    f"its box of {prod(region.shape)} elements")
        if tuple(sorted(states)) != tuple(sorted(entries[name].states)):
            return f"region of {name} holds states {list(states)}, the tensor's are {list(entries[name].states)}"
    return None


def coverage(part_shapes: dict, regions) -> List[str]:
    """What the regions (each inside its part: regions_problem) leave uncovered or cover twice,
    per tensor part, as messages; [] when they tile every part of `part_shapes` exactly."""
    runs: Dict[tuple, list] = {}
    for name, region, _ in regions:
        if region.numel:
            runs.setdefault((name, region.part), []).append(region_runs(part_shapes[(name, region.part)], region))
    out = []
    for key, shape in sorted(part_shapes.items()):
        numel = prod(shape)
        if not numel:
            continue
        found = runs.get(key)
        if not found:
            out.append(f"{key[0]} part {key[1]!r}: none of its {numel} elements")
            continue
        r = np.concatenate(found)
        r = r[np.argsort(r[:, 1], kind="stable")]
        ends = r[:, 1] + r[:, 2]
        expected_starts = np.concatenate([[0], ends[:-1]])
        wrong = np.nonzero(r[:, 1] != expected_starts)[0]
        if wrong.size:
            i = int(wrong[0])
            at, start = int(expected_starts[i]), int(r[i, 1])
            what = f"elements [{at}, {start}) missing" if start > at else f"elements from {start} held twice"
            out.append(f"{key[0]} part {key[1]!r}: {what}")
        elif int(ends[-1]) != numel:
            out.append(f"{key[0]} part {key[1]!r}: elements [{int(ends[-1])}, {numel}) missing")
    return out


@dataclass(frozen=True)
class Seen:
    """What a node's leader found in one copy of a piece of the chosen iteration: its file, its
    sidecar's CRC-32, the digest of its header (equal digests: equal regions), and why it is
    bad, if it is."""

    host: str
    rank: int
    path: str
    crc32: int
    digest: str = ""
    problem: Optional[str] = None


def carriers(seen: Sequence[Seen]) -> set:
    """(host, rank) of the one copy of each distinct header of each rank (the first host in
    name order) whose regions the check needs: the others' headers are the same bytes."""
    first: Dict[tuple, str] = {}
    for s in seen:
        if s.problem is None and ((s.rank, s.digest) not in first or s.host < first[(s.rank, s.digest)]):
            first[(s.rank, s.digest)] = s.host
    return {(host, rank) for (rank, _), host in first.items()}


def vet(seen: Sequence[Seen], carried: Dict[tuple, tuple]) -> Tuple[List[Tuple[str, int, str]], Optional[str]]:
    """([(host, rank, why)] of the copies found bad, why the iteration is unusable or None),
    from every copy's Seen and the carriers' (rank, digest) -> (regions, rank 0's head). Copies
    with problems first (the choice is made again without them, with other carriers); then the
    regions of each distinct header against the head of rank 0's first copy; where a rank's
    copies differ, the one that completes the coverage stays; with one per rank, the coverage
    is checked whole."""
    bad = [(s.host, s.rank, f"{s.path}: {s.problem}") for s in seen if s.problem]
    if bad:
        return bad, None
    groups: Dict[int, Dict[tuple, List[Seen]]] = {}
    for s in sorted(seen, key=lambda s: (s.rank, s.host)):
        groups.setdefault(s.rank, {}).setdefault((s.digest, s.crc32), []).append(s)

    def refuse(copies, why):
        bad.extend((c.host, c.rank, f"{c.path}: {why}") for c in copies)

    entries = None
    for (digest, _), copies in groups.get(0, {}).items():
        try:
            entries = head_entries(carried[(0, digest)][1], copies[0].path)
            break
        except FormatError as e:
            refuse(copies, str(e).replace(f"{copies[0].path}: ", ""))
    if entries is None:
        return bad, None  # no sound copy of rank 0's piece: the choice finds it missing
    part_shapes = part_shapes_of(entries)
    for rank, variants in groups.items():
        for (digest, _), copies in variants.items():
            problem = regions_problem(carried[(rank, digest)][0], entries, part_shapes)
            if problem:
                refuse(copies, problem)
    if bad:
        return bad, None  # choose again without them first

    def regions(rank, key):
        return carried[(rank, key[0])][0]

    base = {rank: next(iter(v)) for rank, v in groups.items()}

    def gaps(chosen):
        return coverage(part_shapes, [x for rank, key in chosen.items() for x in regions(rank, key)])

    for rank, variants in groups.items():
        if len(variants) == 1:
            continue
        complete = [key for key in variants if not gaps({**base, rank: key})]
        for key, copies in variants.items():
            if len(complete) == 1 and key == complete[0]:
                continue
            refuse(copies, "differs from the copy on " + ", ".join(c.host for c in variants[complete[0]])
                   + " and leaves the tensors incomplete" if len(complete) == 1 else
                   "its copies differ (CRC-32 " + ", ".join(f"{k[1]:08x}" for k in variants)
                   + ") and none can be told sound")
    if bad:
        return bad, None
    problems = gaps(base)
    if problems:
        return [], (f"its pieces do not cover the tensors ({len(problems)} part(s); e.g. "
                    + "; ".join(problems[:3]) + ")")
    return [], None
