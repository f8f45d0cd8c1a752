"""The local tier's placement and restore choice (engine/local_plan.py), as properties."""

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ucp.engine import local_plan as lp


@st.composite
def clusters(draw):
    """Host names per rank: 1-6 nodes of 1-4 ranks, in blocks or interleaved."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=6))
    hosts = [f"n{i}" for i, n in enumerate(sizes) for _ in range(n)]
    if draw(st.booleans()):
        hosts = draw(st.permutations(hosts))
    return list(hosts)


@settings(max_examples=200, deadline=None)
@given(clusters(), st.integers(0, 4))
def test_replicas_live_on_other_distinct_nodes(hosts, k):
    targets = lp.replica_targets(hosts, k)
    nodes = len(set(hosts))
    for rank, ts in targets.items():
        places = [hosts[t] for t in ts]
        assert hosts[rank] not in places  # never on its own node
        assert len(set(places)) == len(places) == min(k, nodes - 1)  # each on another node
    # nodes of equal size: every rank keeps as many replicas as it sends (memory evenly spread)
    if len({len(r) for r in lp.nodes_of(hosts).values()}) == 1:
        for rank in targets:
            assert len(lp.replica_sources(targets, rank)) == min(k, nodes - 1)


@settings(max_examples=100, deadline=None)
@given(clusters(), st.integers(0, 3), st.data())
def test_node_shares_add_up_to_every_copy(hosts, k, data):
    """Over all nodes, the originals are every piece once and the replicas every piece as often
    as it is replicated."""
    sizes = data.draw(st.lists(st.integers(0, 1000), min_size=len(hosts), max_size=len(hosts)))
    shares = [lp.node_share(hosts, sizes, k, h) for h in set(hosts)]
    copies = min(k, len(set(hosts)) - 1)
    assert sum(o for o, _ in shares) == sum(sizes)
    assert sum(r for _, r in shares) == copies * sum(sizes)


def _inventory(hosts, world, iteration, lost=(), bad=()):
    """What each surviving node holds of `iteration` after a save on `hosts` with 1 replica."""
    targets = lp.replica_targets(hosts, 1)
    held = {}
    for rank in range(world):
        for where in [rank] + targets[rank]:
            h = hosts[where]
            if h not in lost:
                why = "corrupt" if (h, rank) in bad else None
                held.setdefault(h, []).append(lp.Copy(h, rank, 10, why))
    return {h: [lp.Iteration(iteration, world, tuple(cs))] for h, cs in held.items()}


@settings(max_examples=200, deadline=None)
@given(clusters(), st.data())
def test_one_lost_node_leaves_every_piece(hosts, data):
    """With one replica and at least two nodes, losing any one node leaves a sound copy of
    every rank's piece; the choice restores it, and every surviving leader gets every piece
    it lacks from a surviving holder."""
    nodes = sorted(set(hosts))
    if len(nodes) < 2:
        return
    lost = data.draw(st.sampled_from(nodes))
    inv = _inventory(hosts, len(hosts), 6, lost={lost})
    choice = lp.choose(list(inv.values()), newer_than=5)
    assert choice.iteration == 6 and choice.world == len(hosts) and not choice.notes
    survivors = [h for h in hosts if h != lost]
    moves = lp.transfers(choice, survivors)
    for host, ranks in lp.nodes_of(survivors).items():
        got = [saved for _, receiver, saved in moves if survivors[receiver] == host]
        local = {r for r, hs in choice.holders.items() if host in hs}
        assert set(got) | local == set(range(len(hosts))) and not set(got) & local and len(got) == len(set(got))
        for role in (0, 1):  # what a node receives, and what it sends, spread over its ranks in turn
            count = [sum(1 for m in moves if m[role] == r) for r in ranks]
            assert max(count) - min(count) <= 1, (host, role, count)
    for sender, _, saved in moves:
        assert survivors[sender] in choice.holders[saved]


def test_bad_copies_fall_back_and_are_named():
    hosts = ["a", "a", "b", "b"]
    newer = _inventory(hosts, 4, 6, lost={"b"}, bad={("a", 2)})
    older = _inventory(hosts, 4, 4, lost={"b"})
    inventories = [newer["a"] + older["a"]]
    choice = lp.choose(inventories, newer_than=3)
    assert choice.iteration == 4
    assert choice.notes == ["local iteration 6: bad copies: a: rank 2's piece corrupt",
                            "local iteration 6: no sound copy of the pieces of ranks 2"]
    none = lp.choose(inventories, newer_than=4)
    assert none.iteration is None and none.notes[-1] == ("local iteration 4 is not newer than the "
                                                         "persistent checkpoint's 4")


def test_a_copy_found_bad_on_read_takes_the_other():
    """mark_bad (what reading the chosen copies found): the next choice takes the other copy."""
    hosts = ["a", "a", "b", "b"]
    inv = list(_inventory(hosts, 4, 6).values())
    first = lp.choose(inv, newer_than=-1)
    assert first.holders[0] == ["a", "b"]
    again = lp.choose(lp.mark_bad(inv, [("a", 6, 0, "CRC-32 differs")]), newer_than=-1)
    assert again.iteration == 6 and again.holders[0] == ["b"]
    assert again.notes == ["local iteration 6: bad copies: a: rank 0's piece CRC-32 differs"]
    assert lp.transfers(again, hosts) == [(2, 0, 0)]  # a lacks only 0; b holds every piece


def test_nodes_disagreeing_on_world_are_skipped():
    one = [lp.Iteration(6, 2, (lp.Copy("a", 0, 1), lp.Copy("a", 1, 1)))]
    other = [lp.Iteration(6, 4, (lp.Copy("b", 2, 1),))]
    choice = lp.choose([one, other], newer_than=-1)
    assert choice.iteration is None and "disagree" in choice.notes[0]


def test_ranges():
    assert lp._ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


spans_lists = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1])),
                       max_size=12)


@settings(max_examples=300, deadline=None)
@given(spans_lists)
def test_merged_spans_cover_exactly_the_bytes_of_the_spans(spans):
    """Issue 48: merge is the set union of the spans, as sorted, disjoint, non-touching spans."""
    merged = lp.merge(spans)
    covered = {b for s, e in spans for b in range(s, e)}
    assert {b for s, e in merged.tolist() for b in range(s, e)} == covered
    assert lp.span_bytes(merged) == len(covered)
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(merged.tolist(), merged.tolist()[1:]))
    for s, e in spans:
        assert lp.within(merged, s, e)
    for b in set(range(0, 245)) - covered:
        assert not lp.within(merged, b, b + 1)


@settings(max_examples=200, deadline=None)
@given(clusters(), st.data())
def test_each_node_receives_the_union_of_its_ranks_needs_once(hosts, data):
    """Issue 48: for every piece a node lacks, its leader receives exactly the bytes some rank
    of that node reads of it (each byte once), whatever the others read."""
    world = data.draw(st.integers(1, 4))
    nodes = sorted(set(hosts))
    holders = {r: sorted(data.draw(st.sets(st.sampled_from(nodes), min_size=1))) for r in range(world)}
    choice = lp.Choice(1, world, holders)
    moves = lp.transfers(choice, hosts)
    needs = [(h, {p: lp.merge(data.draw(spans_lists)) for p in range(world) if data.draw(st.booleans())})
             for h in hosts]
    wanted = lp.node_spans(needs, moves, hosts)
    assert sorted(wanted) == sorted((receiver, saved) for _, receiver, saved in moves)
    for (receiver, saved), spans in wanted.items():
        host = hosts[receiver]
        assert host not in holders[saved]
        read = {b for h, n in needs if h == host for s, e in n.get(saved, lp.merge([])).tolist()
                for b in range(s, e)}
        assert {b for s, e in spans.tolist() for b in range(s, e)} == read
        assert lp.span_bytes(spans) == len(read)  # each byte once
