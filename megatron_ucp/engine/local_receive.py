"""A restart from the local tier, step 3 (local_restore.py): what a node lacks of the chosen
iteration, from the node that holds it, and nothing its ranks do not read.

First the headers (`headers`): every piece's header is needed on every node (rank 0's holds
the manifest head, each its RNG state and the regions the index of the reads is built from),
so a rank of each node receives the header of each piece its node lacks and stages it as a
sparse file of the piece's size in the node's staging folder (STAGING: removed at the start of
every restore, so that a restart killed meanwhile leaves the tier as it was). Then, once the
load's read plan is made (piece_reads.PieceSource.plan_reads), the data (`fetch`): every rank's
byte spans of those pieces, gathered; each receiving node gets the union of its ranks' spans
(local_plan.node_spans: each byte once per node), streamed in messages of WINDOW bytes (two in
flight: the sender fills one while the other travels, the receiver writes one while the next
arrives) into the staged files at their offsets, from which its ranks read them as from the
pieces. The sender maps its copy (local_piece.MappedPiece) and sends only the bytes asked for,
each chunk they lie in checked against its CRC-32 (local_piece.check_chunks) before any byte of
it goes: a message of one span straight from the mapping, one of several spans copied into a
message buffer reused across messages; no piece is read into memory of its own. Nothing
received is kept as a copy of the tier.
"""

import os
import shutil

import numpy as np
import torch
import torch.distributed as dist

from megatron_ucp.engine import local_plan
from megatron_ucp.engine.local_tier import exchange_bytes
from megatron_ucp.errors import FormatError, IncompleteCheckpointError, IntegrityError
from megatron_ucp.format import local_piece
from megatron_ucp.format.safe_files import open_regular

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


def headers(tier, choice, here: dict, found) -> tuple:
    """Collective: the header of each piece a node lacks goes from a rank of the node that
    holds it to a rank of that node (local_plan.transfers), which stages it (`stage_header`);
    the sender reads it through the piece's chunks' CRC-32s and checks it is the header its
    node checked. `here`: {saving rank: (bytes, header digest)} of the pieces this node holds.
    Returns ({saving rank: (bytes, header digest)} of every piece this node reads, {saving
    rank: its staged file}, {host: header bytes it received}, why a node cannot stage them or
    None, [(host, iteration, saving rank, why)] of the copies a sender found bad), the same on
    every rank of a node."""
    rank = dist.get_rank()
    moves = local_plan.transfers(choice, tier.hosts)
    mine = local_plan.held_copies(found, choice.iteration, tier.host)
    sends, bad = [], []
    for sender, receiver, saved in moves:
        if sender == rank:
            try:
                head = _checked_header(tier.node_dir, choice.iteration, saved, mine[saved], here[saved][1])
            except IntegrityError as e:
                bad.append((tier.host, choice.iteration, saved, str(e)))
                head = b""  # the receiver hears of it below
            sends.append((receiver, head))
    receiving = [(sender, saved) for sender, receiver, saved in moves if receiver == rank]
    clear(tier)
    dist.barrier(group=tier.group)  # the staging folders are new before any rank stages into them
    received = exchange_bytes(sends, [s for s, _ in receiving], tier.group)
    checked, staged, refused, nbytes = dict(here), {}, None, 0
    for i, (sender, saved) in enumerate(receiving):
        size = local_plan.held_copies(found, choice.iteration, tier.hosts[sender])[saved].nbytes
        nbytes += len(received[i])
        if not len(received[i]):
            continue  # its sender found it bad
        try:
            staged[saved] = stage_header(tier.node_dir, saved, received[i], size)
        except OSError as e:
            refused = refused or f"staging the received headers on {tier.host} failed ({e})"
        checked[saved] = (size, digest(received[i]))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (tier.host, checked, staged, nbytes, refused, bad), group=tier.group)
    checked, staged, by_node = {}, {}, {}
    for host, c, s, n, _, _ in everyone:
        by_node[host] = by_node.get(host, 0) + n
        if host == tier.host:  # what this node's ranks staged: every rank of it reads them
            checked.update(c)
            staged.update(s)
    return (checked, staged, by_node, next((x[4] for x in everyone if x[4]), None),
            [b for x in everyone for b in x[5]])


def _checked_header(node_dir: str, iteration: int, rank: int, copy, expected: str) -> bytes:
    """The header of this node's copy of saving rank `rank`'s piece (its 8-byte length
    included), read through the chunks that hold it, each checked against its CRC-32, and equal
    to the header checked before (digest `expected`): IntegrityError naming the piece otherwise."""
    path = local_piece.piece_path(node_dir, iteration, rank)
    fd = _open_piece(path)
    try:
        buf = bytearray(copy.chunk_bytes)
        data = local_piece.read_chunks(fd, path, copy.nbytes, copy.chunk_bytes, copy.chunk_crc32, 0, 1, buf)
        n = header_length(data)
        if n > len(data):  # a header beyond the first chunk
            last = local_piece.chunk_range(copy.chunk_bytes, 0, min(n, copy.nbytes))[1]
            data = local_piece.read_chunks(fd, path, copy.nbytes, copy.chunk_bytes, copy.chunk_crc32, 0, last,
                                           bytearray(last * copy.chunk_bytes))
        header = bytes(data[:n])
    finally:
        os.close(fd)
    if digest(header) != expected:
        raise IntegrityError(f"{path}: its header changed after it was checked")
    return header


def _open_piece(path: str) -> int:
    try:
        return open_regular(path, "local-tier piece")
    except (FormatError, IncompleteCheckpointError) as e:
        raise IntegrityError(f"{path}: unreadable ({e})") from None


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


WINDOW = 16 * 2**20  # bytes per message of a piece's spans (two in flight per transfer)


def messages(spans: np.ndarray, window: int = WINDOW) -> list:
    """Pure: merged `spans` cut, in order, into messages of at most `window` bytes: [[(start,
    end)]]. Both ends compute them from the spans: no sizes travel."""
    out, parts, room = [], [], window
    for start, end in spans.tolist():
        while start < end:
            take = min(end - start, room)
            parts.append((start, start + take))
            start, room = start + take, room - take
            if room == 0:
                out.append(parts)
                parts, room = [], window
    if parts:
        out.append(parts)
    return out


def fetch(tier, choice, found, staged: dict, needs: dict, bad: dict) -> tuple:
    """Collective, once the load's read plan is made: `needs` {saving rank: merged byte spans}
    this rank reads of the staged pieces; each receiving node gets the union of its ranks'
    spans from the node that sends it the piece, streamed (`_send`, `_receive`) into its staged
    files. A sender reads and checks only the chunks of the bytes it sends; a chunk that fails
    puts its copy in `bad` {saving rank: why} on the sender. Returns ({saving rank: spans this
    node received}, {host: bytes it received}, why a node could not take them or None, why a
    sender's copy failed or None), the same on every rank of a node."""
    rank = dist.get_rank()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (tier.host, needs), group=tier.group)
    moves = local_plan.transfers(choice, tier.hosts)
    wanted = local_plan.node_spans(everyone, moves, tier.hosts)
    mine = local_plan.held_copies(found, choice.iteration, tier.host)
    refused, failed, nbytes = None, None, 0
    buffers = _Buffers()
    for sender, receiver, saved in moves:  # in the same order everywhere: each pair meets in turn
        spans = wanted[(receiver, saved)]
        if sender == rank:
            why = _send(local_piece.piece_path(tier.node_dir, choice.iteration, saved), mine[saved], spans,
                        receiver, tier.group, buffers)
            if why:
                bad[saved] = failed = why
        elif receiver == rank:
            nbytes += local_plan.span_bytes(spans)
            why = _receive(staged.get(saved), spans, sender, tier.group, buffers)
            refused = refused or (why and f"staging the received bytes on {tier.host} failed ({why})")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (tier.host, nbytes, refused, failed), group=tier.group)
    by_node: dict = {}
    for host, n, _, _ in everyone:
        by_node[host] = by_node.get(host, 0) + n
    received = {saved: spans for (receiver, saved), spans in wanted.items() if tier.hosts[receiver] == tier.host}
    return (received, by_node, next((x[2] for x in everyone if x[2]), None),
            next((x[3] for x in everyone if x[3]), None))


class _Buffers:
    """A transfer's two message buffers (reused: one is filled while the other travels)."""

    def __init__(self):
        self.message = [None, None]

    def get(self, k: int, nbytes: int) -> torch.Tensor:
        buf = self.message[k % 2]
        if buf is None or buf.numel() < nbytes:
            buf = self.message[k % 2] = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return buf


def _send(path: str, copy, spans: np.ndarray, peer: int, group, buffers: _Buffers):
    """Streams the bytes of merged `spans` of this node's copy (local_plan.Copy) of a piece to
    `peer`, in `messages` (`_message`: each chunk they lie in checked against its CRC-32 before
    any byte of it is sent). Returns why the copy failed, or None; after a failure the
    remaining messages still go (unchecked bytes, which the receivers drop): every receive is
    matched."""
    failed, pending, mapped, checked = None, [None, None], None, set()
    try:
        mapped = _mapped(path)
    except (FormatError, IncompleteCheckpointError, OSError) as e:
        failed = f"{path}: unreadable ({e})"
    try:
        for k, parts in enumerate(messages(spans)):
            if pending[k % 2] is not None:
                pending[k % 2].wait()
            n = sum(end - start for start, end in parts)
            out = buffers.get(k, n)[:n]
            if failed is None:
                try:
                    out = _message(mapped.data, path, copy, parts, out, checked)
                except IntegrityError as e:
                    failed = str(e)
            pending[k % 2] = dist.isend(out, peer, group=group)
        for request in pending:
            if request is not None:
                request.wait()
    finally:
        if mapped is not None:
            mapped.close()  # a send still holding a view keeps the mapping until it ends
    return failed


def _mapped(path: str):
    """The sender's copy mapped copy-on-write (writeable: messages are tensors made of it), or
    read-only where that is refused (a strict overcommit policy counts a writeable private
    mapping against the node's memory): its messages then go through the buffers."""
    try:
        return local_piece.MappedPiece(path, private=True)
    except OSError:
        return local_piece.MappedPiece(path)


def _message(data: np.ndarray, path: str, copy, parts: list, buffer: torch.Tensor, checked: set) -> torch.Tensor:
    """The bytes of `parts` of the piece mapped as `data`, once the chunks they lie in are
    checked (`_check`): a view of the mapping itself where they are one span (sent from the page
    cache: no copy; a mapping that is not writeable cannot make a tensor), else copied into
    `buffer` (`_fill`)."""
    if len(parts) == 1 and data.flags.writeable:
        (start, end), = parts
        _check(data, path, copy, start, end, checked)
        return torch.from_numpy(data[start:end])
    _fill(data, path, copy, parts, buffer.numpy(), checked)
    return buffer


def _check(data: np.ndarray, path: str, copy, start: int, end: int, checked: set) -> None:
    """The chunks of bytes [start, end) of `copy` (local_plan.Copy), mapped as `data`, checked
    against their CRC-32s, each once (`checked`: the chunks checked so far)."""
    local_piece.check_new_chunks(data, path, copy.nbytes, copy.chunk_bytes, copy.chunk_crc32, start, end, checked)


def _fill(data: np.ndarray, path: str, copy, parts: list, out: np.ndarray, checked: set) -> None:
    """out[:bytes of `parts`] = the piece's bytes of `parts`, copied from `data` (the piece
    mapped), each part once the chunks it lies in are checked (`_check`)."""
    pos = 0
    for start, end in parts:
        _check(data, path, copy, start, end, checked)
        out[pos:pos + end - start] = data[start:end]
        pos += end - start


def _receive(path, spans: np.ndarray, peer: int, group, buffers: _Buffers):
    """Receives the bytes of merged `spans` of a piece from `peer`, in `messages`, writing each
    at its offsets into the staged file `path` while the next one travels. Returns why they
    could not be written, or None (every message is received either way)."""
    msgs = messages(spans)
    pending, failed, fd = [None, None], None, None
    try:
        if path is None:
            failed = "no staged file (its header was not received)"
        else:
            fd = os.open(path, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        failed = str(e)
    sizes = [sum(end - start for start, end in parts) for parts in msgs]

    def post(k):
        buf = buffers.get(k, sizes[k])[:sizes[k]]
        pending[k % 2] = (dist.irecv(buf, peer, group=group), buf)

    try:
        for k in range(min(2, len(msgs))):
            post(k)
        for k, parts in enumerate(msgs):
            request, buf = pending[k % 2]
            request.wait()
            if failed is None:
                try:
                    stage_spans(fd, path, parts, buf.numpy())
                except OSError as e:
                    failed = str(e)
            if k + 2 < len(msgs):
                post(k + 2)
    finally:
        if fd is not None:
            os.close(fd)
    return failed


def stage_spans(fd: int, path: str, parts: list, data) -> None:
    """The bytes of `parts` [(start, end)] of a staged piece (open as `fd`), `data` their
    concatenation, written at their offsets."""
    pos = 0
    for start, end in parts:
        n = end - start
        if os.pwrite(fd, data[pos:pos + n], start) != n:
            raise OSError(f"{path}: short write at byte {start}")
        pos += n


def digest(data: bytes) -> str:
    """The header digest of a piece's bytes, or of its header alone (local_piece.read_header's)."""
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    return local_piece.header_digest(data[8:8 + n])


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
