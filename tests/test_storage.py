"""Tests for the tensor files (tensor_file, tensor_io, safe_files, durability, checksums): headers, positional run I/O, hostile headers, checksums,
atomic writes and manifest path safety."""

import json
import os
import struct
import sys
import threading
import tracemalloc
import zlib
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file as np_load_file
from safetensors.numpy import save_file as np_save_file

from megatron_ucp.format import checksums, durability, tensor_file, tensor_io
from megatron_ucp import settings as ucp_settings
from megatron_ucp.format.checksums import block_checksums, verify_range
from megatron_ucp.format.durability import atomic_write_bytes, atomic_write_json
from megatron_ucp.errors import FormatError, IncompleteCheckpointError, IntegrityError, LayoutError
from megatron_ucp.format.safe_files import read_json, safe_join
from megatron_ucp.format.tensor_file import TensorFileLayout, read_header, safetensors_header
from megatron_ucp.format.tensor_io import ReadCounter, create_tensor_file, read_runs, write_runs

OPT = ("param", "exp_avg", "exp_avg_sq")


def _layout(shape, dtype="F32", names=OPT):
    return TensorFileLayout.build([(n, tuple(shape), dtype) for n in names])


def _write_full(path, layout, arrays):
    create_tensor_file(path, layout)
    for name, arr in arrays.items():
        write_runs(path, layout, name, [(0, 0, arr.size)], arr)


# ---------------------------------------------------------------- header and layout


def test_header_is_deterministic_aligned_and_parseable():
    for name_len in range(1, 17):  # every padding amount
        entries = [("p" * name_len, (3, 5), "F32"), ("exp_avg", (3, 5), "F16"), ("step", (), "I64")]
        h = safetensors_header(entries)
        assert h == safetensors_header([tuple(e) for e in entries])
        assert len(h) % 8 == 0
        (n,) = struct.unpack("<Q", h[:8])
        assert n == len(h) - 8
        meta = json.loads(h[8:])
        assert list(meta) == ["p" * name_len, "exp_avg", "step"]
        assert [meta[k]["data_offsets"] for k in meta] == [[0, 60], [60, 90], [90, 98]]
    assert safetensors_header([("a", (2,), "F32")]) != safetensors_header([("a", (3,), "F32")])


def test_layout_offsets_and_sizes():
    lay = TensorFileLayout.build([("param", (4, 3), "F32"), ("mask", (4, 3), "U8"), ("step", (), "I64")])
    h = len(lay.header)
    assert lay.header == safetensors_header(lay.entries)
    assert lay.data_offset("param") == h and lay.itemsize("param") == 4 and lay.numel("param") == 12
    assert lay.data_offset("mask") == h + 48 and lay.itemsize("mask") == 1
    assert lay.data_offset("step") == h + 60 and lay.numel("step") == 1
    assert lay.file_size == h + 68
    assert lay.byte_range("mask") == (h + 48, h + 60)
    assert lay == TensorFileLayout.build(lay.entries) and hash(lay) == hash(TensorFileLayout.build(lay.entries))
    with pytest.raises(LayoutError, match="nope"):
        lay.data_offset("nope")


@pytest.mark.parametrize("entries", [
    [("a", (2,), "BF99")], [("a", (-1,), "F32")], [("a", (1,), "F32"), ("a", (1,), "F32")],
    [("", (1,), "F32")], [("__metadata__", (1,), "F32")], [("a", (1,))],
])
def test_bad_entries_rejected(entries):
    with pytest.raises(LayoutError):
        TensorFileLayout.build(entries)


def test_create_is_exact_size_reserved_and_truncates_old_content(tmp_path):
    path = str(tmp_path / "big.safetensors")
    with open(path, "wb") as f:
        f.write(b"\xff" * 100)
    lay = _layout((4 * 2**20,), names=("param", "exp_avg"))  # 32 MiB of data
    create_tensor_file(path, lay)
    st_ = os.stat(path)
    assert st_.st_size == lay.file_size
    with open(path, "rb") as f:
        assert f.read(len(lay.header) + 8) == lay.header + b"\0" * 8
    fd = os.open(path, os.O_RDWR)
    try:  # where the file system can reserve blocks, create_tensor_file has reserved them all
        reserved = durability.reserve_space(fd, lay.file_size, path)
    finally:
        os.close(fd)
    if reserved and hasattr(st_, "st_blocks"):
        assert st_.st_blocks * 512 >= lay.file_size, "create_tensor_file should reserve the file's blocks"
    small = _layout((8,))
    with open(path, "wb") as f:  # a stale file of the same size: its bytes must not survive
        f.write(b"\xff" * small.file_size)
    create_tensor_file(path, small)
    assert all(not a.any() for a in np_load_file(path).values())


# ---------------------------------------------------------------- writes through a mapping


def _half_rows(rows, cols):
    """A TP2 rank's runs of a [rows, cols] tensor split by columns: the first half of each row."""
    half = cols // 2
    return [(r * half, r * cols, half) for r in range(rows)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 70), cols=st.integers(2, 40), dtype=st.sampled_from(["F32", "F16", "U8"]),
       offset_rows=st.integers(0, 3))
def test_mapped_and_positional_writes_give_the_same_file(tmp_path, rows, cols, dtype, offset_rows):
    lay = _layout((rows + offset_rows, cols), dtype)
    npdt = tensor_file.SAFETENSORS_DTYPES[dtype]
    data = {n: np.random.default_rng(rows * cols).integers(1, 100, (rows, cols // 2)).astype(npdt) for n in OPT}
    runs = [(src, dst + offset_rows * cols, n) for src, dst, n in _half_rows(rows, cols)]
    files = {}
    for mapped in (True, False):
        path = str(tmp_path / f"{mapped}.safetensors")
        create_tensor_file(path, lay)
        with mock.patch.dict(os.environ, {"UCP_MAPPED_WRITES": str(int(mapped))}):
            for n in OPT:
                assert write_runs(path, lay, n, runs, data[n]) == data[n].nbytes
        files[mapped] = open(path, "rb").read()
    assert files[True] == files[False]
    loaded = np_load_file(str(tmp_path / "True.safetensors"))
    for n in OPT:
        np.testing.assert_array_equal(loaded[n][offset_rows:, : cols // 2], data[n])
        assert not loaded[n][offset_rows:, cols // 2:].any() and not loaded[n][:offset_rows].any()


def _spy_mapped(monkeypatch):
    calls = []
    real = tensor_io._write_mapped
    monkeypatch.setattr(tensor_io, "_write_mapped", lambda *a: calls.append(1) or real(*a))
    return calls


def test_many_small_runs_go_through_the_mapping_only_where_blocks_are_reserved(tmp_path, monkeypatch):
    lay = _layout((64, 96))
    data = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    calls = _spy_mapped(monkeypatch)
    monkeypatch.setenv("UCP_MAPPED_WRITES", "1")
    path = str(tmp_path / "reserved.safetensors")
    create_tensor_file(path, lay)
    write_runs(path, lay, "param", _half_rows(64, 96), data)
    reserved = os.stat(path).st_blocks * 512 >= lay.file_size
    assert len(calls) == int(reserved)  # the file system may not reserve (then: positional writes)
    np.testing.assert_array_equal(np_load_file(path)["param"][:, :48], data)

    calls.clear()  # a sparse file: a page fault could fail for want of space, so no mapping
    real_fallocate = durability._FALLOCATE
    monkeypatch.setattr(durability, "_FALLOCATE", None)
    path = str(tmp_path / "sparse.safetensors")
    create_tensor_file(path, lay)
    write_runs(path, lay, "param", _half_rows(64, 96), data)
    assert calls == []
    np.testing.assert_array_equal(np_load_file(path)["param"][:, :48], data)

    calls.clear()  # one large run: a positional write is cheaper than the page faults
    monkeypatch.setattr(durability, "_FALLOCATE", real_fallocate)
    path = str(tmp_path / "large.safetensors")
    create_tensor_file(path, lay)
    write_runs(path, lay, "param", [(0, 0, 64 * 48)], data)
    assert calls == []


def _failing_fallocate(err):
    import ctypes

    def fallocate(fd, mode, offset, length):
        ctypes.set_errno(err)
        return -1
    return fallocate


def test_a_full_disk_fails_at_creation_naming_the_file(tmp_path, monkeypatch):
    import errno

    monkeypatch.setattr(durability, "_FALLOCATE", _failing_fallocate(errno.ENOSPC))
    path = str(tmp_path / "full.safetensors")
    with pytest.raises(OSError) as e:
        create_tensor_file(path, _layout((1024,)))
    assert e.value.errno == errno.ENOSPC and path in str(e.value)


def test_a_file_system_without_fallocate_keeps_sparse_files(tmp_path, monkeypatch):
    import errno

    monkeypatch.setattr(durability, "_FALLOCATE", _failing_fallocate(errno.EOPNOTSUPP))
    calls = _spy_mapped(monkeypatch)
    lay = _layout((64, 96))
    path = str(tmp_path / "sparse.safetensors")
    create_tensor_file(path, lay)
    assert os.stat(path).st_blocks * 512 < lay.file_size
    data = np.ones((64, 48), np.float32)
    write_runs(path, lay, "param", _half_rows(64, 96), data)
    assert calls == []
    np.testing.assert_array_equal(np_load_file(path)["param"][:, :48], data)


def test_mapped_writes_switch_must_be_0_or_1(monkeypatch):
    from megatron_ucp.errors import ConfigError

    monkeypatch.setenv("UCP_MAPPED_WRITES", "yes")
    with pytest.raises(ConfigError, match="UCP_MAPPED_WRITES"):
        ucp_settings.mapped_writes()
    monkeypatch.setenv("UCP_MAPPED_WRITES", "0")
    assert ucp_settings.mapped_writes() is False


# ---------------------------------------------------------------- concurrent writers


def _partition(draw, numel, max_writers):
    cuts = sorted(draw(st.sets(st.integers(1, max(numel - 1, 1)), max_size=min(numel, 12))) if numel > 1 else [])
    bounds = [0, *[c for c in cuts if 0 < c < numel], numel]
    runs = [(a, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]
    writers = draw(st.integers(1, max_writers))
    owner = [draw(st.integers(0, writers - 1)) for _ in runs]
    return runs, writers, owner


@st.composite
def _scenarios(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    dtype = draw(st.sampled_from(["F32", "F16", "I64", "U8"]))
    numel = int(np.prod(shape))
    runs, writers, owner = _partition(draw, numel, 4)
    order = draw(st.permutations(range(len(runs))))  # shard order differs from file order
    return shape, dtype, runs, writers, owner, list(order)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_scenarios())
def test_disjoint_writers_roundtrip_through_safetensors(tmp_path, scenario):
    shape, dtype, runs, writers, owner, order = scenario
    path = str(tmp_path / "t.safetensors")
    lay = _layout(shape, dtype)
    npdt = tensor_file.SAFETENSORS_DTYPES[dtype]
    rng = np.random.default_rng(len(runs))
    expected = {n: rng.integers(0, 100, size=shape).astype(npdt) for n in OPT}
    create_tensor_file(path, lay)
    for w in range(writers):
        mine = [runs[i] for i in order if owner[i] == w]
        for name in OPT:  # each writer holds a packed shard of its runs, in shuffled order
            flat = expected[name].reshape(-1)
            shard = np.concatenate([flat[s:s + n] for s, n in mine]) if mine else np.zeros(0, npdt)
            src = np.cumsum([0] + [n for _, n in mine])[:-1]
            wrote = write_runs(path, lay, name, [(int(a), s, n) for a, (s, n) in zip(src, mine)], shard)
            assert wrote == shard.nbytes
    loaded = np_load_file(path)
    assert set(loaded) == set(OPT)
    for name in OPT:
        assert loaded[name].dtype == npdt and loaded[name].shape == shape
        np.testing.assert_array_equal(loaded[name], expected[name])
    # and every writer can read back exactly its shard
    for w in range(writers):
        mine = [runs[i] for i in order if owner[i] == w]
        out = np.empty(sum(n for _, n in mine), npdt)
        src = np.cumsum([0] + [n for _, n in mine])[:-1]
        read_runs(path, lay, "exp_avg", [(s, int(a), n) for a, (s, n) in zip(src, mine)], out)
        want = [expected["exp_avg"].reshape(-1)[s:s + n] for s, n in mine]
        np.testing.assert_array_equal(out, np.concatenate(want) if want else out)


def test_threads_writing_concurrently_and_torch_loads(tmp_path):
    torch_st = pytest.importorskip("safetensors.torch")
    path = str(tmp_path / "t.safetensors")
    lay = _layout((64, 33))
    full = {n: np.random.default_rng(i).standard_normal((64, 33)).astype(np.float32) for i, n in enumerate(OPT)}
    create_tensor_file(path, lay)

    def writer(rank):  # tensor-parallel style: rank owns a column slice of every row
        cols = range(rank * 11, (rank + 1) * 11)
        for name in OPT:
            shard = np.ascontiguousarray(full[name][:, cols.start:cols.stop])
            runs = [(r * 11, r * 33 + cols.start, 11) for r in range(64)]
            write_runs(path, lay, name, runs, shard)

    threads = [threading.Thread(target=writer, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loaded = torch_st.load_file(path)
    for name in OPT:
        np.testing.assert_array_equal(loaded[name].numpy(), full[name])
    assert read_header(path) == lay


# ---------------------------------------------------------------- run validation


def test_write_runs_validates_runs(tmp_path):
    path = str(tmp_path / "w.safetensors")
    lay = _layout((10,))
    create_tensor_file(path, lay)
    data = np.arange(10, dtype=np.float32)
    bad = {
        "past tensor end": [(0, 5, 6)],
        "past data end": [(8, 0, 3)],
        "negative": [(0, -1, 2)],
        "overlap": [(0, 0, 5), (5, 4, 2)],
        "not triples": [(0, 0)],
    }
    for why, runs in bad.items():
        with pytest.raises(LayoutError, match="exp_avg") as ei:
            write_runs(path, lay, "exp_avg", runs, data)
        assert path in str(ei.value), why
    with pytest.raises(LayoutError, match="dtype"):
        write_runs(path, lay, "param", [(0, 0, 10)], data.astype(np.float64))
    with pytest.raises(LayoutError, match="create_tensor_file"):
        write_runs(path, _layout((11,)), "param", [(0, 0, 10)], data)
    assert np_load_file(path)["exp_avg"].sum() == 0  # nothing was written by the refused calls
    # the same source may legitimately go to two places; zero-length runs are ignored
    assert write_runs(path, lay, "param", [(0, 0, 5), (0, 5, 5), (3, 9, 0)], data) == 40
    np.testing.assert_array_equal(np_load_file(path)["param"], np.tile(data[:5], 2))


def test_read_runs_validates_output(tmp_path):
    path = str(tmp_path / "r.safetensors")
    lay = _layout((10,))
    create_tensor_file(path, lay)
    with pytest.raises(LayoutError, match="contiguous"):
        read_runs(path, lay, "param", [(0, 0, 2)], np.zeros((4, 4), np.float32)[:, 0])
    with pytest.raises(LayoutError, match="overlap"):
        read_runs(path, lay, "param", [(0, 0, 4), (6, 3, 2)], np.zeros(8, np.float32))
    with pytest.raises(LayoutError, match="outside"):
        read_runs(path, lay, "param", [(8, 0, 3)], np.zeros(8, np.float32))
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        read_runs(str(tmp_path / "nope"), lay, "param", [(0, 0, 1)], np.zeros(1, np.float32))


# ---------------------------------------------------------------- read_runs


@pytest.fixture
def filled(tmp_path):
    path = str(tmp_path / "f.safetensors")
    lay = _layout((1000,))
    arrays = {n: np.arange(1000, dtype=np.float32) + 1000 * i for i, n in enumerate(OPT)}
    _write_full(path, lay, arrays)
    return path, lay, arrays


def test_read_runs_reads_exactly_the_requested_bytes(filled):
    path, lay, arrays = filled
    runs = [(900, 0, 7), (10, 7, 3), (500, 20, 50), (3, 10, 2)]  # gaps in file and in output
    out = np.full(80, -1, np.float32)
    counter = ReadCounter()
    got = read_runs(path, lay, "exp_avg_sq", runs, out, counter)
    expect = np.full(80, -1, np.float32)
    for s, d, n in runs:
        expect[d:d + n] = arrays["exp_avg_sq"][s:s + n]
    np.testing.assert_array_equal(out, expect)
    assert got == counter.bytes == sum(n for _, _, n in runs) * 4
    assert counter.calls == len(runs)
    read_runs(path, lay, "param", [(0, 0, 1)], out, counter)  # counters accumulate
    assert counter.bytes == got + 4 and counter.calls == len(runs) + 1


def test_adjacent_runs_are_coalesced(filled, monkeypatch):
    path, lay, arrays = filled
    counter = ReadCounter()
    out = np.empty(1000, np.float32)
    read_runs(path, lay, "param", [(i * 10, i * 10, 10) for i in range(100)][::-1], out, counter)
    np.testing.assert_array_equal(out, arrays["param"])
    assert counter.calls == 1 and counter.bytes == 4000
    if hasattr(os, "preadv"):  # adjacent in the file only: still one vectored read
        counter = ReadCounter()
        out = np.empty(1000, np.float32)
        read_runs(path, lay, "param", [(i * 10, (99 - i) * 10, 10) for i in range(100)], out, counter)
        assert counter.calls == 1
        np.testing.assert_array_equal(out.reshape(100, 10), arrays["param"].reshape(100, 10)[::-1])
    if hasattr(os, "pwritev"):
        monkeypatch.setenv("UCP_MAPPED_WRITES", "0")  # positional writes, counted here
        calls = []  # number of buffers per syscall
        real = os.pwritev
        monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: calls.append(len(bufs)) or real(fd, bufs, off))
        data = -np.arange(1000, dtype=np.float32)
        write_runs(path, lay, "exp_avg", [(i * 10, i * 10, 10) for i in range(100)][::-1], data)
        assert calls == [1]  # adjacent in source and file: merged into one buffer
        np.testing.assert_array_equal(np_load_file(path)["exp_avg"], data)
        write_runs(path, lay, "exp_avg", [(i * 10, i * 20, 10) for i in range(50)], data)  # gaps: one each
        assert calls == [1] * 51


def test_reads_hash_the_spans_they_read_whole(filled):
    """read_spans names the byte ranges of read_runs' preadvs; read_runs hashes each asked span
    lying inside one of them from the bytes read (even across the buffer's pieces), and skips
    the rest; crc_spans hashes any span from the file."""
    path, lay, arrays = filled
    raw = open(path, "rb").read()
    base = lay.data_offset("exp_avg")
    # Elements 100..300 in two runs, adjacent in the file, apart in the buffer; and 600..650.
    runs = [(100, 0, 100), (200, 500, 100), (600, 200, 50)]
    spans = tensor_io.read_spans(lay, "exp_avg", runs)
    assert spans == [(base + 400, base + 1200), (base + 2400, base + 2600)]
    asked = [(base + 400, base + 1200), (base + 500, base + 900), (base + 1100, base + 2500),
             (base + 2400, base + 2401), (base + 2500, base + 2600)]
    hashes = []
    out = np.zeros(1000, np.float32)
    read_runs(path, lay, "exp_avg", runs, out, hash_spans=asked, hashes=hashes)
    inside = [a for a in asked if any(lo <= a[0] and a[1] <= hi for lo, hi in spans)]
    assert sorted(hashes) == sorted((lo, hi, zlib.crc32(raw[lo:hi])) for lo, hi in inside)
    assert (base + 1100, base + 2500) not in [h[:2] for h in hashes]  # across two reads: skipped
    assert checksums.crc_spans(path, asked) == [zlib.crc32(raw[lo:hi]) for lo, hi in asked]
    with pytest.raises(IntegrityError, match="file ends"):
        checksums.crc_spans(path, [(len(raw) - 4, len(raw) + 4)])


@pytest.mark.parametrize("mode", ["short transfers", "no vectored io"])
def test_short_transfers_are_resumed(tmp_path, monkeypatch, mode):
    """pwrite/pread may move fewer bytes than asked (signals, huge requests): we must resume."""
    if mode == "short transfers":
        for fn in ("preadv", "pwritev"):
            if hasattr(os, fn):
                real = getattr(os, fn)
                monkeypatch.setattr(os, fn, lambda fd, bufs, off, real=real: real(fd, [bufs[0][:7]], off))
    else:
        monkeypatch.delattr(os, "preadv", raising=False)
        monkeypatch.delattr(os, "pwritev", raising=False)
    path = str(tmp_path / "s.safetensors")
    lay = _layout((50,), "F64", names=("param",))
    create_tensor_file(path, lay)
    data = np.arange(50, dtype=np.float64) * 1.5
    runs = [(i * 5, (9 - i) * 5, 5) for i in range(10)]  # file-adjacent, source-reversed
    assert write_runs(path, lay, "param", runs, data) == 400
    expected = data.reshape(10, 5)[::-1].reshape(-1)
    out = np.zeros(50)
    assert read_runs(path, lay, "param", [(d, s, n) for s, d, n in runs], out) == 400
    np.testing.assert_array_equal(out, data)
    monkeypatch.undo()
    np.testing.assert_array_equal(np_load_file(path)["param"], expected)


def test_truncated_file_raises_integrity_error_on_read(filled):
    path, lay, arrays = filled
    cut = lay.data_offset("exp_avg") + 400 * 4 + 2
    os.truncate(path, cut)
    out = np.empty(10, np.float32)
    read_runs(path, lay, "exp_avg", [(390, 0, 10)], out)  # bytes before the cut are still readable
    np.testing.assert_array_equal(out, arrays["exp_avg"][390:400])
    with pytest.raises(IntegrityError) as ei:
        read_runs(path, lay, "exp_avg", [(395, 0, 10)], out)
    msg = str(ei.value)
    assert path in msg and "exp_avg" in msg and str(cut) in msg
    with pytest.raises(IntegrityError, match="truncated"):
        read_header(path)


# ---------------------------------------------------------------- read_header


def test_read_header_of_own_and_foreign_files(tmp_path, filled):
    path, lay, arrays = filled
    assert read_header(path) == lay
    foreign = str(tmp_path / "foreign.safetensors")
    data = {"z": np.ones((2, 3), np.float16), "a": np.arange(5, dtype=np.int64), "m": np.zeros(0, np.float32)}
    np_save_file(data, foreign, metadata={"format": "np"})
    flay = read_header(foreign)
    assert {e[0] for e in flay.entries} == set(data)
    offs = [flay.data_offset(e[0]) for e in flay.entries]
    assert offs == sorted(offs)  # entries come back in data-offset order
    out = np.empty(5, np.int64)
    read_runs(foreign, flay, "a", [(0, 0, 5)], out)
    np.testing.assert_array_equal(out, data["a"])


def _raw_file(path, header, data_bytes=0, length=None):
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(body) if length is None else length) + body + b"\0" * data_bytes)
    return str(path)


def _t(dtype="F32", shape=(2,), offs=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offs)}


HOSTILE = {
    "huge header length": (b"{}", 0, 2**63),
    "header longer than file": (b"{}", 0, 4096),
    "bad json": (b'{"a": ', 0, None),
    "not utf8": (b'{"\xff": 1}', 0, None),
    "not an object": (b"[1, 2]", 0, None),
    "deep nesting": (b"[" * 100000 + b"]" * 100000, 0, None),
    "duplicate name": (b'{"a": ' + json.dumps(_t()).encode() + b', "a": ' + json.dumps(_t()).encode() + b"}", 8, None),
    "unknown dtype": ({"a": _t(dtype="BF99")}, 8, None),
    "negative dim": ({"a": _t(shape=(-2,), offs=(0, 8))}, 8, None),
    "float dim": ({"a": _t(shape=(2.0,))}, 8, None),
    "bool dim": ({"a": _t(shape=(True, 2))}, 8, None),
    "absurd shape": ({"a": _t(shape=(2**40, 2**40), offs=(0, 8))}, 8, None),
    "shape/offset mismatch": ({"a": _t(shape=(3,), offs=(0, 8))}, 8, None),
    "reversed offsets": ({"a": _t(shape=(0,), offs=(8, 0))}, 8, None),
    "overlapping offsets": ({"a": _t(offs=(0, 8)), "b": _t(offs=(4, 12))}, 12, None),
    "gap between tensors": ({"a": _t(offs=(0, 8)), "b": _t(offs=(12, 20))}, 20, None),
    "trailing bytes": ({"a": _t()}, 16, None),
    "entry not an object": ({"a": [1, 2]}, 8, None),
    "bad metadata": ({"__metadata__": {"k": 1}, "a": _t()}, 8, None),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_raise_format_error_before_allocating(tmp_path, case):
    header, data_bytes, length = HOSTILE[case]
    path = _raw_file(tmp_path / "h.safetensors", header, data_bytes, length)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError) as ei:
            read_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert path in str(ei.value)
    assert peak < 4 * 2**20, f"read_header allocated {peak} bytes for a tiny hostile file"


def test_header_length_checked_before_reading(tmp_path):
    path = _raw_file(tmp_path / "h.safetensors", b"{}", 0, 50 * 2**20)  # claims 50 MiB, has 10 bytes
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="header claims"):
            read_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20
    big = _raw_file(tmp_path / "ok.safetensors", b"{}" + b" " * 4094, 0)
    assert read_header(big).entries == ()
    with pytest.raises(FormatError, match="limit"):
        read_header(big, max_header_bytes=1024)


def test_offsets_past_end_of_file_are_a_truncation(tmp_path):
    path = _raw_file(tmp_path / "h.safetensors", {"a": _t(shape=(2**30,), offs=(0, 2**32))}, 8)
    with pytest.raises(IntegrityError, match="truncated") as ei:
        read_header(path)
    assert path in str(ei.value)


def test_tiny_and_missing_files(tmp_path):
    tiny = tmp_path / "tiny"
    tiny.write_bytes(b"\1\0\0")
    with pytest.raises(FormatError, match="too short"):
        read_header(str(tiny))
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        read_header(str(tmp_path / "absent"))


# ---------------------------------------------------------------- checksums


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=5000), st.integers(0, 2**32 - 1), st.integers(0, 5000))
def test_fast_crc32_gives_zlibs_sums(data, start, cut):
    """The checksums on disk are zlib's crc32 whichever implementation computed them."""
    assert checksums.crc32(data) == zlib.crc32(data)
    assert checksums.crc32(data[cut:], checksums.crc32(data[:cut], start)) == zlib.crc32(data, start)


def test_block_checksums_detect_and_locate_a_flipped_bit(tmp_path):
    bb = 64
    payload = np.random.default_rng(0).integers(0, 256, 10 * bb + 23, dtype=np.uint8).tobytes()
    path = str(tmp_path / "c.bin")
    with open(path, "wb") as f:
        f.write(payload)
    sums = block_checksums(path, 0, len(payload), bb)
    assert sums == [f"{zlib.crc32(payload[i:i + bb]):08x}" for i in range(0, len(payload), bb)]
    assert len(sums) == 11 and all(len(s) == 8 for s in sums)
    assert block_checksums(path, 0, 4 * bb, bb) + block_checksums(path, 4 * bb, len(payload), bb) == sums
    verify_range(path, 0, len(payload), sums, bb)

    with open(path, "r+b") as f:  # flip one bit in block 7
        f.seek(7 * bb + 5)
        byte = f.read(1)[0]
        f.seek(7 * bb + 5)
        f.write(bytes([byte ^ 0x10]))
    verify_range(path, 0, 7 * bb, sums, bb)  # blocks before 7: fine
    verify_range(path, 8 * bb, len(payload), sums, bb)  # and after
    with pytest.raises(IntegrityError) as ei:
        verify_range(path, 7 * bb + 60, 7 * bb + 61, sums, bb)
    msg = str(ei.value)
    assert path in msg and "block 7" in msg and f"{7 * bb}..{8 * bb}" in msg and sums[7] in msg
    with pytest.raises(FormatError, match="block 10"):
        verify_range(path, 9 * bb, 10 * bb + 1, sums[:10], bb)


def test_checksums_of_a_subrange_and_short_last_block(tmp_path, filled):
    path, lay, _ = filled
    start = lay.data_offset("param")
    sums = block_checksums(path, start, lay.file_size, 1000)
    lo, hi = lay.byte_range("exp_avg")
    verify_range(path, lo, hi, sums, 1000, base=start)
    verify_range(path, hi - 1, lay.file_size, sums, 1000, base=start, end=lay.file_size)
    with open(path, "r+b") as f:  # corrupt the short last block
        f.seek(lay.file_size - 1)
        f.write(b"\x01")
    verify_range(path, lo, hi, sums, 1000, base=start)
    with pytest.raises(IntegrityError, match=f"block {len(sums) - 1} "):
        verify_range(path, lay.file_size - 1, lay.file_size, sums, 1000, base=start)
    os.truncate(path, lay.file_size - 3)
    with pytest.raises(IntegrityError):
        verify_range(path, lay.file_size - 10, lay.file_size - 3, sums, 1000, base=start, end=lay.file_size)
    with pytest.raises(IntegrityError):
        block_checksums(path, start, lay.file_size, 1000)


# ---------------------------------------------------------------- atomic writes and JSON


def test_atomic_write_bytes_replaces_and_syncs(tmp_path, monkeypatch):
    path = tmp_path / "m.json"
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    atomic_write_bytes(str(path), b"old")
    atomic_write_bytes(str(path), b"new")
    assert path.read_bytes() == b"new"
    assert len(synced) >= 4  # file and directory, twice
    assert os.listdir(tmp_path) == ["m.json"]


@pytest.mark.parametrize("fail_in", ["replace", "fsync", "write"])
def test_atomic_write_bytes_keeps_old_file_on_failure(tmp_path, monkeypatch, fail_in):
    path = tmp_path / "m.json"
    atomic_write_bytes(str(path), b"old contents")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    if fail_in == "write":
        data = memoryview(np.zeros(2**20, np.uint8)).cast("B")
        import builtins
        real_open = builtins.open

        class Half:
            def __init__(self, f):
                self.f = f

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, b):
                self.f.write(bytes(b[: len(b) // 2]))
                raise OSError(28, "No space left on device")

        monkeypatch.setattr(builtins, "open", lambda p, m="r", *a, **k: Half(real_open(p, m)) if "w" in m else real_open(p, m, *a, **k))
    else:
        data = b"new contents"
        monkeypatch.setattr(os, fail_in, boom)
    with pytest.raises(OSError):
        atomic_write_bytes(str(path), data)
    monkeypatch.undo()
    assert path.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["m.json"]  # no temp file left behind


def test_json_round_trip_and_errors(tmp_path):
    path = str(tmp_path / "manifest.json")
    obj = {"version": 1, "tensors": {"b": [1, 2], "a": None}}
    atomic_write_json(path, obj)
    assert read_json(path, "manifest") == obj
    assert open(path).read() == json.dumps(obj, indent=1, sort_keys=True)
    with pytest.raises(IncompleteCheckpointError) as ei:
        read_json(str(tmp_path / "absent.json"), "tracker file")
    assert "tracker file" in str(ei.value) and "absent.json" in str(ei.value)
    for raw in [b'{"version": 1, "tens', b"[1, 2]", b"\xff\xfe", b""]:
        with open(path, "wb") as f:
            f.write(raw)
        with pytest.raises(FormatError) as ei:
            read_json(path, "manifest")
        assert "manifest" in str(ei.value) and path in str(ei.value)


# ---------------------------------------------------------------- safe_join


def test_safe_join_accepts_plain_relative_paths(tmp_path):
    root = str(tmp_path)
    assert safe_join(root, "a/b.safetensors") == os.path.join(root, "a", "b.safetensors")
    os.makedirs(tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "inside")  # symlink staying inside root is fine
    assert safe_join(root, "inside/x") == os.path.join(root, "inside", "x")


@pytest.mark.parametrize("rel", ["../x", "/etc/passwd", "a/../../b", "a/..", "", "a//b", "a/./b",
                                 "a/", "a\x00b", "a\\..\\b", None, 3])
def test_safe_join_refuses_escapes(tmp_path, rel):
    with pytest.raises(FormatError):
        safe_join(str(tmp_path), rel)


def test_safe_join_refuses_symlink_escape(tmp_path):
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    os.symlink(outside, root / "link")
    os.symlink("/etc/passwd", root / "passwd")
    for rel in ["link/x", "link", "passwd"]:
        with pytest.raises(FormatError, match="outside"):
            safe_join(str(root), rel)


@pytest.mark.parametrize("linux", [True, False])
def test_start_writeback_leaves_the_bytes_and_needs_no_linux(tmp_path, monkeypatch, linux):
    if not linux:
        monkeypatch.setattr(durability, "_SYNC_RANGE", None)
    path = tmp_path / "w.bin"
    payload = os.urandom(3 * 2**20)
    path.write_bytes(payload)
    assert durability.start_writeback(str(path)) == (linux and sys.platform == "linux")
    durability.fsync_file(str(path))
    assert path.read_bytes() == payload


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 6)), max_size=40), st.integers(1, 4),
       st.sampled_from([0, 8, 24]))
def test_read_spans_are_the_preadvs_of_the_read(cuts, iov_max, min_bytes):
    """read_spans (in arrays) names exactly the file ranges of _plan's groups (in a loop), the
    groups cut at IOV_MAX runs, those of min_bytes or more."""
    lay = _layout((100,))
    runs, at = [], 0
    for start, length in cuts:  # disjoint in the buffer, anywhere in the file (no overlap)
        if all(start + length <= s or s + n <= start for s, _, n in runs) and start + length <= 100:
            runs.append((start, at, length))
            at += length + (start % 2)  # sometimes adjacent in the buffer too
    with mock.patch.object(tensor_io, "IOV_MAX", iov_max):
        groups = tensor_io._plan(runs, 0, 100, 1 << 62, False, "t")
        isz, base = lay.itemsize("exp_avg"), lay.data_offset("exp_avg")
        expected = [(base + fs * isz, base + (fs + sum(n for _, n in parts)) * isz) for fs, parts in groups]
        assert tensor_io.read_spans(lay, "exp_avg", runs, min_bytes) == [
            s for s in expected if s[1] - s[0] >= min_bytes]
