"""The save planner at scale (plan.route_offers / plan_owned / finish_plan, each tensor planned
by its owner): every region written exactly once, the same coverage verdict as the old planner
(every rank's offers gathered), no rank writing more than one share of anything it holds, and
replicated bytes spread evenly over their holders."""

from contextlib import contextmanager
from math import prod

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.engine import planner
from megatron_ucp.format.layout import MAIN, Region
from megatron_ucp.format.tensor_entry import TensorEntry
from megatron_ucp.engine.plan import WriteItem, assign_writers, coverage_errors, merge_rows
from megatron_ucp.engine.planner import plan_in_memory


@contextmanager
def min_share(nbytes):
    old = planner.MIN_SHARE_BYTES
    planner.MIN_SHARE_BYTES = nbytes
    try:
        yield
    finally:
        planner.MIN_SHARE_BYTES = old


@st.composite
def worlds(draw):
    """Offers of a small world: tensors of 1 or 2 dimensions, split in column boxes (TP), each
    box's flat range cut in pieces (distributed optimizer), each piece held by one or more ranks
    (replicas); sometimes a piece held by nobody (a gap the plan must refuse)."""
    world = draw(st.integers(1, 6))
    states = draw(st.sampled_from([1, 3]))
    offers = {r: [] for r in range(world)}
    shapes = {}
    gap = False
    for n in range(draw(st.integers(1, 4))):
        name = f"t{n}"
        rows, cols = draw(st.integers(1, 9)), draw(st.sampled_from([1, 2, 4, 6]))
        shape = (rows, cols) if draw(st.booleans()) else (rows * cols,)
        shapes[(name, MAIN)] = shape
        tp = draw(st.sampled_from([t for t in (1, 2) if len(shape) == 2 and cols % t == 0] or [1]))
        for t in range(tp):
            if len(shape) == 2:
                offset, box = (0, t * cols // tp), (rows, cols // tp)
            else:
                offset, box = (0,), shape
            numel = prod(box)
            cuts = sorted(draw(st.lists(st.integers(0, numel), max_size=3)))
            for lo, hi in zip([0] + cuts, cuts + [numel]):
                if lo == hi:
                    continue
                holders = draw(st.sets(st.integers(0, world - 1), max_size=world))
                gap |= not holders
                item = WriteItem(name, Region(MAIN, offset, box, lo, hi), (hi - lo) * 4 * states)
                for r in holders:
                    offers[r].append(item)
    return world, states, offers, shapes, gap


def _entries(shapes, states):
    return {name: TensorEntry.new(name, shape, False, 0, ["s"] * states) for (name, _), shape in shapes.items()}


def _new_plan(world, states, offers, shapes, merging=True):
    entries = {r: _entries(shapes, states) for r in range(world)}
    plans, created = plan_in_memory(offers, entries, world, lambda e: prod(e.shape), merging)
    return plans, created


@settings(max_examples=300, deadline=None)
@given(worlds(), st.sampled_from([4, 64, 2**30]), st.booleans())
def test_each_region_once_and_the_old_planners_verdict(case, share, merging):
    world, states, offers, shapes, gap = case
    with min_share(share):
        plans, created = _new_plan(world, states, offers, shapes, merging)
    old = [offers[r] for r in range(world)]
    if merging:
        old, _, _ = merge_rows(old, shapes)
    old_errors = coverage_errors(shapes, assign_writers(old))
    everyone = {tuple(p.errors) for p in plans.values()}
    assert len(everyone) == 1  # every rank raises the same error, or none does
    errors = everyone.pop()
    assert bool(errors) == bool(old_errors) == gap, (errors, old_errors)
    if not gap:
        assert coverage_errors(shapes, [plans[r].items for r in range(world)]) == []
        assert sorted(n for files in created.values() for n in files) == sorted(n for n, _ in shapes)
        assert plans[0].entries == _entries(shapes, states)  # rank 0 has every entry, for the manifest
        for r in range(1, world):
            assert plans[r].entries == {}


@settings(max_examples=200, deadline=None)
@given(worlds())
def test_no_rank_writes_more_than_one_share_of_what_it_holds(case):
    world, states, offers, shapes, gap = case
    if gap:
        return
    with min_share(4):
        plans, _ = _new_plan(world, states, offers, shapes, merging=False)
    for r in range(world):
        held = {i.key: i for i in offers[r]}
        bound = 0
        for item in held.values():
            k = sum(item.key in {o.key for o in offers[q]} for q in range(world))
            count = max(1, min(k, item.nbytes // 4))
            bound += -(-item.region.numel // count) * 4 * states
        assert sum(i.nbytes for i in plans[r].items) <= bound
        for i in plans[r].items:  # only what it holds
            assert any(h.name == i.name and h.region.offset == i.region.offset and h.region.shape == i.region.shape
                       and h.region.start <= i.region.start and i.region.stop <= h.region.stop for h in held.values())


@pytest.mark.parametrize("world", [2, 5, 64])
def test_replicas_share_large_regions_evenly(world):
    """Data-parallel replicas without the distributed optimizer: every rank holds every tensor
    whole; each writes an equal share of each (to an element), not whole tensors by turns."""
    shapes = {(f"w{n}", MAIN): (1000 + n, 7) for n in range(3)}
    offers = {r: [WriteItem(name, Region(MAIN, (0, 0), shape, 0, prod(shape)), prod(shape) * 12)
                  for (name, _), shape in shapes.items()] for r in range(world)}
    with min_share(12):
        plans, _ = _new_plan(world, 3, offers, shapes, merging=False)
    written = [sum(i.nbytes for i in plans[r].items) for r in range(world)]
    per_rank = sum(prod(s) for s in shapes.values()) * 12 / world
    assert max(written) <= per_rank + 3 * 12 and min(written) >= per_rank - 3 * 12


def test_a_tensor_nobody_offers_fails_the_plan_on_every_rank():
    shapes = {("a", MAIN): (4,), ("b", MAIN): (4,)}
    offers = {0: [WriteItem("a", Region(MAIN, (0,), (4,), 0, 4), 16)], 1: []}
    plans, created = _new_plan(2, 1, offers, shapes)
    for r in (0, 1):
        assert plans[r].errors == ["b: held by ranks, but no rank offered any of it"]
    assert created == {}


def test_ranks_that_disagree_on_an_entry_fail_the_plan():
    shapes = {("a", MAIN): (4,)}
    item = WriteItem("a", Region(MAIN, (0,), (4,), 0, 4), 16)
    entries = {0: _entries(shapes, 1), 1: {"a": TensorEntry.new("a", [5], False, 0, ["s"])}}
    plans, _ = plan_in_memory({0: [item], 1: [item]}, entries, 2, lambda e: 1)
    assert plans[0].errors and "describe it differently" in plans[0].errors[0]
    assert plans[1].errors == plans[0].errors


def test_owners_are_stable_and_spread():
    names = [f"decoder.layers.{n}.mlp.linear_fc1.weight" for n in range(4000)]
    owners = [planner.owner_of(n, 1024) for n in names]
    assert owners == [planner.owner_of(n, 1024) for n in names]
    counts = [owners.count(r) for r in range(1024)]
    assert max(counts) <= 16  # about 4 each: no rank plans a large share of the model


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 9), st.sets(st.text("abc.", min_size=1, max_size=6), max_size=12), st.data())
def test_unexpected_names_are_found_by_their_owners(world, saved, data):
    """The strict load's check: the names no rank holds are exactly those some owner reports."""
    holds = {r: data.draw(st.sets(st.sampled_from(sorted(saved)), max_size=len(saved)) if saved else st.just(set()))
             for r in range(world)}
    inbox = {r: [] for r in range(world)}
    for r, names in holds.items():
        for owner, sent in planner.names_by_owner(names, world).items():
            assert all(planner.owner_of(n, world) == owner for n in sent)
            inbox[owner].append(sent)
    owned = planner.names_by_owner(saved, world)
    found = [n for r in range(world) for n in planner.unclaimed(owned.get(r, []), inbox[r])]
    assert sorted(found) == sorted(saved - set().union(*holds.values()))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.data())
def test_hash_plan_gives_every_file_byte_one_rank(world, data):
    """The verified load's hashing, planned by a file's owner from its readers' spans: every
    data byte hashed once, inline only by a rank that reads it, the rest after the load."""
    from megatron_ucp.format.checksums import plan_hashes

    base, block = 8, data.draw(st.integers(1, 16))
    end = base + data.draw(st.integers(0, 60))
    spans = {}
    for r in range(world):
        cuts = sorted(data.draw(st.lists(st.integers(base, end), max_size=4)))
        spans[r] = {"f": [(a, b) for a, b in zip(cuts[::2], cuts[1::2]) if a < b]}
    me = data.draw(st.integers(0, world - 1))
    out = plan_hashes({"f": (base, end, block)}, spans, world, me)
    pieces = []
    for r, got in out.items():
        assert 0 <= r < world
        for lo, hi in got["inline"].get("f", []):
            assert any(a <= lo and hi <= b for a, b in spans[r]["f"])  # inside one of its reads
            pieces.append((lo, hi))
        pieces += [(lo, hi) for name, lo, hi in got["after"]]
    pieces.sort()
    at = base
    for lo, hi in pieces:
        assert lo == at and lo < hi
        at = hi
    assert at == end


@pytest.mark.parametrize("par", [dict(tp=2, pp=2, dp=2), dict(tp=1, pp=2, dp=4, ep=2)])
def test_the_simulator_plans_a_small_worlds_save_and_load(par):
    """benchmarks/bench_scale.py on a small model: the save and the load planned on every rank
    with the real planners (the simulator stops on a plan error, an uncovered or unclaimed
    tensor, replicas that disagree or a checker that finds a block not hashed exactly once),
    the load reading each checkpoint byte once under read-once and once per replica per rank."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bench_scale
    from megatron_ucp.mcore.model_shapes import ModelShape, Parallel

    shape = ModelShape(num_layers=4, hidden=64, ffn=128, heads=4, kv_groups=2, vocab=1000,
                       num_experts=4 if par.get("ep") else 0, moe_ffn=32 if par.get("ep") else None)
    row = bench_scale.simulate(shape, Parallel(**par), peaks=False)
    assert row["ranks"] == 8
    assert abs(row["read_per_byte_once"] - 1) < 0.02  # the vocabulary's padding rows aside
    assert row["read_per_byte_today"] > 1.3  # replicas each read their weights
    assert row["load_s"] > 0 and row["load_meta_mib"] > 0 and row["meta_mib"] > 0
