"""A restart from the local tier, step 3 (local_restore.py): what a node lacks of the chosen
iteration, from the node that holds it, and nothing its ranks do not read.

First the headers (`headers`): every piece's header is needed on every node (rank 0's holds
the manifest head, each its RNG state and the regions the index of the reads is built from),
so each node's leader receives the header of each piece its node lacks and stages it as a
sparse file of the piece's size in the node's staging folder (STAGING: removed at the start of
every restore, so that a restart killed meanwhile leaves the tier as it was). Then, once the
load's read plan is made (piece_reads.PieceSource.plan_reads), the data (`fetch`): every rank's
byte spans of those pieces, gathered; each receiving node gets the union of its ranks' spans
(local_plan.node_spans: each byte once per node), written into the staged files at their
offsets, from which its ranks read them as from the pieces. The sender read and checked each
piece it sends whole against its CRC-32 before (a partial piece cannot be checked); nothing
received is kept as a copy of the tier.
"""

import os
import shutil

import numpy as np
import torch.distributed as dist

from megatron_ucp.engine import local_plan
from megatron_ucp.engine.local_tier import exchange_bytes
from megatron_ucp.format import local_piece

STAGING = ".ucp_receiving"  # in a node dir: what a restore received, for the length of its load


def staging_dir(node_dir: str) -> str:
    return os.path.join(node_dir, STAGING)


def staged_path(node_dir: str, rank: int) -> str:
    return os.path.join(staging_dir(node_dir), f"rank_{rank:05d}.part")


def clear(tier) -> None:
    """Leaders: the staging folder a restore (or a killed one) left, removed."""
    if tier.leader:
        shutil.rmtree(staging_dir(tier.node_dir), ignore_errors=True)


def header_length(data) -> int:
    """Bytes of a piece's header, its 8-byte length included."""
    return 8 + int.from_bytes(bytes(data[:8]), "little") if len(data) >= 8 else len(data)


def headers(tier, choice, held: dict, here: dict, found) -> tuple:
    """Collective: every node's leader receives the header of each piece its node lacks from
    the node that holds it and stages it (`stage_header`). `held`: the pieces this leader
    sends (whole, checked); `here`: {saving rank: (bytes, header digest)} of those this node
    checked. Returns ({saving rank: (bytes, header digest)} of every piece this node reads,
    {saving rank: its staged file}, {host: header bytes it received}, why a node cannot stage
    them or None), the same on every rank of a node."""
    rank = dist.get_rank()
    moves = local_plan.transfers(choice, tier.hosts)
    sends = [(receiver, memoryview(held[saved])[:header_length(held[saved])])
             for sender, receiver, saved in moves if sender == rank]
    receiving = [(sender, saved) for sender, receiver, saved in moves if receiver == rank]
    clear(tier)
    received = exchange_bytes(sends, [s for s, _ in receiving], tier.group)
    checked, staged, refused, nbytes = dict(here), {}, None, 0
    if tier.leader:
        for i, (sender, saved) in enumerate(receiving):
            size = local_plan.held_copies(found, choice.iteration, tier.hosts[sender])[saved].nbytes
            nbytes += len(received[i])
            try:
                staged[saved] = stage_header(tier.node_dir, saved, received[i], size)
            except OSError as e:
                refused = refused or f"staging the received headers on {tier.host} failed ({e})"
            checked[saved] = (size, digest(received[i]))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (tier.host, checked, staged, nbytes, refused) if tier.leader else None,
                           group=tier.group)
    mine = next(x for x in everyone if x is not None and x[0] == tier.host)
    by_node = {x[0]: x[3] for x in everyone if x is not None}
    return mine[1], mine[2], by_node, next((x[4] for x in everyone if x is not None and x[4]), None)


def stage_header(node_dir: str, rank: int, header, size: int) -> str:
    """A staged piece: a new sparse file of the piece's `size` holding its header; returns it."""
    path = staged_path(node_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        if os.pwrite(fd, header, 0) != len(header):
            raise OSError(f"{path}: short write")
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    return path


def stage_spans(path: str, spans: np.ndarray, data) -> None:
    """The bytes of merged `spans` of a staged piece, `data` their concatenation, written at
    their offsets."""
    fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        view, pos = memoryview(data), 0
        for start, end in spans.tolist():
            n = end - start
            if os.pwrite(fd, view[pos:pos + n], start) != n:
                raise OSError(f"{path}: short write at byte {start}")
            pos += n
    finally:
        os.close(fd)


def fetch(tier, choice, held: dict, staged: dict, needs: dict) -> tuple:
    """Collective, once the load's read plan is made: `needs` {saving rank: merged byte spans}
    this rank reads of the staged pieces; each receiving node gets the union of its ranks'
    spans from the node that sends it the piece, written into its staged files. Returns
    ({saving rank: spans this node received}, {host: bytes it received}, why a node could not
    take them or None), the same on every rank of a node."""
    rank = dist.get_rank()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (tier.host, needs), group=tier.group)
    moves = local_plan.transfers(choice, tier.hosts)
    wanted = local_plan.node_spans(everyone, moves, tier.hosts)
    sends = [(receiver, _cut(held[saved], wanted[(receiver, saved)]))
             for sender, receiver, saved in moves if sender == rank]
    receiving = [(sender, saved) for sender, receiver, saved in moves if receiver == rank]
    received = exchange_bytes(sends, [s for s, _ in receiving], tier.group)
    sends = None
    refused, nbytes = None, 0
    for i, (_, saved) in enumerate(receiving):
        spans = wanted[(rank, saved)]
        nbytes += len(received[i])
        if len(received[i]) != local_plan.span_bytes(spans):
            refused = refused or (f"{tier.host} received {len(received[i])} bytes of rank {saved}'s piece, "
                                  f"expected {local_plan.span_bytes(spans)}")
            continue
        try:
            stage_spans(staged[saved], spans, received[i])
        except OSError as e:
            refused = refused or f"staging the received bytes on {tier.host} failed ({e})"
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (tier.host, nbytes, refused) if tier.leader else None, group=tier.group)
    by_node = {x[0]: x[1] for x in everyone if x is not None}
    leader = local_plan.leaders(tier.hosts)[tier.host]
    mine = {saved: spans for (receiver, saved), spans in wanted.items() if receiver == leader}
    return mine, by_node, next((x[2] for x in everyone if x is not None and x[2]), None)


def _cut(data, spans: np.ndarray) -> bytes:
    """The bytes of `data` in merged `spans`, concatenated."""
    view = memoryview(data)
    return b"".join(view[start:end] for start, end in spans.tolist())


def digest(data: bytes) -> str:
    """The header digest of a piece's bytes, or of its header alone (local_piece.read_header's)."""
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    return local_piece.header_digest(data[8:8 + n])


def sent_by(tier, choice) -> set:
    """The saving ranks whose pieces this rank sends to other nodes (local_plan.transfers)."""
    return {saved for sender, _, saved in local_plan.transfers(choice, tier.hosts) if sender == dist.get_rank()}


def needed(loads) -> dict:
    """{host: bytes its ranks read of the pieces it lacked, each byte once} of the nodes that
    lacked any, from each rank's (host, _, {staged piece: merged spans it read})."""
    spans: dict = {}
    for host, _, read in loads:
        for piece, s in read.items():
            spans.setdefault(host, {}).setdefault(piece, []).append(s)
    return {host: sum(local_plan.span_bytes(local_plan.merge(np.concatenate(s))) for s in pieces.values())
            for host, pieces in spans.items()}


def traffic(received: dict, loads: list, needed: dict = None, headers: dict = None) -> str:
    """Per node: MB received from other nodes / MB its ranks loaded (from the pieces and from
    their replica groups; a byte two ranks of a node load counts twice); with `needed` {host:
    bytes its ranks read of the pieces it lacked, each byte once}, the exact bytes received /
    needed of the nodes that received any; with `headers` {host: header bytes received}, those."""
    loaded: dict = {}
    for host, nbytes in loads:
        loaded[host] = loaded.get(host, 0) + nbytes
    line = "MB received / loaded: " + ", ".join(
        f"{host} {received.get(host, 0) / 1e6:.1f} / {loaded[host] / 1e6:.1f}" for host in sorted(loaded))
    if needed:
        line += "; bytes received / read of the pieces a node lacked: " + ", ".join(
            f"{host} {received.get(host, 0)} / {needed[host]}" for host in sorted(needed))
    if headers and any(headers.values()):
        line += "; headers received: " + ", ".join(
            f"{host} {n / 1e3:.1f} kB" for host, n in sorted(headers.items()) if n)
    return line
