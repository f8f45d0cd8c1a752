"""The local tier's decisions, as pure functions of host names and inventories (no I/O, no
torch.distributed): where each rank's replicas go, which iteration a restart restores and from
which copies, and which piece travels to which node.

Nodes are host names (`socket.gethostname()`), the ranks of one node the ranks that share it.
"""

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np


def nodes_of(hosts: Sequence[str]) -> Dict[str, List[int]]:
    """Host name -> its ranks, in rank order; the hosts in the order of their first rank."""
    out: Dict[str, List[int]] = {}
    for rank, host in enumerate(hosts):
        out.setdefault(host, []).append(rank)
    return out


def leaders(hosts: Sequence[str]) -> Dict[str, int]:
    """Host name -> the rank that speaks for its node (the node's first rank)."""
    return {host: ranks[0] for host, ranks in nodes_of(hosts).items()}


def replica_targets(hosts: Sequence[str], replicas: int) -> Dict[int, List[int]]:
    """Rank -> the ranks that keep its replicas: one on each of the next `replicas` nodes (in
    the order of the nodes' first ranks, wrapping round), never its own node; on a node, the
    rank of the same local index modulo that node's size, so that replicas spread over a
    node's ranks. Fewer other nodes than `replicas`: as many replicas as there are others."""
    if replicas < 0:
        raise ValueError(f"replicas {replicas}: expected >= 0")
    nodes = list(nodes_of(hosts).items())
    position = {host: i for i, (host, _) in enumerate(nodes)}
    out = {}
    for rank, host in enumerate(hosts):
        mine = position[host]
        local = nodes[mine][1].index(rank)
        targets = []
        for step in range(1, min(replicas, len(nodes) - 1) + 1):
            ranks = nodes[(mine + step) % len(nodes)][1]
            targets.append(ranks[local % len(ranks)])
        out[rank] = targets
    return out


def replica_sources(targets: Dict[int, List[int]], rank: int) -> List[int]:
    """The ranks whose replicas `rank` keeps."""
    return sorted(r for r, ts in targets.items() if rank in ts)


def node_share(hosts: Sequence[str], sizes: Sequence[int], replicas: int, host: str) -> Tuple[int, int]:
    """(bytes of node `host`'s own ranks' pieces, bytes of the replicas it keeps) of one local
    iteration, `sizes[rank]` being each rank's piece."""
    targets = replica_targets(hosts, replicas)
    ranks = nodes_of(hosts)[host]
    return (sum(sizes[r] for r in ranks),
            sum(sizes[s] for r in ranks for s in replica_sources(targets, r)))


@dataclass(frozen=True)
class Copy:
    """One copy of saving rank `rank`'s piece of an iteration, as a node's inventory found it."""

    host: str
    rank: int
    nbytes: int
    bad: Optional[str] = None  # why the copy cannot be used (checksum, size, unreadable); None: sound
    crc32: int = 0  # as its sidecar records it
    chunk_bytes: int = 0  # its bytes per chunk CRC-32 (local_piece.check_chunks)
    chunk_crc32: tuple = ()  # each chunk's, as its sidecar records them


@dataclass(frozen=True)
class Iteration:
    """What one node holds of one local iteration (its COMPLETE marker says `world` ranks saved).
    `refused`: why it is never used (another job's, a marker not to be believed, pieces that do
    not cover the tensors); None: this job's."""

    iteration: int
    world: int
    copies: Tuple[Copy, ...] = ()
    refused: Optional[str] = None
    padded_vocab: Optional[int] = None  # the saving model's padded vocabulary (None: not recorded)


@dataclass
class Choice:
    """The restart's decision: `iteration` (None: nothing usable in the local tier), where each
    saving rank's piece is read (`holders[rank]`: hosts holding a sound copy), and `notes`, what
    was missing or bad on the way (for one line)."""

    iteration: Optional[int]
    world: int = 0
    holders: Dict[int, List[str]] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


def choose(inventories: Sequence[Sequence[Iteration]], newer_than: int) -> Choice:
    """The newest iteration newer than `newer_than` (the persistent tier's) of which every
    saving rank's piece has a sound copy on some node of `inventories` (one list per surviving
    node). Iterations passed over (refused ones too: never used), and bad copies, are named in
    `notes`. A marker's world is believed only up to the ranks whose pieces the nodes list."""
    by_iteration: Dict[int, List[Iteration]] = {}
    for node in inventories:
        for it in node:
            by_iteration.setdefault(it.iteration, []).append(it)
    notes: List[str] = []
    for iteration in sorted(by_iteration, reverse=True):
        if iteration <= newer_than:
            notes.append(f"local iteration {iteration} is not newer than the persistent checkpoint's "
                         f"{newer_than}")
            break
        refused = sorted({it.refused for it in by_iteration[iteration] if it.refused is not None})
        if refused:
            more = f"; and on {len(refused) - 2} more node(s)" if len(refused) > 2 else ""
            notes.append(f"local iteration {iteration} not used: " + "; ".join(refused[:2]) + more)
        found = [it for it in by_iteration[iteration] if it.refused is None]
        if not found:
            continue
        worlds = {it.world for it in found}
        if len(worlds) != 1:
            notes.append(f"local iteration {iteration}: nodes disagree on its world size {sorted(worlds)}")
            continue
        world = worlds.pop()
        listed = len({c.rank for it in found for c in it.copies if c.rank < world})
        if listed < world:  # before anything is built per rank: a marker may lie about the world
            notes.append(f"local iteration {iteration}: its COMPLETE marker says {world} ranks saved, the "
                         f"nodes hold pieces of {listed}")
            continue
        holders: Dict[int, List[str]] = {r: [] for r in range(world)}
        bad = []
        for it in found:
            for c in it.copies:
                if c.rank not in holders:
                    bad.append(f"{c.host}: rank {c.rank}'s piece (rank outside world {world})")
                elif c.bad is None:
                    holders[c.rank].append(c.host)
                else:
                    bad.append(f"{c.host}: rank {c.rank}'s piece {c.bad}")
        missing = [r for r, hs in holders.items() if not hs]
        if bad:
            notes.append(f"local iteration {iteration}: bad copies: " + "; ".join(bad))
        if missing:
            notes.append(f"local iteration {iteration}: no sound copy of the pieces of ranks "
                         f"{_ranges(missing)}")
            continue
        return Choice(iteration, world, {r: sorted(set(hs)) for r, hs in holders.items()}, notes)
    return Choice(None, notes=notes)


def mark_bad(inventories: Sequence[Sequence[Iteration]], bad: Sequence[Tuple[str, int, int, str]]) -> list:
    """`inventories` with the copies `bad` names ((host, iteration, rank, why)) marked bad: what
    a read of them found, for the next `choose`."""
    why = {(h, it, r): w for h, it, r, w in bad}
    return [[replace(it, copies=tuple(replace(c, bad=why.get((c.host, it.iteration, c.rank), c.bad))
                                      for c in it.copies)) for it in node] for node in inventories]


def refuse(inventories: Sequence[Sequence[Iteration]], iteration: int, why: str) -> list:
    """`inventories` with `iteration` refused on every node (its pieces, all sound, do not make a
    whole checkpoint), for the next `choose`."""
    return [[replace(it, refused=why) if it.iteration == iteration else it for it in node]
            for node in inventories]


def held_copies(inventories: Sequence[Sequence[Iteration]], iteration: int, host: str) -> Dict[int, Copy]:
    """Saving rank -> the copy `host` holds of `iteration` (as its inventory lists it)."""
    return {c.rank: c for node in inventories for it in node if it.iteration == iteration and it.refused is None
            for c in it.copies if c.host == host}


def padded_vocab_of(inventories: Sequence[Sequence[Iteration]], iteration: int) -> Optional[int]:
    """The padded vocabulary the nodes' markers record for `iteration`; None when none records
    one or they disagree (the restore's own check of the manifest decides then)."""
    found = {it.padded_vocab for node in inventories for it in node if it.iteration == iteration}
    return found.pop() if len(found) == 1 else None


def transfers(choice: Choice, hosts: Sequence[str]) -> List[Tuple[int, int, int]]:
    """(sender rank, receiver rank, saving rank) for every piece a node lacks: it comes from
    the first node (in host-name order) that holds a sound copy. The pieces a node receives
    go to its ranks in turn, and the pieces a node sends leave from its ranks in turn: every
    rank of both reads and checks, or writes, a share, in parallel (a node's first rank alone
    would move all of them)."""
    nodes = nodes_of(hosts)
    sent = dict.fromkeys(nodes, 0)
    out = []
    for host, ranks in nodes.items():
        lacking = [rank for rank, holding in sorted(choice.holders.items()) if host not in holding]
        for k, rank in enumerate(lacking):
            source = sorted(h for h in choice.holders[rank] if h in nodes)[0]
            out.append((nodes[source][sent[source] % len(nodes[source])], ranks[k % len(ranks)], rank))
            sent[source] += 1
    return out


def merge(spans) -> np.ndarray:
    """Byte spans [(start, end)] (any order, overlapping or touching) as the sorted, disjoint,
    non-touching (k, 2) int64 array of [start, end) that covers the same bytes; empty spans
    dropped."""
    a = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    a = a[a[:, 1] > a[:, 0]]
    if not len(a):
        return a
    a = a[np.argsort(a[:, 0], kind="stable")]
    reach = np.maximum.accumulate(a[:, 1])
    new = np.concatenate([[True], a[1:, 0] > reach[:-1]])
    starts = a[new, 0]
    ends = reach[np.concatenate([np.flatnonzero(new)[1:] - 1, [len(a) - 1]])]
    return np.stack([starts, ends], axis=1)


def span_bytes(spans: np.ndarray) -> int:
    """Bytes of merged spans (merge)."""
    return int((spans[:, 1] - spans[:, 0]).sum()) if len(spans) else 0


def within(spans: np.ndarray, start: int, end: int) -> bool:
    """Whether bytes [start, end) lie inside merged `spans` (merge)."""
    if end <= start:
        return True
    i = int(np.searchsorted(spans[:, 0], start, side="right")) - 1
    return i >= 0 and end <= int(spans[i, 1])


def node_spans(needs: Sequence[Tuple[str, dict]], moves: Sequence[Tuple[int, int, int]],
               hosts: Sequence[str]) -> Dict[Tuple[int, int], np.ndarray]:
    """(receiver rank, saving rank) -> the merged byte spans of that piece the receiver's node
    gets, for every move of `transfers`: the union of what the node's ranks read of it
    (`needs[rank]`: (host, {saving rank: spans})), each byte once, nothing else."""
    out = {}
    for _, receiver, saved in moves:
        host = hosts[receiver]
        parts = [n[saved] for h, n in needs if h == host and saved in n]
        out[(receiver, saved)] = merge(np.concatenate(parts) if parts else [])
    return out


def _ranges(ranks: List[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)
