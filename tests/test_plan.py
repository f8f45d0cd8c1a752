"""Save plans: split columns merged into whole rows still write every element exactly once, and
the blocks the exchange moves put each element where the file wants it."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.errors import ConfigError
from megatron_ucp.format.layout import MAIN, Region, region_runs
from megatron_ucp.format.tensor_entry import TensorEntry
from megatron_ucp.engine.plan import (SHORT_ROW_BYTES, RowMerge, WriteItem, assign_writers, check_coverage, merge_rows,
                                      row_merges)
from megatron_ucp.engine.planner import plan_in_memory
from megatron_ucp.engine.save import _block_views, _column_block, _merging_rows, _with_ends


@st.composite
def split_layouts(draw):
    """Ranks of a TP x DP grid holding a column-split (rows, tp * width) tensor, each TP rank its
    columns, each DP rank a contiguous range of the local flat tensor (the distributed
    optimizer) or the whole of it on every replica; plus a replicated tensor."""
    tp = draw(st.sampled_from([2, 4]))
    rows, width = draw(st.integers(1, 12)), draw(st.integers(1, 6))
    dp = draw(st.integers(1, 3))
    numel = rows * width
    if draw(st.booleans()):  # distributed optimizer: DP ranks split the local flat tensor
        cuts = sorted(draw(st.lists(st.integers(0, numel), min_size=dp - 1, max_size=dp - 1)))
        ranges = list(zip([0] + cuts, cuts + [numel]))
    else:  # replicas: every DP rank holds it all
        ranges = [(0, numel)] * dp
    states = draw(st.integers(1, 3))
    return tp, rows, width, ranges, states


def _offers(tp, rows, width, ranges, states):
    offers, sources = [], []
    full = np.arange(rows * tp * width, dtype=np.float32).reshape(rows, tp * width)
    for start, stop in ranges:  # rank = dp * tp + t: TP varies fastest
        for t in range(tp):
            local = full[:, t * width:(t + 1) * width].reshape(-1)
            offer, source = [], {}
            if start < stop:
                item = WriteItem("w", Region(MAIN, (0, t * width), (rows, width), start, stop),
                                 (stop - start) * 4 * states)
                offer.append(item)
                data = {s: torch.from_numpy(local[start:stop] * (s + 1)) for s in range(states)}
                source[item.key] = (0, data)
            norm = WriteItem("norm", Region(MAIN, (0,), (7,), 0, 7), 28)
            offer.append(norm)
            offers.append(offer)
            sources.append(source)
    return offers, sources, full


def _entry(name, shape, states):
    return TensorEntry.new(name, shape, False, 0, [f"s{i}" for i in range(states)])


def _global_plan(offers, part_shapes, states):
    """The old planner: every rank's offers gathered, one plan for the world."""
    merged_offers, sets, ends = merge_rows(offers, part_shapes)
    plan = assign_writers(merged_offers)
    merges = {(m.item.key, m.writer): m for m in row_merges(plan, sets)}
    ends = [{k: src for (k, r), src in ends.items() if r == rank} for rank in range(len(offers))]
    return plan, merges, ends


def _owner_plan(offers, part_shapes, states):
    """The planner at scale: each tensor planned by its owner (exchanges in memory)."""
    world = len(offers)
    entries = {r: {name: _entry(name, shape, states) for (name, _), shape in part_shapes.items()}
               for r in range(world)}
    plans, _ = plan_in_memory(dict(enumerate(offers)), entries, world, lambda e: 1)
    assert not plans[0].errors, plans[0].errors
    plan = [plans[r].items for r in range(world)]
    seen, own = {}, {}
    for r in range(world):
        for m in plans[r].merges:
            assert r == m.writer or r in {b.rank for b in m.blocks}  # only the merges it is in
            for i, b in enumerate(m.blocks):
                assert (b.source is not None) == (b.rank == r)  # the source of its own blocks only
                if b.rank == r:
                    own[(m.item.key, m.writer, i)] = b
            seen[(m.item.key, m.writer)] = m
    merges = {key: RowMerge(m.item, m.writer, tuple(own[key + (i,)] for i in range(len(m.blocks))))
              for key, m in seen.items()}
    return plan, merges, [plans[r].ends for r in range(world)]


@settings(max_examples=300, deadline=None)
@given(split_layouts(), st.sampled_from([_global_plan, _owner_plan]))
def test_merged_rows_cover_the_tensor_once_and_carry_the_right_elements(layout, planner):
    """Replays a save: every planned item's bytes (whole rows assembled from the blocks the
    exchange moves, partial rows and unmerged items from the writer's own data) land in the
    file tensor, which must come out whole; for the old planner and the planner at scale."""
    tp, rows, width, ranges, states = layout
    offers, sources, full = _offers(tp, rows, width, ranges, states)
    part_shapes = {("w", MAIN): full.shape, ("norm", MAIN): (7,)}
    plan, merges, ends = planner(offers, part_shapes, states)
    check_coverage(part_shapes, plan)  # raises on a gap or an overlap
    written = np.full((states,) + full.shape, np.nan, dtype=np.float32)
    for rank, items in enumerate(plan):
        mine = _with_ends(sources[rank], ends[rank])
        for item in items:
            if item.name != "w":
                continue
            region = item.region
            m = merges.get((item.key, rank))
            if m is not None:
                assert region.offset[1] == 0 and region.shape[1] == tp * width  # whole rows
                assert len(region_runs(full.shape, region)) == 1  # one contiguous write
                assert sorted(b.columns for b in m.blocks) == [(t * width, (t + 1) * width) for t in range(tp)]
                data = np.zeros((states,) + region.shape, dtype=np.float32)
                for b in m.blocks:
                    assert b.source in sources[b.rank]  # the sender offered what it sends
                    views = _block_views(b, sources[b.rank][b.source])
                    block = _column_block(views)
                    staged = _column_block(views, torch.empty_like(block))
                    assert torch.equal(block, staged)  # the async path fills a kept buffer
                    data[:, :, b.columns[0]:b.columns[1]] = block.numpy()
                data, offset = data.reshape(states, -1), 0
            else:
                offset, arrays = mine[item.key]
                data = np.stack([arrays[s].numpy() for s in range(states)])
            for pos, at, n in region_runs(full.shape, region):
                written.reshape(states, -1)[:, at:at + n] = data[:, offset + pos:offset + pos + n]
    for s in range(states):
        np.testing.assert_array_equal(written[s], full * (s + 1))


def test_a_layout_without_split_columns_is_left_as_it_is():
    item = WriteItem("w", Region(MAIN, (0, 0), (4, 8), 0, 32), 128)  # whole rows already
    width = SHORT_ROW_BYTES // 4  # a complete set of column blocks, each too wide to merge
    wide = [WriteItem("v", Region(MAIN, (0, c * width), (2, width), 0, 2 * width), 8 * width) for c in (0, 1)]
    offers = [[item, wide[0]], [item, wide[1]]]
    shapes = {("w", MAIN): (4, 8), ("v", MAIN): (2, 2 * width)}
    assert merge_rows(offers, shapes) == (offers, {}, {})


def test_a_missing_column_block_is_not_merged():
    # Only TP rank 0's columns are offered (rank 1's are elsewhere): no merge, nothing lost.
    item = WriteItem("w", Region(MAIN, (0, 0), (4, 4), 0, 16), 64)
    assert merge_rows([[item]], {("w", MAIN): (4, 8)}) == ([[item]], {}, {})


def test_merge_switch_must_be_0_or_1(monkeypatch):
    monkeypatch.setenv("UCP_MERGE_ROWS", "0")
    assert _merging_rows() is False
    monkeypatch.setenv("UCP_MERGE_ROWS", "yes")
    with pytest.raises(ConfigError, match="UCP_MERGE_ROWS"):
        _merging_rows()
