"""The local tier's pieces read as a universal checkpoint, in place: no folder is assembled.

A restore from the local tier loads universally (engine/load.py), but its reads come from the
pieces on this node's dir instead of tensor files. For every (atomic tensor, file tensor name)
an index of element runs -> (piece, byte offset) is built from the pieces' headers (each
region's runs in its part: layout.region_runs); a read of runs of the atomic tensor is served
by copies from the pieces mapped read-only (the page cache of the node is their one copy), each
byte of a piece a rank needs read once, nothing else. A rank of the saving layout reads its own
piece and, where it owned every byte it holds, nothing else (`touched` counts per piece).

The node's leader checked each piece's header and size before (local_restore); each rank
checks that the header it indexes is that one (digest and size), and the CRC-32 of each chunk
of a piece the first time it reads from that chunk (local_piece.check_chunks): a rank checks
only what it reads, the ranks of a node in parallel. A piece that fails is named in `bad` (the
restore takes another copy) and the read raises.

The pieces a node lacks are staged (local_receive.py): a sparse file holding the piece's header,
into which, once the load's read plan is made (`plan_reads`, called by the load), `fetch` writes
the byte spans this node's ranks read of it and nothing else; a read outside them is refused.
"""

import dataclasses
import threading

import numpy as np

from megatron_ucp.engine import local_plan
from megatron_ucp.engine.collective import run_everywhere
from megatron_ucp.engine.local_check import head_entries, piece_layout
from megatron_ucp.engine.planner import part_shapes_of
from megatron_ucp.engine.reads import file_runs
from megatron_ucp.errors import FormatError, IncompleteCheckpointError, IntegrityError, LayoutError
from megatron_ucp.format import local_piece, manifest as mf
from megatron_ucp.format.folder import iteration_dir
from megatron_ucp.format.layout import region_runs
from megatron_ucp.format.safe_files import IOV_MAX
from megatron_ucp.format.tensor_entry import file_layout, file_tensor_name
from megatron_ucp.mcore import rng

F32 = 4
_NONE = np.zeros((0, 2), dtype=np.int64)


class PieceSource:
    """A universal checkpoint's reader over the pieces of `iteration` in `node_dir`: `checked`
    {saving rank: (bytes, header digest)} as the leader checked them, `sums` {saving rank:
    (chunk bytes, each chunk's CRC-32)} of its piece (a piece missing there is not checked
    again: its bytes were checked by the node that sent them). `manifest` is rank 0's piece's
    head, `rng(rank)` a saving rank's RNG state, `read_runs` tensor_io.read_runs's interface
    with the atomic tensor's name in place of the file's path. `staged` {saving rank: its
    staged file}: the pieces this node lacks; `fetch(needs)` (set by the restore; collective)
    gets the spans of them this node's ranks read (local_receive.fetch's interface)."""

    def __init__(self, node_dir: str, iteration: int, checked: dict, sums: dict = None, staged: dict = None):
        self.where = iteration_dir(node_dir, iteration)
        self.checked = dict(checked)
        self.sums = dict(sums or {})
        self._ok: dict = {}  # saving rank -> the chunks of its piece checked here
        self.staged = dict(staged or {})
        self.fetch, self.refused, self.overlap = None, None, False
        self._fetching, self._failed = None, None  # the transfer's thread (overlap), why it failed
        self.received: dict = {}  # staged piece -> the merged byte spans its file holds
        self.received_by_node: dict = {}  # host -> bytes it received (fetch)
        self.spans: dict = {}  # staged piece -> [(start, end)] this rank read of it
        self.bad: dict = {}  # saving rank -> why its piece failed its CRC-32 here
        self._checks: dict = {}  # saving rank -> the lock its chunks are checked under
        self.paths, self.metas, self.touched = {}, {}, {}
        listed = {}
        for rank, (nbytes, digest) in sorted(checked.items()):
            path = self.staged.get(rank) or local_piece.piece_path(node_dir, iteration, rank)
            self.metas[rank], listed[rank] = piece_regions(path, nbytes, digest)
            self.paths[rank] = path
        if 0 not in self.metas:
            raise IncompleteCheckpointError(f"{self.where}: rank 0's piece (the manifest head) is not here")
        self.manifest = _manifest(self.metas[0].get("head"), self.paths[0], self.where)
        self.index = _index(listed, part_shapes_of(self.manifest.tensors), self.paths)
        self._maps, self._lock = {}, threading.Lock()  # saving rank -> its file, mapped

    def plan_reads(self, m, tensors, reading) -> None:
        """Collective (the load calls it once its read plan `reading` is made, before any
        tensor is read): the spans of the staged pieces this rank will read, fetched (each
        node gets its ranks' union). With `overlap`, the transfer runs in a thread of its own
        (the tier's group) while the ranks read what their node holds; a read of a staged
        piece waits for it, and `reads_done` ends it. Otherwise, and in `reads_done`:
        IncompleteCheckpointError on every rank, `refused` set, when a node could not take
        them; IntegrityError on every rank when a sender's copy failed its check (the
        sender's `bad` names it)."""
        if self.fetch is None:
            return
        needs = run_everywhere(self.needs, m, tensors, reading)
        if not self.overlap:
            self._transfer(needs)
            self._fetched()
            return
        self._fetching = threading.Thread(target=self._transfer, args=(needs,), name="ucp-local-fetch", daemon=True)
        self._fetching.start()

    def _transfer(self, needs) -> None:
        try:
            self.received, self.received_by_node, self.refused, self._failed = self.fetch(needs)
        except Exception as e:  # raised in the reading threads and reads_done
            self._failed = f"{type(e).__name__}: {e}"

    def settle(self) -> None:
        """Wait for the transfer in flight, if any (its sends complete: every rank's do)."""
        if self._fetching is not None:
            self._fetching.join()

    def _fetched(self) -> None:
        """After the transfer: what it failed with, raised (the same on every rank)."""
        self.settle()
        if self._failed:  # a sender's copy failed its CRC-32 (named in its `bad`)
            raise IntegrityError(f"{self.where}: a piece sent from another node failed its check ({self._failed})")
        if self.refused:
            raise IncompleteCheckpointError(f"{self.where}: {self.refused}")

    def reads_done(self) -> None:
        """The load's reads are done: the transfer is too, and its failure raised here."""
        if self.fetch is not None:
            self._fetched()

    def needs(self, m, tensors, reading) -> dict:
        """{staged piece: merged byte spans} that the reads of `reading` (reads.ReadPlan) make
        of the staged pieces: the runs read_range reads, mapped through the index as read_runs
        maps them."""
        out: dict = {}
        for i, t in enumerate(tensors):
            for state, start, stop, _ in reading.reads[i]:
                for name, runs in file_runs(m.tensors[t.name], t, state, start, stop)[0]:
                    index = self.index.get((t.name, name))
                    runs = runs[runs[:, 2] > 0]
                    if index is None or not len(runs):
                        continue  # the read itself names what is missing
                    where = f"{self.where}, tensor {t.name!r} ({name})"
                    for piece, offset, parts in _copies(index, runs[:, 0], runs[:, 1], runs[:, 2], where):
                        if piece in self.staged:
                            out.setdefault(piece, []).append((offset, offset + F32 * sum(n for _, n in parts)))
        return {piece: local_plan.merge(spans) for piece, spans in out.items()}

    def rng(self, rank: int) -> dict:
        """Saving rank `rank`'s RNG state, checked (rng.read's errors, naming its piece)."""
        path = self.paths.get(rank, f"{self.where} (no piece of rank {rank})")
        state = self.metas.get(rank, {}).get("rng")
        if state is None:
            raise IncompleteCheckpointError(
                f"{path}: RNG state of rank {rank} is missing; load with load_rng=False (--no-load-rng) "
                "to reseed instead")
        return rng.checked(state, path)

    def read_runs(self, tensor: str, layout, name: str, runs, out: np.ndarray, counter=None,
                  hash_spans=(), hashes=None) -> int:
        """Fill out.reshape(-1)[dst:dst+len] from elements src.. of `name` of atomic `tensor`:
        runs = [(element, out element, length)], from the pieces that hold them. No hashing
        (`hash_spans` must be empty: the pieces' CRC-32 was checked)."""
        where = f"{self.where}, tensor {tensor!r} ({name})"
        if hash_spans:
            raise LayoutError(f"{where}: the local tier's pieces are not hashed per block")
        if out.dtype != np.float32 or not out.flags.c_contiguous or not out.flags.writeable:
            raise LayoutError(f"{where}: output array must be C-contiguous writeable float32")
        r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
        f, b, n = r[:, 0], r[:, 1], r[:, 2]
        if ((f < 0) | (b < 0) | (n < 0) | (f + n > layout.numel(name)) | (b + n > out.size)).any():
            raise LayoutError(f"{where}: a run lies outside the tensor or the array")
        index = self.index.get((tensor, name))
        if index is None:
            raise IncompleteCheckpointError(f"{where}: no piece holds it")
        dst = out.reshape(-1).view(np.uint8)
        total = calls = 0
        mine: dict = {}
        for piece, offset, parts in _copies(index, f[n > 0], b[n > 0], n[n > 0], where):
            want = F32 * sum(ln for _, ln in parts)
            if piece in self.staged:
                self._fetched()  # its spans are written
                if not local_plan.within(self.received.get(piece, _NONE), offset, offset + want):
                    raise IntegrityError(f"{self.paths[piece]}: bytes [{offset}, {offset + want}) were not "
                                         "received (the read plan and the reads disagree)")
                mine.setdefault(("spans", piece), []).append((offset, offset + want))
            src = self._mapped(piece)
            self._check(piece, src, offset, offset + want)
            if offset + want > len(src):
                raise IntegrityError(f"{self.paths[piece]}: ends at byte {len(src)} inside a region (needed "
                                     f"bytes up to {offset + want}): the piece changed after it was checked")
            at = offset
            for bs, ln in parts:  # numpy copies without the GIL: the reading threads go on
                np.copyto(dst[bs * F32:(bs + ln) * F32], src[at:at + ln * F32])
                at += ln * F32
            total, calls = total + want, calls + 1
            mine[piece] = mine.get(piece, 0) + want
        with self._lock:
            for piece, nbytes in mine.items():
                if isinstance(piece, tuple):
                    self.spans.setdefault(piece[1], []).extend(nbytes)
                else:
                    self.touched[piece] = self.touched.get(piece, 0) + nbytes
            if counter is not None:
                counter.bytes += total
                counter.calls += calls
        return total

    def _mapped(self, piece: int) -> np.ndarray:
        """The bytes of `piece`'s file, mapped (local_piece.MappedPiece): the node's page cache
        itself, checked and copied in place. A file shorter than its sidecar says is named by
        the first read past its end."""
        with self._lock:
            if piece not in self._maps:
                self._maps[piece] = local_piece.MappedPiece(self.paths[piece])
            return self._maps[piece].data

    def _check(self, piece: int, src: np.ndarray, start: int, end: int) -> None:
        """The chunks of `piece` (mapped as `src`) that hold bytes [start, end), checked against
        their CRC-32s where not checked here before (the piece's other readers wait; other
        pieces' go on)."""
        if piece not in self.sums:
            return
        chunk, sums = self.sums[piece]
        with self._lock:
            check = self._checks.setdefault(piece, threading.Lock())
        with check:
            if piece in self.bad:
                raise IntegrityError(self.bad[piece])
            try:
                local_piece.check_new_chunks(src, self.paths[piece], self.checked[piece][0], chunk, sums, start, end,
                                             self._ok.setdefault(piece, set()))
            except IntegrityError as e:
                self.bad[piece] = str(e)
                raise

    def close(self) -> None:
        self.settle()
        with self._lock:
            maps, self._maps = self._maps, {}
        for mapped in maps.values():
            mapped.close()


def piece_regions(path: str, nbytes: int, digest=None):
    """(metadata, [(atomic tensor, Region, {state: byte offset of its data})]) of a piece, from
    its header, which must be the one checked (`digest`, None: any) of a file of `nbytes`."""
    meta, table, header_len, size, found = local_piece.read_header(path)
    if (digest is not None and found != digest) or size != nbytes:
        raise IntegrityError(f"{path}: changed after it was checked ({size} bytes, {nbytes} checked)")
    regions, _ = piece_layout(meta, table, header_len, path)
    base = 8 + header_len
    return meta, [(name, region, {s: base + table[f"{i}.{s}"]["data_offsets"][0] for s in states})
                  for i, (name, region, states) in enumerate(regions)]


def _manifest(head, path: str, where: str) -> mf.Manifest:
    """Rank 0's manifest head as the manifest of the iteration (each tensor's file size as a
    universal save's file would have it), checked as a manifest read from a folder is."""
    entries = head_entries(head, path)
    head = dict(head, tensors={n: dataclasses.replace(e, file_size=file_layout(e).file_size).to_json()
                               for n, e in entries.items()})
    return mf.parse_manifest(head, f"{path} (manifest head)", where)


def _index(listed: dict, part_shapes: dict, paths: dict) -> dict:
    """Pure: (atomic tensor, file tensor name) -> (starts, lengths, pieces, byte offsets) of
    every run the pieces hold, sorted by element."""
    runs: dict = {}
    for rank, regions in listed.items():
        for name, region, offsets in regions:
            shape = part_shapes.get((name, region.part))
            if shape is None:
                raise FormatError(f"{paths[rank]}: region of {name!r} part {region.part!r}, "
                                  "which rank 0's manifest head does not list")
            r = region_runs(shape, region)
            for state, offset in offsets.items():
                runs.setdefault((name, file_tensor_name(state, region.part)), []).append(
                    np.stack([r[:, 1], r[:, 2], np.full(len(r), rank), offset + r[:, 0] * F32], axis=1))
    out = {}
    for key, parts in runs.items():
        a = np.concatenate(parts)
        a = a[np.argsort(a[:, 0], kind="stable")]
        out[key] = (a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), a[:, 3].copy())
    return out


def _copies(index, f, b, n, where: str):
    """Pure: the copies that serve runs (element f, out element b, length n) from
    `index`: [(piece, byte offset, [(out element, length)])], runs adjacent in a piece and in
    the array merged, at most IOV_MAX parts each. IncompleteCheckpointError for elements no
    piece holds. Vectorized: a row-split tensor read whole is thousands of runs."""
    starts, lengths, pieces, offsets = index
    f, b, n = (np.asarray(x, dtype=np.int64) for x in (f, b, n))
    if not len(f):
        return []
    first = np.searchsorted(starts, f, side="right") - 1
    last = np.searchsorted(starts, f + n - 1, side="right") - 1
    counts = np.maximum(last - np.maximum(first, 0) + 1, 1)
    k = np.repeat(np.arange(len(f)), counts)  # the request each piece run serves
    j = np.maximum(first, 0)[k] + np.arange(len(k)) - np.repeat(np.cumsum(counts) - counts, counts)
    lo = np.maximum(f[k], starts[j])
    hi = np.minimum(f[k] + n[k], starts[j] + lengths[j])
    covered = np.bincount(k, weights=np.maximum(hi - lo, 0), minlength=len(f))
    if (covered != n).any():
        bad = int(np.flatnonzero(covered != n)[0])
        raise IncompleteCheckpointError(f"{where}: element {_first_missing(index, int(f[bad]), int(n[bad]))} "
                                        "is in no piece")
    keep = hi > lo
    p, lo, j, k = pieces[j[keep]], lo[keep], j[keep], k[keep]
    o = offsets[j] + (lo - starts[j]) * F32
    bb, nn = b[k] + (lo - f[k]), hi[keep] - lo
    if not len(p):
        return []
    order = np.lexsort((o, p))
    p, o, bb, nn = p[order], o[order], bb[order], nn[order]
    # a part: file- and array-contiguous runs merged; a read: file-contiguous parts, <= IOV_MAX
    file_next = np.zeros(len(p), dtype=bool)
    file_next[1:] = (p[1:] == p[:-1]) & (o[1:] == o[:-1] + nn[:-1] * F32)
    array_next = np.zeros(len(p), dtype=bool)
    array_next[1:] = bb[1:] == bb[:-1] + nn[:-1]
    part_starts = np.flatnonzero(~(file_next & array_next))
    part_len = np.add.reduceat(nn, part_starts)
    read_of_part = np.cumsum(~file_next[part_starts]) - 1  # file-contiguous groups of parts
    group_first = np.flatnonzero(~file_next[part_starts])
    rank_in_group = np.arange(len(part_starts)) - group_first[read_of_part]
    new_read = (rank_in_group % IOV_MAX) == 0
    heads = part_starts[new_read]
    parts = list(zip(bb[part_starts].tolist(), part_len.tolist()))
    bounds = np.append(np.flatnonzero(new_read), len(part_starts)).tolist()
    return [(piece, offset, parts[bounds[r]:bounds[r + 1]])
            for r, (piece, offset) in enumerate(zip(p[heads].tolist(), o[heads].tolist()))]


def _first_missing(index, f: int, n: int) -> int:
    """The first element of [f, f + n) that no run of `index` holds."""
    starts, lengths = index[0], index[1]
    at = f
    i = int(np.searchsorted(starts, at, side="right")) - 1
    while at < f + n and i >= 0 and i < len(starts) and starts[i] <= at < starts[i] + lengths[i]:
        at, i = int(starts[i] + lengths[i]), i + 1
    return at
