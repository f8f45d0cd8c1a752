"""Property tests for megatron_ucp.format.layout: tiling of atomic tensors by TP pieces, split/merge
identity against an independent reference split, region runs against brute-force index math,
distributed-optimizer fragments, pipeline layer offsets, and layout errors."""

from math import prod

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_ucp.errors import LayoutError
from megatron_ucp.format.layout import MAIN, PADDING, Piece, Region, Rule, atomic_shape_from_local, fragment_regions, layer_offset, local_shape, merge_runs, padding_shape, pieces, region_runs, split_local

SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

dims = st.integers(1, 5)
tps = st.integers(1, 8)


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------

@st.composite
def layouts(draw, kinds=("replicated", "split", "gated", "vocab")):
    """A valid layout case: dict(rule, shape, tp, padded_rows, held).

    held is the padding_rows_held argument (None = all padding rows) for vocab, else None.
    padding_rows is how many padding rows the padding part really has.
    """
    kind = draw(st.sampled_from(kinds))
    tp = draw(tps)
    padded_rows = held = None
    if kind == "replicated":
        ndim = draw(st.integers(1, 3))
        shape = tuple(draw(st.lists(dims, min_size=ndim, max_size=ndim)))
        rule = Rule("replicated")
    elif kind == "split":
        ndim = draw(st.integers(1, 3))
        dim = draw(st.integers(0, ndim - 1))
        shape = list(draw(st.lists(dims, min_size=ndim, max_size=ndim)))
        shape[dim] = tp * draw(st.integers(1, 4))
        shape = tuple(shape)
        rule = Rule("split", dim)
    elif kind == "gated":
        ndim = draw(st.integers(1, 2))
        shape = (2 * tp * draw(st.integers(1, 3)),) + tuple(
            draw(st.lists(dims, min_size=ndim - 1, max_size=ndim - 1)))
        rule = Rule("gated")
    else:
        ndim = draw(st.integers(1, 2))
        vocab = draw(st.integers(1, 30))
        per_rank = draw(st.integers(-(-vocab // tp), -(-vocab // tp) + 3))
        padded_rows = per_rank * tp
        shape = (vocab,) + tuple(draw(st.lists(dims, min_size=ndim - 1, max_size=ndim - 1)))
        pad = padded_rows - vocab
        held = draw(st.one_of(st.none(), st.integers(0, pad)))
        rule = Rule("vocab")
    padding_rows = 0
    if kind == "vocab":
        padding_rows = padded_rows - shape[0] if held is None else held
    return dict(rule=rule, shape=shape, tp=tp, padded_rows=padded_rows, held=held,
                padding_rows=padding_rows)


def all_pieces(case, rank):
    return pieces(case["rule"], case["shape"], case["tp"], rank, case["padded_rows"], case["held"])


def part_shapes(case):
    return {MAIN: case["shape"], PADDING: padding_shape(case["shape"], case["padding_rows"])}


def box(piece):
    return tuple(slice(o, o + s) for o, s in zip(piece.offset, piece.shape))


def reference_split(full, rule, tp, rank, padded_rows=None, padding=None):
    """Megatron's split, written independently of `pieces`."""
    if rule.kind == "replicated":
        return full.copy()
    if rule.kind == "split":
        return np.split(full, tp, axis=rule.dim)[rank]
    if rule.kind == "gated":
        gate, up = np.split(full, 2, axis=0)
        return np.concatenate([np.split(gate, tp)[rank], np.split(up, tp)[rank]], axis=0)
    held = 0 if padding is None else padding.shape[0]
    zeros = np.zeros((padded_rows - full.shape[0] - held,) + full.shape[1:], dtype=full.dtype)
    parts = [full] + ([padding] if padding is not None else []) + [zeros]
    return np.split(np.concatenate(parts, axis=0), tp)[rank]


def runs_is_merged(runs):
    if len(runs) < 2:
        return True
    src, dst, n = runs[:, 0], runs[:, 1], runs[:, 2]
    adjacent = (src[1:] == src[:-1] + n[:-1]) & (dst[1:] == dst[:-1] + n[:-1])
    return not adjacent.any()


def check_runs_wellformed(runs, region):
    assert runs.dtype == np.int64 and runs.ndim == 2 and runs.shape[1] == 3
    assert (runs[:, 2] > 0).all()
    # Runs tile [0, region.numel) of the region in order.
    assert int(runs[:, 2].sum()) == region.numel
    if len(runs):
        assert runs[0, 0] == 0
        assert (runs[1:, 0] == runs[:-1, 0] + runs[:-1, 2]).all()
    assert runs_is_merged(runs)


def brute_force_map(piece_list, part_shapes_, start, stop):
    """local flat index -> (part, part flat index), for local elements in [start, stop)."""
    out = {}
    for i in range(start, stop):
        for p in piece_list:
            if p.local_start <= i < p.local_start + p.numel:
                box_idx = np.unravel_index(i - p.local_start, p.shape)
                atomic_idx = tuple(int(o + b) for o, b in zip(p.offset, box_idx))
                out[i] = (p.part, int(np.ravel_multi_index(atomic_idx, part_shapes_[p.part])))
    return out


def runs_map(piece_list, part_shapes_, start, stop):
    """The same mapping via fragment_regions + region_runs; fails on double assignment."""
    out = {}
    for lo, region in fragment_regions(piece_list, start, stop):
        runs = region_runs(part_shapes_[region.part], region)
        check_runs_wellformed(runs, region)
        for pos, dst, n in runs.tolist():
            for j in range(n):
                i = lo + pos + j
                assert start <= i < stop
                assert i not in out, f"local element {i} mapped twice"
                out[i] = (region.part, dst + j)
    return out


# --------------------------------------------------------------------------------------------
# 1. Tiling
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(layouts())
def test_pieces_tile_atomic_tensor(case):
    rule, shape, tp = case["rule"], case["shape"], case["tp"]
    loc = local_shape(rule, shape, tp, case["padded_rows"])
    n_local = prod(loc)
    shapes = part_shapes(case)
    counters = {part: np.zeros(s, dtype=np.int64) for part, s in shapes.items()}
    for rank in range(tp):
        plist = all_pieces(case, rank)
        for p in plist:
            assert isinstance(p, Piece)
            assert len(p.offset) == len(p.shape) == len(shape)
            assert p.numel > 0
            counters[p.part][box(p)] += 1
        # In local order, disjoint, inside the local tensor.
        starts = [p.local_start for p in plist]
        assert starts == sorted(starts)
        for a, b in zip(plist, plist[1:]):
            assert a.local_start + a.numel <= b.local_start
        local_cover = np.zeros(n_local, dtype=np.int64)
        for p in plist:
            assert 0 <= p.local_start and p.local_start + p.numel <= n_local
            local_cover[p.local_start:p.local_start + p.numel] += 1
        # Cover exactly the local elements not beyond the held padding rows.
        expected = np.ones(n_local, dtype=np.int64)
        if rule.kind == "vocab":
            rows = rank * loc[0] + np.arange(loc[0])
            held_rows = rows < shape[0] + case["padding_rows"]
            expected = np.repeat(held_rows, prod(loc[1:])).astype(np.int64)
        np.testing.assert_array_equal(local_cover, expected)
    copies = tp if rule.kind == "replicated" else 1
    assert (counters[MAIN] == copies).all(), "main part not covered exactly once"
    assert (counters[PADDING] == 1).all(), "padding part not covered exactly once"
    assert counters[PADDING].shape[0] == case["padding_rows"]


@SETTINGS
@given(layouts(), st.data())
def test_local_shape_roundtrip(case, data):
    rule, shape, tp = case["rule"], case["shape"], case["tp"]
    loc = local_shape(rule, shape, tp, case["padded_rows"])
    assert atomic_shape_from_local(rule, loc, tp, shape[0] if rule.kind == "vocab" else None) == shape
    # Same elements in total: the pieces of one rank never exceed its local tensor.
    rank = data.draw(st.integers(0, tp - 1))
    assert sum(p.numel for p in all_pieces(case, rank)) <= prod(loc)


def test_vocab_tiling_example():
    # vocab 10 padded to 12 over tp=4: rank 3 holds row 9 and padding rows 0..1.
    rule = Rule("vocab")
    assert local_shape(rule, (10, 3), 4, 12) == (3, 3)
    assert pieces(rule, (10, 3), 4, 3, 12) == [
        Piece(0, MAIN, (9, 0), (1, 3)),
        Piece(3, PADDING, (0, 0), (2, 3)),
    ]
    # Only one padding row saved: the last local row belongs to no piece.
    assert pieces(rule, (10, 3), 4, 3, 12, 1) == [
        Piece(0, MAIN, (9, 0), (1, 3)),
        Piece(3, PADDING, (0, 0), (1, 3)),
    ]
    # A rank holding padding only (vocab 4 padded to 8 over tp=2).
    assert pieces(rule, (4,), 2, 1, 8) == [Piece(0, PADDING, (0,), (4,))]


def test_gated_example():
    # fc1 of SwiGLU: [gate; up] with 4 rows each, tp=2: rank 1 holds gate rows 2-3, up rows 6-7.
    assert pieces(Rule("gated"), (8, 5), 2, 1) == [
        Piece(0, MAIN, (2, 0), (2, 5)),
        Piece(10, MAIN, (6, 0), (2, 5)),
    ]


# --------------------------------------------------------------------------------------------
# 2. Split then merge
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(layouts(), st.booleans())
def test_split_then_merge_identity(case, with_padding):
    rule, shape, tp, padded_rows = case["rule"], case["shape"], case["tp"], case["padded_rows"]
    full = np.arange(1, prod(shape) + 1, dtype=np.int64).reshape(shape)
    padding = None
    if rule.kind == "vocab" and with_padding:
        pshape = padding_shape(shape, case["padding_rows"])
        padding = -np.arange(1, prod(pshape) + 1, dtype=np.int64).reshape(pshape)
    held = (0 if padding is None else padding.shape[0]) if rule.kind == "vocab" else None
    out = {MAIN: np.zeros(shape, dtype=np.int64)}
    if padding is not None:
        out[PADDING] = np.zeros(padding.shape, dtype=np.int64)
    for rank in range(tp):
        local = split_local(full, rule, tp, rank, padded_rows, padding)
        assert local.shape == local_shape(rule, shape, tp, padded_rows)
        np.testing.assert_array_equal(local, reference_split(full, rule, tp, rank, padded_rows, padding))
        flat = local.reshape(-1)
        for p in pieces(rule, shape, tp, rank, padded_rows, held):
            out[p.part][box(p)] = flat[p.local_start:p.local_start + p.numel].reshape(p.shape)
    np.testing.assert_array_equal(out[MAIN], full)
    if padding is not None:
        np.testing.assert_array_equal(out[PADDING], padding)


# --------------------------------------------------------------------------------------------
# 3. Region runs
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(layouts(), st.data())
def test_fragment_region_runs_match_brute_force(case, data):
    rule, shape, tp = case["rule"], case["shape"], case["tp"]
    rank = data.draw(st.integers(0, tp - 1), label="tp_rank")
    n_local = prod(local_shape(rule, shape, tp, case["padded_rows"]))
    start = data.draw(st.integers(0, n_local), label="start")
    stop = data.draw(st.integers(start, n_local), label="stop")
    plist = all_pieces(case, rank)
    shapes = part_shapes(case)
    regions = fragment_regions(plist, start, stop)
    for lo, region in regions:
        assert start <= lo and lo + region.numel <= stop and region.numel > 0
        runs = region_runs(shapes[region.part], region)
        if rule.kind in ("vocab", "gated") or (rule.kind == "split" and rule.dim == 0) \
                or rule.kind == "replicated":
            # Row blocks (column-parallel, vocab, gated halves, whole tensors) are contiguous.
            assert len(runs) == 1, runs
    assert runs_map(plist, shapes, start, stop) == brute_force_map(plist, shapes, start, stop)


@st.composite
def boxes(draw):
    ndim = draw(st.integers(0, 4))
    part_shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    offset, shape = [], []
    for n in part_shape:
        o = draw(st.integers(0, n - 1))
        offset.append(o)
        shape.append(draw(st.integers(1, n - o)))
    numel = prod(shape)
    start = draw(st.integers(0, numel))
    stop = draw(st.integers(start, numel))
    part = draw(st.sampled_from([MAIN, PADDING]))
    return part_shape, Region(part, tuple(offset), tuple(shape), start, stop)


@settings(max_examples=100, deadline=None)
@given(boxes())
def test_region_runs_arbitrary_box(arg):
    part_shape, region = arg
    runs = region_runs(part_shape, region)
    check_runs_wellformed(runs, region)
    expected = np.array(
        [np.ravel_multi_index(tuple(int(o + b) for o, b in zip(region.offset, np.unravel_index(i, region.shape))),
                              part_shape) if part_shape else 0
         for i in range(region.start, region.stop)], dtype=np.int64)
    got = np.concatenate([np.arange(d, d + n) for _, d, n in runs.tolist()] or [np.zeros(0, np.int64)])
    np.testing.assert_array_equal(got, expected)
    # A box whose trailing dims span the tensor is one run.
    if all(s == n for s, n in zip(region.shape[1:], part_shape[1:])) and region.numel:
        assert len(runs) == 1


def test_region_runs_examples():
    # Row-parallel (split dim 1) 4x6 over tp=2, rank 1: columns 3..5 of each row.
    region = Region(MAIN, (0, 3), (4, 3), 0, 12)
    np.testing.assert_array_equal(region_runs((4, 6), region),
                                  [[0, 3, 3], [3, 9, 3], [6, 15, 3], [9, 21, 3]])
    # Fragment starting mid-row and ending mid-row.
    region = Region(MAIN, (0, 3), (4, 3), 2, 7)
    np.testing.assert_array_equal(region_runs((4, 6), region), [[0, 5, 1], [1, 9, 3], [4, 15, 1]])
    # Column-parallel: one run.
    np.testing.assert_array_equal(region_runs((4, 6), Region(MAIN, (2, 0), (2, 6), 1, 11)),
                                  [[0, 13, 10]])
    assert region_runs((4, 6), Region(MAIN, (2, 0), (2, 6), 5, 5)).shape == (0, 3)


def test_merge_runs():
    runs = np.array([[0, 10, 2], [2, 12, 3], [5, 20, 1], [7, 21, 1]], dtype=np.int64)
    np.testing.assert_array_equal(merge_runs(runs), [[0, 10, 5], [5, 20, 1], [7, 21, 1]])


def test_region_runs_errors():
    with pytest.raises(LayoutError, match="outside tensor"):
        region_runs((4, 6), Region(MAIN, (3, 0), (2, 6), 0, 1))
    with pytest.raises(LayoutError, match="outside box"):
        region_runs((4, 6), Region(MAIN, (0, 0), (2, 6), 0, 13))
    with pytest.raises(LayoutError, match="outside box"):
        region_runs((4, 6), Region(MAIN, (0, 0), (2, 6), 3, 2))


# --------------------------------------------------------------------------------------------
# 4. Distributed-optimizer fragments
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(layouts(), st.integers(1, 6), st.data())
def test_dp_fragments_tile_pieces(case, dp, data):
    rule, shape, tp = case["rule"], case["shape"], case["tp"]
    n_local = prod(local_shape(rule, shape, tp, case["padded_rows"]))
    shapes = part_shapes(case)
    total = {part: np.zeros(prod(s), dtype=np.int64) for part, s in shapes.items()}
    for rank in range(tp):
        plist = all_pieces(case, rank)
        cuts = sorted(data.draw(st.lists(st.integers(0, n_local), min_size=dp - 1, max_size=dp - 1),
                                label=f"cuts of rank {rank}"))
        bounds = [0] + cuts + [n_local]
        by_fragments = {part: np.zeros(prod(s), dtype=np.int64) for part, s in shapes.items()}
        for start, stop in zip(bounds, bounds[1:]):
            for _, region in fragment_regions(plist, start, stop):
                for _, dst, n in region_runs(shapes[region.part], region).tolist():
                    by_fragments[region.part][dst:dst + n] += 1
        by_pieces = {part: np.zeros(s, dtype=np.int64) for part, s in shapes.items()}
        for p in plist:
            by_pieces[p.part][box(p)] += 1
        for part in shapes:
            # The dp fragments of one TP rank hold that rank's pieces exactly once.
            np.testing.assert_array_equal(by_fragments[part], by_pieces[part].reshape(-1))
            total[part] += by_fragments[part]
    copies = tp if rule.kind == "replicated" else 1
    assert (total[MAIN] == copies).all()
    assert (total[PADDING] == 1).all()


# --------------------------------------------------------------------------------------------
# 5. Layer offsets
# --------------------------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.one_of(st.none(), st.integers(1, 4)), st.integers(1, 4))
def test_layer_offsets_tile_layers(pp, vpp, per_chunk):
    num_layers = pp * (vpp or 1) * per_chunk
    seen = np.zeros(num_layers, dtype=np.int64)
    stages = [None] if vpp is None else range(vpp)
    for r in range(pp):
        for v in stages:
            off = layer_offset(num_layers, pp, r, vpp, v)
            assert 0 <= off and off + per_chunk <= num_layers
            seen[off:off + per_chunk] += 1
            # Megatron: vp_stage * (L / vpp) + pp_rank * (L / vpp / pp).
            lv = num_layers // (vpp or 1)
            assert off == (v or 0) * lv + r * (lv // pp)
    assert (seen == 1).all()


def test_layer_offset_examples():
    def layers(r, v):
        off = layer_offset(8, 2, r, 2, v)
        return list(range(off, off + 2))

    assert layers(0, 0) == [0, 1]
    assert layers(0, 1) == [4, 5]
    assert layers(1, 0) == [2, 3]
    assert layers(1, 1) == [6, 7]
    # No virtual pipeline: contiguous blocks.
    assert [layer_offset(12, 4, r) for r in range(4)] == [0, 3, 6, 9]
    assert [layer_offset(12, 4, r, 1, 0) for r in range(4)] == [0, 3, 6, 9]


def test_layer_offset_uneven():
    with pytest.raises(LayoutError, match="does not split evenly"):
        layer_offset(10, 4, 0)
    with pytest.raises(LayoutError, match=r"size 8 .* 6 ranks"):
        layer_offset(8, 2, 0, 3, 0)


# --------------------------------------------------------------------------------------------
# 6. Errors
# --------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.integers(2, 8), st.integers(1, 40), st.integers(1, 3))
def test_uneven_split_raises(tp, size, other):
    if size % tp == 0:
        size += 1
    for rule, shape in ((Rule("split", 0), (size, other)), (Rule("split", 1), (other, size))):
        with pytest.raises(LayoutError, match=rf"size {size} does not split evenly over {tp} ranks"):
            local_shape(rule, shape, tp)
        with pytest.raises(LayoutError, match=rf"dim {rule.dim}"):
            pieces(rule, shape, tp, 0)
    # Gated: the half must split over tp.
    with pytest.raises(LayoutError, match="gated"):
        pieces(Rule("gated"), (2 * size, other), tp, 0)
    # Vocab: the padded vocabulary must split over tp.
    with pytest.raises(LayoutError, match="padded vocabulary"):
        pieces(Rule("vocab"), (1, other), tp, 0, size)


def test_errors():
    with pytest.raises(LayoutError, match="gated"):
        local_shape(Rule("gated"), (7, 4), 1)  # odd number of rows: no [gate; up]
    with pytest.raises(LayoutError, match="padded rows >= 10"):
        local_shape(Rule("vocab"), (10, 4), 2, 8)
    with pytest.raises(LayoutError, match="padded rows"):
        pieces(Rule("vocab"), (10, 4), 2, 0)
    with pytest.raises(LayoutError, match="unknown layout rule"):
        Rule("diagonal")
    with pytest.raises(LayoutError, match="splits dim 0"):
        Rule("gated", 1)
    with pytest.raises(LayoutError, match="splits dim 0"):
        Rule("vocab", 1)
    with pytest.raises(LayoutError, match="over 0 ranks"):
        local_shape(Rule("split"), (4,), 0)
    assert Rule.from_json(Rule("split", 1).to_json()) == Rule("split", 1)


@settings(max_examples=40, deadline=None)
@given(layouts(), st.data())
def test_tp_rank_out_of_range_raises(case, data):
    tp = case["tp"]
    bad = data.draw(st.one_of(st.integers(-5, -1), st.integers(tp, tp + 5)))
    with pytest.raises(LayoutError, match=rf"tensor-parallel rank {bad} outside 0\.\.{tp - 1}"):
        pieces(case["rule"], case["shape"], tp, bad, case["padded_rows"], case["held"])
    with pytest.raises(LayoutError):
        split_local(np.zeros(case["shape"]), case["rule"], tp, bad, case["padded_rows"])
