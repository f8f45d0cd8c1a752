"""The local tier's pieces read in place (engine/piece_reads.py, issue 48): an index of the
pieces' runs serves a universal load's reads of any slice, from the pieces that hold it and
nothing else; runs that span pieces are split, runs adjacent in a piece merged into one read."""

import os
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest

from megatron_ucp.engine import piece_reads
from megatron_ucp.errors import IncompleteCheckpointError, IntegrityError
from megatron_ucp.format import local_piece
from megatron_ucp.format.layout import Region
from megatron_ucp.format.tensor_entry import TensorEntry, file_layout

SHAPE = (6, 4)
# rank 0: columns 0-1 of every row; rank 1: columns 2-3 of rows 0-2; rank 2: rows 3-5, columns 2-3
SHARES = {0: Region("", (0, 0), (6, 2), 0, 12), 1: Region("", (0, 2), (3, 2), 0, 6),
          2: Region("", (3, 2), (3, 2), 0, 6)}
VALUES = np.arange(24, dtype=np.float32).reshape(SHAPE) + 0.5


def _source(tmp_path, checked_crcs=False):
    """A PieceSource over three pieces of "w" (param and exp_avg = -param) of iteration 1 in
    tmp_path, their headers indexed as the restore indexes them (the manifest head is not needed
    here); `checked_crcs`: each piece's CRC-32 is checked at its first read."""
    src = piece_reads.PieceSource.__new__(piece_reads.PieceSource)
    src.where, src.paths, src.metas, src.touched = str(tmp_path), {}, {}, {}
    src.node_dir, src.iteration, src.checked, src.crcs, src.bad, src._checks = str(tmp_path), 1, {}, {}, {}, {}
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
        if checked_crcs:
            src.crcs[rank] = zlib.crc32(data)
    src.index = piece_reads._index(listed, {("w", ""): SHAPE}, src.paths)
    src._fds, src._lock = {}, threading.Lock()
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


def test_a_piece_is_checked_at_its_first_read_and_a_damaged_one_is_named(tmp_path):
    """The restore no longer has the node's leader read every piece: each rank checks the
    CRC-32 of a piece the first time it reads from it. A damaged byte in piece 1 fails the
    first read of piece 1 (and every later one), names the piece, lands in `bad` (the restore
    takes another copy); piece 0 still reads; without an expected CRC nothing is checked."""
    src = _source(tmp_path, checked_crcs=True)
    layout = _layout()
    path = Path(src.paths[1])
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # an exp_avg element of piece 1: the header is intact
    path.write_bytes(bytes(raw))
    runs_of_piece = {0: [(0, 0, 2)], 1: [(2, 0, 2)]}  # row 0's columns 0-1 (piece 0), 2-3 (piece 1)
    out = np.zeros(2, np.float32)
    src.read_runs("w", layout, "param", runs_of_piece[0], out)
    assert np.array_equal(out, VALUES[0, :2])
    for _ in range(2):
        with pytest.raises(IntegrityError, match=r"rank_00001\.safetensors: CRC-32 .* differs"):
            src.read_runs("w", layout, "param", runs_of_piece[1], np.zeros(2, np.float32))
    assert list(src.bad) == [1] and "CRC-32" in src.bad[1]
    src.close()
    unchecked = _source(tmp_path / "plain")
    Path(unchecked.paths[1]).write_bytes(bytes(raw))
    unchecked.read_runs("w", layout, "param", runs_of_piece[1], np.zeros(2, np.float32))  # no CRC expected
    assert not unchecked.bad
    unchecked.close()


def test_a_staged_piece_serves_the_spans_received_and_refuses_the_rest(tmp_path):
    """Issue 48: a piece the node lacked is staged as its header in a sparse file of its size,
    then the byte spans the reads need (as `needs` maps them) written in: the reads find the
    pieces' values; a read outside the received spans is refused by name, never served zeros."""
    from megatron_ucp.engine import local_plan, local_receive

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
    local_receive.stage_spans(staged, spans, b"".join(whole[a:b] for a, b in spans.tolist()))
    src.received = {1: spans}
    out = np.zeros(2, np.float32)
    src.read_runs("w", layout, "param", runs, out)
    assert np.array_equal(out, VALUES[1, 2:])
    assert src.spans == {1: [tuple(spans[0])]} and src.touched == {1: 8}
    with pytest.raises(IntegrityError, match=r"rank_00001.part: bytes \[\d+, \d+\) were not received"):
        src.read_runs("w", layout, "param", [(8 + 2, 0, 2)], out)  # row 2: never received
    src.close()
