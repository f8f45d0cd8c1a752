"""The local tier's pieces read in place (engine/piece_reads.py, issue 48): an index of the
pieces' runs serves a universal load's reads of any slice, from the pieces that hold it and
nothing else; runs that span pieces are split, runs adjacent in a piece merged into one read."""

import json
import os
import re
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.engine import local_plan, local_receive, piece_reads
from megatron_ucp.errors import FormatError, IncompleteCheckpointError, IntegrityError
from megatron_ucp.format import local_piece
from megatron_ucp.format.layout import Region
from megatron_ucp.format.tensor_entry import TensorEntry, file_layout

SHAPE = (6, 4)
# rank 0: columns 0-1 of every row; rank 1: columns 2-3 of rows 0-2; rank 2: rows 3-5, columns 2-3
SHARES = {0: Region("", (0, 0), (6, 2), 0, 12), 1: Region("", (0, 2), (3, 2), 0, 6),
          2: Region("", (3, 2), (3, 2), 0, 6)}
VALUES = np.arange(24, dtype=np.float32).reshape(SHAPE) + 0.5


def _source(tmp_path, chunk=None):
    """A PieceSource over three pieces of "w" (param and exp_avg = -param) of iteration 1 in
    tmp_path, their headers indexed as the restore indexes them (the manifest head is not needed
    here); `chunk`: each piece's chunks of that many bytes are checked against their CRC-32s
    at their first read."""
    src = piece_reads.PieceSource.__new__(piece_reads.PieceSource)
    src.where, src.paths, src.metas, src.touched = str(tmp_path), {}, {}, {}
    src.checked, src.sums, src.bad, src._checks = {}, {}, {}, {}
    src._ok = {}
    src.fetch, src.refused, src.overlap, src._fetching, src._failed = None, None, False, None, None
    src.staged, src.received, src.spans = {}, {}, {}
    listed = {}
    for rank, r in SHARES.items():
        box = VALUES[r.offset[0]:r.offset[0] + r.shape[0], r.offset[1]:r.offset[1] + r.shape[1]].reshape(-1)
        data = local_piece.encode([("w", r)], [{"param": box, "exp_avg": -box}], {"rank": rank})
        path = Path(local_piece.piece_path(str(tmp_path), 1, rank))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        src.paths[rank] = str(path)
        src.metas[rank], listed[rank] = piece_reads.piece_regions(str(path), len(data))
        src.checked[rank] = (len(data), None)
        if chunk:
            src.sums[rank] = (chunk, [zlib.crc32(data[i:i + chunk]) for i in range(0, len(data), chunk)])
    src.index = piece_reads._index(listed, {("w", ""): SHAPE}, src.paths)
    src._maps, src._lock = {}, threading.Lock()
    return src


def _layout():
    return file_layout(TensorEntry.new("w", SHAPE, False, 0, ("param", "exp_avg")))


@pytest.mark.parametrize("rows,cols", [((0, 6), (0, 4)), ((2, 5), (1, 3)), ((3, 6), (2, 4)), ((0, 1), (0, 2))])
def test_any_box_reads_what_the_pieces_hold(tmp_path, rows, cols):
    src = _source(tmp_path)
    layout = _layout()
    want = VALUES[rows[0]:rows[1], cols[0]:cols[1]]
    runs = [(r * SHAPE[1] + cols[0], i * want.shape[1], want.shape[1]) for i, r in enumerate(range(*rows))]
    for name, sign in (("param", 1), ("exp_avg", -1)):
        out = np.zeros(want.size, np.float32)
        src.read_runs("w", layout, name, runs, out)
        assert np.array_equal(out.reshape(want.shape), sign * want), name
    src.close()


def test_a_pieces_own_box_reads_that_piece_alone_in_one_call(tmp_path):
    """Rank 2's box of the saving layout: piece 2's bytes, all of them, in one positional read."""
    src = _source(tmp_path)
    runs = [(r * SHAPE[1] + 2, i * 2, 2) for i, r in enumerate(range(3, 6))]
    out = np.zeros(6, np.float32)
    counter = type("C", (), {"bytes": 0, "calls": 0})()
    src.read_runs("w", _layout(), "param", runs, out, counter)
    assert src.touched == {2: 24} and (counter.bytes, counter.calls) == (24, 1)
    assert np.array_equal(out, VALUES[3:, 2:].reshape(-1))
    src.close()


def test_a_run_spanning_pieces_is_split():
    """Row 1 whole (elements 4..8): piece 0's two, then piece 1's two."""
    index = (np.array([4, 6]), np.array([2, 2]), np.array([0, 1]), np.array([100, 200]))
    reads = piece_reads._copies(index, np.array([4]), np.array([0]), np.array([4]), "w")
    assert reads == [(0, 100, [(0, 2)]), (1, 200, [(2, 2)])]


def test_elements_no_piece_holds_are_refused(tmp_path):
    index = (np.array([0]), np.array([4]), np.array([0]), np.array([64]))
    with pytest.raises(IncompleteCheckpointError, match="element 4 is in no piece"):
        piece_reads._copies(index, np.array([2]), np.array([0]), np.array([4]), "w")


def test_a_piece_that_changed_after_its_check_is_refused(tmp_path):
    from megatron_ucp.errors import IntegrityError

    data = local_piece.encode([("w", SHARES[1])], [{"param": np.zeros(6, np.float32)}], {"rank": 1})
    path = tmp_path / "p.safetensors"
    path.write_bytes(data)
    with pytest.raises(IntegrityError, match="changed after it was checked"):
        piece_reads.piece_regions(str(path), len(data), digest="0" * 64)
    os.truncate(path, len(data) - 4)
    with pytest.raises(IntegrityError, match="changed after it was checked"):
        piece_reads.piece_regions(str(path), len(data))


def test_a_chunk_is_checked_at_its_first_read_and_a_damaged_one_is_named(tmp_path):
    """Each rank checks the CRC-32 of a piece's chunk the first time it reads from it, and only
    the chunks it reads. With 8-byte chunks (two elements; the data starts 8-aligned), a
    damaged element of row 1 in piece 1 leaves row 0 of piece 1 readable, fails the read of
    row 1 naming the piece and the chunk's bytes, lands in `bad` (the restore takes another
    copy) and fails every later read of piece 1; piece 0 still reads; without chunk sums
    nothing is checked."""
    src = _source(tmp_path, chunk=8)
    layout = _layout()
    path = Path(src.paths[1])
    raw = bytearray(path.read_bytes())
    (_, offset, _), = piece_reads._copies(src.index[("w", "param")], np.array([SHAPE[1] + 2]), np.array([0]),
                                          np.array([2]), "w")  # row 1, columns 2-3: piece 1
    raw[offset + 1] ^= 0x40
    path.write_bytes(bytes(raw))
    out = np.zeros(2, np.float32)
    src.read_runs("w", layout, "param", [(2, 0, 2)], out)  # row 0, columns 2-3: its own chunk
    assert np.array_equal(out, VALUES[0, 2:])
    src.read_runs("w", layout, "param", [(0, 0, 2)], out)  # piece 0
    assert np.array_equal(out, VALUES[0, :2])
    with pytest.raises(IntegrityError, match=rf"rank_00001\.safetensors: bytes \[{offset}, {offset + 8}\) "
                                             r"\(chunk \d+\): CRC-32 .* differs"):
        src.read_runs("w", layout, "param", [(SHAPE[1] + 2, 0, 2)], np.zeros(2, np.float32))
    assert list(src.bad) == [1] and "CRC-32" in src.bad[1]
    with pytest.raises(IntegrityError, match="CRC-32"):  # the copy is bad: no read of it counts
        src.read_runs("w", layout, "exp_avg", [(2, 0, 2)], np.zeros(2, np.float32))
    src.close()
    unchecked = _source(tmp_path / "plain")
    Path(unchecked.paths[1]).write_bytes(bytes(raw))
    unchecked.read_runs("w", layout, "param", [(SHAPE[1] + 2, 0, 2)], np.zeros(2, np.float32))  # no sums
    assert not unchecked.bad
    unchecked.close()


@pytest.mark.parametrize("chunk", [8, None])
def test_a_piece_shorter_than_its_sidecar_says_fails_only_the_reads_past_its_end(tmp_path, chunk):
    """The pieces are read mapped, as long as their files are: a piece cut short by 4 bytes
    (its last element) still serves every element whose bytes (and, with chunk sums, whose
    chunk) end before the cut; a read of the others names the file and the byte where it ends
    (the chunk check, else the copy), and nothing is read past the file."""
    src = _source(tmp_path, chunk=chunk)
    layout = _layout()
    path = src.paths[1]
    size = os.path.getsize(path)
    os.truncate(path, size - 4)
    failed = 0
    for name, sign in (("param", 1), ("exp_avg", -1)):
        for e in (r * SHAPE[1] + c for r in range(3) for c in (2, 3)):  # piece 1's box
            (_, offset, _), = piece_reads._copies(src.index[("w", name)], np.array([e]), np.array([0]),
                                                  np.array([1]), "w")
            end = min(-(-(offset + 4) // chunk) * chunk, size) if chunk else offset + 4
            out = np.zeros(1, np.float32)
            if end <= size - 4:
                src.read_runs("w", layout, name, [(e, 0, 1)], out)
                assert out[0] == sign * VALUES.reshape(-1)[e], (name, e)
                continue
            failed += 1
            with pytest.raises(IntegrityError, match=rf"rank_00001\.safetensors: ends at byte {size - 4}\b"):
                src.read_runs("w", layout, name, [(e, 0, 1)], out)
            if chunk:
                src.bad.clear()  # the copy is bad; the next read asks again
    assert failed == 1 or (chunk and failed == 2)  # the last element; with chunks, its chunk's
    src.close()


def test_a_staged_piece_serves_the_spans_received_and_refuses_the_rest(tmp_path):
    """Issue 48: a piece the node lacked is staged as its header in a sparse file of its size,
    then the byte spans the reads need (as `needs` maps them) written in: the reads find the
    pieces' values; a read outside the received spans is refused by name, never served zeros."""
    src = _source(tmp_path)
    layout = _layout()
    whole = Path(src.paths[1]).read_bytes()
    node = tmp_path / "new_node"
    staged = local_receive.stage_header(str(node), 1, whole[:local_receive.header_length(whole)], len(whole))
    assert os.path.getsize(staged) == len(whole)
    src.paths[1], src.staged = staged, {1: staged}
    runs = np.array([(4 + 2, 0, 2)])  # row 1, columns 2-3: in piece 1
    spans = local_plan.merge([(o, o + 4 * sum(n for _, n in parts))
                              for p, o, parts in piece_reads._copies(src.index[("w", "param")], runs[:, 0],
                                                                     runs[:, 1], runs[:, 2], "w")])
    assert local_plan.span_bytes(spans) == 8
    fd = os.open(staged, os.O_WRONLY)
    local_receive.stage_spans(fd, staged, spans.tolist(), b"".join(whole[a:b] for a, b in spans.tolist()))
    os.close(fd)
    src.received = {1: spans}
    out = np.zeros(2, np.float32)
    src.read_runs("w", layout, "param", runs, out)
    assert np.array_equal(out, VALUES[1, 2:])
    assert src.spans == {1: [tuple(spans[0])]} and src.touched == {1: 8}
    with pytest.raises(IntegrityError, match=r"rank_00001.part: bytes \[\d+, \d+\) were not received"):
        src.read_runs("w", layout, "param", [(8 + 2, 0, 2)], out)  # row 2: never received
    src.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 300)), max_size=20), st.integers(1, 700))
def test_messages_carry_the_spans_in_order_each_at_most_a_window(raw, window):
    """Both ends of a transfer cut a piece's spans into the same messages: together exactly the
    spans' bytes, in order, each message `window` bytes but the last."""
    spans = local_plan.merge([(a, a + n) for a, n in raw])
    msgs = local_receive.messages(spans, window)
    sizes = [sum(b - a for a, b in parts) for parts in msgs]
    assert all(n == window for n in sizes[:-1]) and all(0 < n <= window for n in sizes)
    flat = [p for parts in msgs for p in parts]
    assert local_plan.merge(flat).tolist() == spans.tolist()
    assert [a for a, _ in flat] == sorted(a for a, _ in flat)
    assert sum(sizes) == local_plan.span_bytes(spans)


def test_chunk_sums_cover_every_byte_and_a_sidecar_is_checked(tmp_path, monkeypatch):
    """A piece's sidecar records a CRC-32 per chunk: each chunk reads back alone, a flipped
    byte fails exactly its chunk (named with its bytes); a sidecar whose chunk sums do not fit
    its size is refused by name; one without chunks (an older release's) is one chunk."""
    monkeypatch.setattr(local_piece, "CHUNK_BYTES", 64)
    data = local_piece.encode([("w", Region("", (0,), (60,), 0, 60))], [{"param": np.arange(60, dtype=np.float32)}], {})
    local_piece.write_piece(str(tmp_path), 3, 1, data, {"world": 2, "job": None})
    record = local_piece.sidecar(str(tmp_path), 3, 1)
    chunks = -(-len(data) // 64)
    assert record["chunk_bytes"] == 64 and len(record["chunk_crc32"]) == chunks > 3
    path = local_piece.piece_path(str(tmp_path), 3, 1)

    def read(i, raw):
        Path(path).write_bytes(raw)
        fd = os.open(path, os.O_RDONLY)
        try:
            return bytes(local_piece.read_chunks(fd, path, len(data), 64, record["chunk_crc32"], i, i + 1,
                                                 bytearray(64)))
        finally:
            os.close(fd)

    assert b"".join(read(i, data) for i in range(chunks)) == data
    for at in (3, len(data) // 2, len(data) - 1):
        raw = bytearray(data)
        raw[at] ^= 1
        bad = at // 64
        with pytest.raises(IntegrityError, match=rf"{path}: bytes \[{bad * 64}, {min(bad * 64 + 64, len(data))}\) "
                                                 rf"\(chunk {bad}\): CRC-32"):
            read(bad, bytes(raw))
        assert read((bad + 1) % chunks, bytes(raw)) == data[(bad + 1) % chunks * 64:][:64]
    Path(path).write_bytes(data[:-5])  # shorter than its sidecar says
    with pytest.raises(IntegrityError, match=f"{path}: ends at byte {len(data) - 5}, its sidecar says {len(data)}"):
        read(chunks - 1, data[:-5])
    side = Path(local_piece.sidecar_path(str(tmp_path), 3, 1))
    for forged in ({"chunk_crc32": record["chunk_crc32"][1:]}, {"chunk_crc32": ["x"] * chunks},
                   {"chunk_bytes": 0}, {"chunk_crc32": None}):
        side.write_text(json.dumps(dict(record, **forged)))
        with pytest.raises(FormatError, match=f"{side}: 'chunk_"):
            local_piece.sidecar(str(tmp_path), 3, 1)
    old = {k: v for k, v in record.items() if not k.startswith("chunk_")}
    side.write_text(json.dumps(old))
    assert local_piece.sidecar(str(tmp_path), 3, 1) == dict(old, chunk_bytes=len(data), chunk_crc32=[zlib.crc32(data)])
    assert local_piece.chunk_bytes_for(64 * local_piece.MAX_CHUNKS) == 64
    assert local_piece.chunk_bytes_for(64 * local_piece.MAX_CHUNKS + 1) == 128


def _sent_piece(tmp_path, monkeypatch):
    """(bytes, local_plan.Copy, path, the chunks check_chunks is asked for) of a piece of
    64-byte chunks, as a sender holds it."""
    monkeypatch.setattr(local_piece, "CHUNK_BYTES", 64)
    data = local_piece.encode([("w", Region("", (0,), (90,), 0, 90))], [{"param": np.arange(90, dtype=np.float32)}], {})
    local_piece.write_piece(str(tmp_path), 3, 1, data, {"world": 2, "job": None})
    record = local_piece.sidecar(str(tmp_path), 3, 1)
    copy = local_plan.Copy("n0", 1, len(data), crc32=record["crc32"], chunk_bytes=64, chunk_crc32=record["chunk_crc32"])
    seen = []
    original = local_piece.check_chunks
    monkeypatch.setattr(local_piece, "check_chunks", lambda d, p, n, c, s, i, j: seen.append(i) or original(d, p, n, c, s, i, j))
    return data, copy, local_piece.piece_path(str(tmp_path), 3, 1), seen


def test_a_sender_copies_the_spans_of_its_mapped_copy_each_chunk_checked_once(tmp_path, monkeypatch):
    """The sender's fill (local_receive._fill): the bytes of the parts, in order, from the piece
    mapped, each chunk they touch checked once across messages; a damaged chunk fails the part
    that lies in it, named, before any of its bytes are copied."""
    data, copy, path, seen = _sent_piece(tmp_path, monkeypatch)
    mapped = local_piece.MappedPiece(path)
    checked = set()
    for parts in ([(10, 70), (100, 130)], [(130, 200), (400, len(data))]):
        out = np.zeros(sum(b - a for a, b in parts), np.uint8)
        local_receive._fill(mapped.data, path, copy, parts, out, checked)
        assert out.tobytes() == b"".join(data[a:b] for a, b in parts)
    assert sorted(seen) == sorted(set(seen)) == [0, 1, 2, 3, *range(400 // 64, -(-len(data) // 64))]
    mapped.close()
    raw = bytearray(data)
    raw[140] ^= 1
    Path(path).write_bytes(bytes(raw))
    mapped = local_piece.MappedPiece(path)
    out = np.zeros(60, np.uint8)
    with pytest.raises(IntegrityError, match=rf"{path}: bytes \[128, 192\) \(chunk 2\): CRC-32"):
        local_receive._fill(mapped.data, path, copy, [(0, 30), (130, 160)], out, set())
    assert out[:30].tobytes() == data[:30] and not out[30:].any()
    mapped.close()


def test_a_message_of_one_span_is_sent_from_the_mapping_once_its_chunks_are_checked(tmp_path, monkeypatch):
    """local_receive._message: one span is a view of the mapped copy (no copy), several are
    copied into the message buffer; either only once the chunks they touch are checked, each
    once across messages; a damaged chunk is named before any message of it is made."""
    data, copy, path, seen = _sent_piece(tmp_path, monkeypatch)
    mapped = local_piece.MappedPiece(path, private=True)
    buffer, checked = torch.zeros(200, dtype=torch.uint8), set()
    one = local_receive._message(mapped.data, path, copy, [(100, 300)], buffer[:200], checked)
    assert one.numpy().tobytes() == data[100:300] and np.shares_memory(one.numpy(), mapped.data)
    assert sorted(seen) == [1, 2, 3, 4]
    two = local_receive._message(mapped.data, path, copy, [(10, 70), (280, 330)], buffer[:110], checked)
    assert two.data_ptr() == buffer.data_ptr() and two.numpy().tobytes() == data[10:70] + data[280:330]
    assert sorted(seen) == [0, 1, 2, 3, 4, 5]  # chunks 1-4 not again
    del one, two
    mapped.close()
    mapper = local_piece.MappedPiece

    def strict(path, private=False):  # vm.overcommit_memory=2 may refuse a writeable private mapping
        if private:
            raise OSError(12, "Cannot allocate memory")
        return mapper(path)

    monkeypatch.setattr(local_piece, "MappedPiece", strict)
    read_only = local_receive._mapped(path)  # then read-only, its messages through the buffer
    assert not read_only.data.flags.writeable
    one = local_receive._message(read_only.data, path, copy, [(100, 300)], buffer[:200], set())
    assert one.data_ptr() == buffer.data_ptr() and one.numpy().tobytes() == data[100:300]
    read_only.close()
    monkeypatch.setattr(local_piece, "MappedPiece", mapper)
    raw = bytearray(data)
    raw[140] ^= 1
    Path(path).write_bytes(bytes(raw))
    mapped = local_piece.MappedPiece(path, private=True)
    with pytest.raises(IntegrityError, match=rf"{path}: bytes \[128, 192\) \(chunk 2\): CRC-32"):
        local_receive._message(mapped.data, path, copy, [(130, 160)], buffer, set())
    mapped.close()
    assert Path(path).read_bytes() == bytes(raw)  # the private mapping never writes the file


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_copies_map_every_requested_element_to_the_piece_that_holds_it(data):
    """_copies against a per-element model: an index of runs (a split of [0, N) over pieces,
    each piece's runs at increasing offsets in a random order of the runs) and requests of
    element runs into an array: every element read from its piece's byte, into its array
    position, each once; each read at most IOV_MAX parts, none mergeable with the next; an
    element no run holds (a hole) is named."""
    n_total = data.draw(st.integers(1, 200))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n_total - 1), max_size=20)) if n_total > 1 else []))
    bounds = [0] + cuts + [n_total]
    runs = [(a, z - a) for a, z in zip(bounds, bounds[1:])]
    hole = data.draw(st.booleans()) and len(runs) > 1
    if hole:
        del runs[data.draw(st.integers(0, len(runs) - 1))]
    owner = [data.draw(st.integers(0, 2)) for _ in runs]
    order = data.draw(st.permutations(range(len(runs))))
    offsets, at = {}, {0: 64, 1: 8, 2: 0}
    for i in order:
        offsets[i] = at[owner[i]]
        at[owner[i]] += runs[i][1] * 4
    index = tuple(np.asarray(x, dtype=np.int64) for x in zip(*[(runs[i][0], runs[i][1], owner[i], offsets[i])
                                                                for i in range(len(runs))]))
    held = {e: (owner[i], offsets[i] + (e - runs[i][0]) * 4) for i in range(len(runs))
            for e in range(runs[i][0], runs[i][0] + runs[i][1])}
    reqs = data.draw(st.lists(st.tuples(st.integers(0, n_total - 1), st.integers(1, 50)), min_size=1, max_size=6))
    f, b, n, out_at = [], [], [], 0
    for start, length in reqs:
        length = min(length, n_total - start)
        f.append(start), b.append(out_at), n.append(length)
        out_at += length + data.draw(st.integers(0, 2))
    want = {b[r] + e: held.get(f[r] + e) for r in range(len(f)) for e in range(n[r])}
    if None in want.values():
        with pytest.raises(IncompleteCheckpointError, match="element (\\d+) is in no piece") as e:
            piece_reads._copies(index, np.array(f), np.array(b), np.array(n), "w")
        missing = int(e.value.args[0].split("element ")[1].split()[0])
        assert missing not in held and any(f[r] <= missing < f[r] + n[r] for r in range(len(f)))
        return
    got = {}
    reads = piece_reads._copies(index, np.array(f), np.array(b), np.array(n), "w")
    for piece, offset, parts in reads:
        assert 0 < len(parts) <= piece_reads.IOV_MAX
        for (s0, l0), (s1, _) in zip(parts, parts[1:]):
            assert s0 + l0 != s1  # adjacent in the file and in the array: merged
        for start, length in parts:
            for e in range(length):
                assert start + e not in got
                got[start + e] = (piece, offset)
                offset += 4
    assert got == want


@settings(max_examples=120, deadline=None)
@given(chunk=st.integers(1, 40), rows=st.tuples(st.integers(0, 5), st.integers(1, 6)),
       cols=st.tuples(st.integers(0, 3), st.integers(1, 4)), name=st.sampled_from(["param", "exp_avg"]),
       damage=st.one_of(st.none(), st.tuples(st.booleans(), st.sampled_from(sorted(SHARES)),
                                             st.floats(0, 1, exclude_max=True))))
def test_a_read_copies_a_chunks_bytes_only_once_it_is_checked(tmp_path_factory, chunk, rows, cols, name, damage):
    """With any chunk size (one not a multiple of an element: an element straddles two chunks)
    and any box, a sound read fills the box and checks exactly the chunks its bytes lie in;
    with a damaged byte, a read whose bytes touch its chunk fails naming it and has copied no
    byte of that chunk (bytes of other chunks may be), and a read that does not touch it
    succeeds."""
    r0, r1 = min(rows), max(max(rows), min(rows) + 1)
    c0, c1 = min(cols), max(max(cols), min(cols) + 1)
    src = _source(tmp_path_factory.mktemp("pieces"), chunk=chunk)
    runs = [(r * SHAPE[1] + c0, i * (c1 - c0), c1 - c0) for i, r in enumerate(range(r0, r1))]
    # each byte of the box: the piece and the byte of it that holds it
    held = []
    for e in (r * SHAPE[1] + c for r in range(r0, r1) for c in range(c0, c1)):
        (piece, offset, _), = piece_reads._copies(src.index[("w", name)], np.array([e]), np.array([0]),
                                                  np.array([1]), "w")
        held += [(piece, offset + k) for k in range(4)]
    touched = {(p, at // chunk) for p, at in held}
    bad = None
    if damage is not None:
        in_box, piece, where = damage
        if in_box:  # a byte the read copies
            piece, at = held[int(where * len(held))]
        else:  # any byte of a piece's data
            spans = [(o, o + 4 * n) for _, lengths, pieces, offsets in src.index.values()
                     for n, p, o in zip(lengths.tolist(), pieces.tolist(), offsets.tolist()) if p == piece]
            lo, hi = min(a for a, _ in spans), max(z for _, z in spans)
            at = lo + int(where * (hi - lo))
        path = Path(src.paths[piece])
        raw = bytearray(path.read_bytes())
        raw[at] ^= 0x10
        path.write_bytes(bytes(raw))
        bad = (piece, at // chunk)
    out = np.empty((r1 - r0) * (c1 - c0), np.float32)
    view = out.view(np.uint8)
    view[:] = 0xFF  # no element's bytes (a NaN)
    if bad in touched:
        with pytest.raises(IntegrityError, match=rf"{re.escape(src.paths[bad[0]])}: bytes \[{bad[1] * chunk}, "
                                                 rf"\d+\) \(chunk {bad[1]}\): CRC-32"):
            src.read_runs("w", _layout(), name, runs, out)
        assert all(view[i] == 0xFF for i, p in enumerate(held) if (p[0], p[1] // chunk) == bad)
    else:
        src.read_runs("w", _layout(), name, runs, out)
        sign = 1 if name == "param" else -1
        assert np.array_equal(out.reshape(r1 - r0, c1 - c0), sign * VALUES[r0:r1, c0:c1])
        assert {(p, c) for p, cs in src._ok.items() for c in cs} == touched
    src.close()
