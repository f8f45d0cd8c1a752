"""Read-once load plans: the members of a replica group split the bytes they all need.

Data-parallel replicas hold the same weights (and, without the distributed optimizer, the same
Adam moments), so a load where each reads everything it holds reads the checkpoint once per
replica. Instead the needs of a group, identical on every member, are laid end to end in one
agreed order and cut into one run per member of (nearly) equal length: each member reads its
run from storage, then each piece is broadcast from its reader to the others. Every element is
read by exactly one member, the members read within one element of each other, and at most
members - 1 needs are cut in two (each member reads whole files but at its run's two ends).

Pure functions; the load (reads.py) supplies the needs, verifies that the members agree on them
(`digest`), and does the reads and the exchange.
"""

import hashlib
from dataclasses import dataclass
from typing import List, Optional, Sequence

from megatron_ucp.errors import LayoutError


@dataclass(frozen=True)
class Need:
    """Local flat elements [start, stop) of one state of one local tensor, held by every
    member of a replica group. `what` describes the tensor's geometry (its boxes of the atomic
    tensor): members that agree on it and on the range need the same bytes."""

    tensor: str
    state: str
    start: int
    stop: int
    what: str = ""

    def __post_init__(self):
        if not 0 <= self.start <= self.stop:
            raise LayoutError(f"tensor {self.tensor!r} {self.state}: bad element range "
                              f"[{self.start}, {self.stop})")

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Share:
    """Elements [start, stop) of need `need` (an index into the needs), read by member `reader`."""

    need: int
    start: int
    stop: int
    reader: int


def order(needs: Sequence[Need]) -> List[int]:
    """The agreed order of a group's needs (indices into `needs`): by tensor, state and range,
    whatever order each member found its tensors in."""
    return sorted(range(len(needs)), key=lambda i: (needs[i].tensor, needs[i].state, needs[i].start,
                                                    needs[i].stop, needs[i].what))


def split(needs: Sequence[Need], members: int) -> List[Share]:
    """Cut `needs`, laid end to end in the order given, into `members` runs: member k reads
    elements [k * total // members, (k + 1) * total // members) of the line. Shares in line
    order; empty needs get no share."""
    if members < 1:
        raise LayoutError(f"a replica group of {members} members")
    total = sum(n.numel for n in needs)
    bounds = [k * total // members for k in range(members + 1)]
    out: List[Share] = []
    pos, k = 0, 0
    for i, n in enumerate(needs):
        lo, hi = pos, pos + n.numel
        while lo < hi:
            while bounds[k + 1] <= lo:
                k += 1
            edge = min(hi, bounds[k + 1])
            out.append(Share(i, n.start + lo - pos, n.start + edge - pos, k))
            lo = edge
        pos = hi
    return out


def digest(needs: Sequence[Need]) -> str:
    """A short fingerprint of a member's needs (in agreed order): members that need the same
    bytes have equal digests."""
    h = hashlib.sha256()
    for n in needs:
        h.update(repr((n.tensor, n.state, n.start, n.stop, n.what)).encode())
    return h.hexdigest()[:32]


def disagreement(digests: Sequence[str], ranks: Sequence[int]) -> Optional[str]:
    """Why a group whose members have these need digests cannot split its reads (None if they
    agree): names the ranks that differ from the first member."""
    if len(digests) != len(ranks):
        raise LayoutError(f"{len(digests)} digests for a group of {len(ranks)} ranks")
    odd = [r for r, d in zip(ranks, digests) if d != digests[0]]
    if not odd:
        return None
    return (f"ranks {odd} of replica group {list(ranks)} do not hold the same tensors as rank "
            f"{ranks[0]} (names, ranges or boxes differ)")
