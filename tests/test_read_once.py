"""Read-once loads (issue 24): data-parallel replicas split the reads of what they share and
exchange it, so that a load reads each checkpoint byte from storage once per job.

The planner is property-tested in-process; one 4-process group checks, for a DP load, a
layout-changing load (TP2xPP2 -> TP1xDP4, with and without the distributed optimizer) and an
expert-parallel MoE load, that the ranks together read the checkpoint's tensor bytes once, that
the loaded state is bitwise the per-rank policy's, and that resumed losses continue with either
policy.
"""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import assert_same_state, losses, max_loss_delta, ok, roundtrip_step, run_steps, train_step
from megatron_ucp.format import manifest as mf
from megatron_ucp.format.tensor_entry import file_layout
from megatron_ucp.errors import LayoutError
from megatron_ucp.engine.read_plan import Need, digest, disagreement, order, split

N, K = 6, 3
TOL, MOE_TOL = 1e-4, 1e-3
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DIST = ["--use-distributed-optimizer"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear",
       "--moe-ffn-hidden-size", "32"]
EP2 = ["--expert-model-parallel-size", "2"]
BF16 = ["--bf16"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
TENSOR = "decoder.layers.1.mlp.linear_fc1.weight"
TIED_TENSOR = "embedding.word_embeddings.weight"  # the test GPT ties its output layer to it
TIED = {"pp2dp2": PP2 + DIST, "pp2dp2_nodist": PP2, "pp2dp2_bf16": PP2 + DIST + BF16,
        "pp4": ["--pipeline-model-parallel-size", "4"] + DIST, "tp2pp2": TP2PP2 + DIST}
POLICIES = ("once", "per-rank")  # and "auto": once across nodes, per rank within one


# -- the planner ------------------------------------------------------------------------------

needs_strategy = st.lists(st.tuples(st.sampled_from("abcdefg"), st.sampled_from(["param", "exp_avg"]),
                                    st.integers(0, 50), st.integers(0, 300)), max_size=12)


def _needs(raw):
    return [Need(name, state, start, start + n) for name, state, start, n in raw]


@settings(max_examples=300, deadline=None)
@given(needs_strategy, st.integers(1, 9))
def test_every_element_is_read_by_exactly_one_member_and_reads_are_balanced(raw, members):
    needs = _needs(raw)
    shares = split(needs, members)
    for i, n in enumerate(needs):  # the shares of each need tile it, in order
        mine = [s for s in shares if s.need == i]
        assert [(s.start, s.stop) for s in mine] == sorted((s.start, s.stop) for s in mine)
        pos = n.start
        for s in mine:
            assert s.start == pos and s.stop > s.start and 0 <= s.reader < members
            pos = s.stop
        assert pos == n.stop
    per = [sum(s.stop - s.start for s in shares if s.reader == k) for k in range(members)]
    assert sum(per) == sum(n.numel for n in needs)
    assert max(per) - min(per) <= 1  # balanced to the element
    assert len(shares) <= sum(1 for n in needs if n.numel) + members - 1  # few cuts
    readers = [s.reader for s in shares]
    assert readers == sorted(readers)  # each member reads one run of the line


@settings(max_examples=100, deadline=None)
@given(needs_strategy, st.randoms())
def test_members_agree_whatever_order_they_found_their_tensors_in(raw, rnd):
    needs = _needs(raw)
    shuffled = list(needs)
    rnd.shuffle(shuffled)
    a = [needs[i] for i in order(needs)]
    b = [shuffled[i] for i in order(shuffled)]
    assert a == b and digest(a) == digest(b)
    assert split(a, 3) == split(b, 3)


def test_a_member_with_other_needs_is_named():
    a = [Need("w", "param", 0, 10, "boxes A")]
    b = [Need("w", "param", 0, 10, "boxes B")]
    assert digest(a) != digest(b)
    assert disagreement([digest(a)] * 3, [0, 2, 4]) is None
    why = disagreement([digest(a), digest(b), digest(a)], [0, 2, 4])
    assert "ranks [2]" in why and "[0, 2, 4]" in why
    with pytest.raises(LayoutError):
        Need("w", "param", 5, 4)
    with pytest.raises(LayoutError):
        split(a, 0)


# -- 4 processes ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("read_once")


def _policy(p):
    return ["--ckpt-read-policy", p]


@pytest.fixture(scope="module")
def w4(work):
    d = lambda name: str(work / name)  # noqa: E731
    steps = [train_step("a", TP2PP2 + DIST, iters=N, save=d("A"), interval=K),
             train_step("m", MOE + EP2 + DIST, iters=N, save=d("M"), interval=K)]
    for p in POLICIES:
        steps += [
            # Layout-changing loads: TP2xPP2 -> TP1xDP4, with and without the distributed optimizer.
            roundtrip_step(f"r_dp4_{p}", DIST + _policy(p), d("A"), K, d(f"R_dp4_{p}"), iters=N),
            roundtrip_step(f"r_nodist_{p}", _policy(p), d("A"), K, d(f"R_nodist_{p}"), iters=N),
            # A DP load: TP1xDP4 -> TP1xDP4 (the checkpoint the first roundtrip saved).
            roundtrip_step(f"r_same_{p}", DIST + _policy(p), d("R_dp4_once"), K, d(f"R_same_{p}"), iters=N),
            # bf16 parameters: the exchange goes through fp32 staging buffers (the master weights
            # must not pass through bf16).
            roundtrip_step(f"r_bf16_{p}", DIST + BF16 + _policy(p), d("A"), K, d(f"R_bf16_{p}"), iters=N),
            # MoE, EP2xDP2 -> EP1xDP4: experts replicated over the expert data-parallel group.
            roundtrip_step(f"r_moe_{p}", MOE + DIST + _policy(p), d("M"), K, d(f"R_moe_{p}"), iters=N),
            train_step(f"b_{p}", DIST + _policy(p), iters=N, load=d("A"), step=K),
            train_step(f"b_moe_{p}", MOE + DIST + _policy(p), iters=N, load=d("M"), step=K),
        ]
    # Faults in bytes that only one rank reads: every rank raises (none waits in the exchange).
    for fault, action, fraction, extra in (("flip", "flip", 1 / 5, []),
                                           ("cut", "truncate", 1 / 5, ["--no-verify-checkpoint"])):
        steps += [{"name": f"corrupt_{fault}", "op": "corrupt_copy", "src": d("A"), "dst": d(f"F_{fault}"),
                   "tensor": TENSOR, "action": action, "fraction": fraction},
                  {"name": f"load_{fault}", "op": "load_expecting_error", "fatal": False,
                   "argv": train_step("", DIST + _policy("once") + extra, iters=N)["argv"]
                   + ["--load", d(f"F_{fault}")]}]
    # TP2xDP2 (partial rows, TP-replicated tensors; with and without the distributed optimizer);
    # the tied output layer's copy on the last stage: PP2xDP2 (with and without the distributed
    # optimizer, whose moments' fragments differ between the stages; bf16), PP4 (two stages
    # between, no data parallelism), TP2xPP2.
    steps += [roundtrip_step("r_tp2dp2", TP2 + DIST + _policy("once"), d("A"), K, d("R_tp2dp2"), iters=N),
              roundtrip_step("r_tp2dp2_nodist", TP2 + _policy("once"), d("A"), K, d("R_tp2dp2_nodist"), iters=N)]
    for case, extra in TIED.items():
        steps.append(roundtrip_step(f"r_{case}", extra + _policy("once"), d("A"), K, d(f"R_{case}"), iters=N))
    # "auto" on PP2xDP2: the tied copy is read again on one node, sent across (pretended) nodes.
    steps += [roundtrip_step("r_pp2dp2_per-rank", PP2 + DIST + _policy("per-rank"), d("A"), K, d("R_pp2_pr"), iters=N),
              roundtrip_step("r_pp2_auto", PP2 + DIST + _policy("auto"), d("A"), K, d("R_pp2_auto"), iters=N),
              dict(roundtrip_step("r_pp2_auto_nodes", PP2 + DIST + _policy("auto"), d("A"), K, d("R_pp2_nodes"),
                                  iters=N), ranks_per_node=2)]
    # A damaged byte, or a cut file, of the tied tensor, which only the first stage reads: every rank raises.
    for fault, action, extra in (("flip", "flip", []), ("cut", "truncate", ["--no-verify-checkpoint"])):
        steps += [{"name": f"corrupt_tied_{fault}", "op": "corrupt_copy", "src": d("A"), "dst": d(f"T_{fault}"),
                   "tensor": TIED_TENSOR, "action": action, "fraction": 1 / 3},
                  {"name": f"load_tied_{fault}", "op": "load_expecting_error", "fatal": False,
                   "argv": train_step("", PP2 + DIST + _policy("once") + extra, iters=N)["argv"]
                   + ["--load", d(f"T_{fault}")]}]
    # "auto": per rank on this one node; once where the group spans (pretended) nodes of 2 ranks.
    steps += [roundtrip_step("r_auto", DIST + _policy("auto"), d("A"), K, d("R_auto"), iters=N),
              dict(roundtrip_step("r_auto_nodes", DIST + _policy("auto"), d("A"), K, d("R_auto_nodes"), iters=N),
                   ranks_per_node=2)]
    # Rank 1 claims other needs than its replicas: its groups read per rank, and say why.
    steps.append(dict(roundtrip_step("r_odd", DIST, d("A"), K, d("R_odd"), iters=N), odd_digest_rank=1))
    return run_steps(4, steps, work / "w4")


def _tensor_bytes(iter_dir: Path, which=lambda name: True) -> int:
    """The checkpoint's tensor data (of the tensors `which` names): files' bytes but headers."""
    m = mf.read_manifest(str(iter_dir))
    total = 0
    for name, entry in m.tensors.items():
        layout = file_layout(entry)
        total += (layout.file_size - len(layout.header)) if which(name) else 0
    return total


def _tp_replicated(name: str) -> bool:
    """The test GPT's tensors that every TP rank holds whole (norms, row-parallel biases,
    learned position embeddings)."""
    return ("norm" in name or name.endswith(("linear_proj.bias", "linear_fc2.bias"))
            or name.startswith("embedding.position_embeddings"))


CASES = {"r_dp4": "A", "r_nodist": "A", "r_same": "R_dp4_once", "r_moe": "M", "r_bf16": "A"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_read_once_reads_the_checkpoint_once_and_loads_the_same_state(w4, work, case):
    source = work / CASES[case] / f"iter_{K:07d}"
    data = _tensor_bytes(source)
    once, per_rank = ok(w4, f"{case}_once")["per_rank"], ok(w4, f"{case}_per-rank")["per_rank"]
    assert sum(r["read"] for r in once) == data  # every byte once, nothing else
    assert sum(r["read"] for r in per_rank) == sum(r["owned"] for r in per_rank) > data  # replicas re-read
    assert all(r["exchanged"] == 0 for r in per_rank) and sum(r["exchanged"] for r in once) > 0
    assert not any(r["notes"] for r in once + per_rank)
    # Verification still hashes every byte from the load's own reads.
    assert [r["hashed_after"] for r in once] == [0] * 4
    assert_same_state(work / f"R_{case[2:]}_once" / f"iter_{K:07d}",
                      work / f"R_{case[2:]}_per-rank" / f"iter_{K:07d}")


@pytest.mark.parametrize("policy", POLICIES)
def test_losses_continue_with_either_policy(w4, policy):
    assert max_loss_delta(losses(w4, "a"), losses(w4, f"b_{policy}")) <= TOL
    assert max_loss_delta(losses(w4, "m"), losses(w4, f"b_moe_{policy}")) <= MOE_TOL


def test_both_policies_resume_identically(w4):
    assert losses(w4, "b_once") == losses(w4, "b_per-rank")
    assert losses(w4, "b_moe_once") == losses(w4, "b_moe_per-rank")


def test_members_that_need_other_bytes_fall_back_to_per_rank_reads(w4, work):
    per_rank = ok(w4, "r_odd")["per_rank"]
    notes = {n for r in per_rank for n in r["notes"]}
    assert any("ranks [1]" in n and "[0, 1, 2, 3]" in n for n in notes), notes
    assert all(r["exchanged"] == 0 for r in per_rank)  # the dense group read per rank
    assert_same_state(work / "R_odd" / f"iter_{K:07d}", work / "R_dp4_once" / f"iter_{K:07d}")


@pytest.mark.parametrize("fault,words", [("flip", ["IntegrityError", "block"]), ("cut", ["IntegrityError", "truncated"])])
@pytest.mark.parametrize("where,tensor", [("", TENSOR), ("tied_", TIED_TENSOR)])
def test_a_fault_in_a_share_is_an_error_on_every_rank(w4, fault, words, where, tensor):
    """A fault in bytes one rank reads (a replica's share; the tied tensor, which only the first
    stage reads) is raised on every rank: none waits in an exchange."""
    raised = ok(w4, f"load_{where}{fault}").get("raised")
    assert raised is not None and len(raised) == 4, ok(w4, f"load_{where}{fault}")
    for message in raised:
        for word in words + [f"{tensor}.safetensors"]:
            assert word in message, message


def test_auto_reads_once_only_where_a_replica_group_spans_nodes(w4, work):
    one_node, two_nodes = ok(w4, "r_auto")["per_rank"], ok(w4, "r_auto_nodes")["per_rank"]
    assert [r["read"] for r in one_node] == [r["read"] for r in ok(w4, "r_dp4_per-rank")["per_rank"]]
    assert all(r["exchanged"] == 0 for r in one_node)
    assert [r["read"] for r in two_nodes] == [r["read"] for r in ok(w4, "r_dp4_once")["per_rank"]]
    assert sum(r["read"] for r in two_nodes) == _tensor_bytes(work / "A" / f"iter_{K:07d}")
    for name in ("R_auto", "R_auto_nodes"):
        assert_same_state(work / name / f"iter_{K:07d}", work / "R_dp4_once" / f"iter_{K:07d}")


def test_tp_replicated_tensors_are_read_once(w4, work):
    """Tensors every TP rank holds whole are read once per job too (their replica group is
    data x tensor parallel), and the state is the per-rank policy's."""
    source = work / "A" / f"iter_{K:07d}"
    data = _tensor_bytes(source)
    assert _tensor_bytes(source, _tp_replicated) > 0
    for case in ("r_tp2dp2", "r_tp2dp2_nodist"):  # moments: tensor parallel / data x tensor parallel
        tp2 = ok(w4, case)["per_rank"]
        assert sum(r["read"] for r in tp2) == data and not any(r["notes"] for r in tp2), case
    assert_same_state(work / "R_tp2dp2_nodist" / f"iter_{K:07d}", work / "R_nodist_per-rank" / f"iter_{K:07d}")
    assert_same_state(work / "R_tp2dp2" / f"iter_{K:07d}", work / "R_dp4_per-rank" / f"iter_{K:07d}")


@pytest.mark.parametrize("case", sorted(TIED))
def test_the_tied_copy_comes_from_the_first_stage(w4, work, case):
    """The last stage's copy of the tied word embeddings is not read again: the first stage
    sends it (tied.py). Every byte read once, and the state the per-rank policy loads."""
    data = _tensor_bytes(work / "A" / f"iter_{K:07d}")
    per_rank = ok(w4, f"r_{case}")["per_rank"]
    assert sum(r["read"] for r in per_rank) == data and not any(r["notes"] for r in per_rank)
    assert per_rank[-1]["exchanged"] > 0  # the last stage's last rank received its copy
    assert [r["hashed_after"] for r in per_rank] == [0] * 4
    reference = "R_nodist_per-rank" if case.endswith("nodist") else "R_dp4_per-rank"
    assert_same_state(work / f"R_{case}" / f"iter_{K:07d}", work / reference / f"iter_{K:07d}")


def test_auto_sends_the_tied_copy_only_across_nodes(w4, work):
    one_node, per_rank = ok(w4, "r_pp2_auto")["per_rank"], ok(w4, "r_pp2dp2_per-rank")["per_rank"]
    assert [r["read"] for r in one_node] == [r["read"] for r in per_rank]
    assert all(r["exchanged"] == 0 for r in one_node)
    two_nodes = ok(w4, "r_pp2_auto_nodes")["per_rank"]  # stages on two nodes, each DP group on one
    tied = _tensor_bytes(work / "A" / f"iter_{K:07d}", lambda n: n == TIED_TENSOR)
    # Per rank, each of the 4 ranks reads the tied weights, each stage's 2 the moments once
    # between them: 4 + 2 * 2 thirds of its file (weights, two moments). Sent, once: 3 thirds.
    assert sum(r["read"] for r in two_nodes) == sum(r["read"] for r in per_rank) - tied * (8 - 3) // 3
    assert all(r["exchanged"] > 0 for r in two_nodes[2:])
    for name in ("R_pp2_auto", "R_pp2_nodes"):
        assert_same_state(work / name / f"iter_{K:07d}", work / "R_pp2_pr" / f"iter_{K:07d}")


def _member(rank, held, dp=(0, 2)):
    from megatron_ucp.engine.tied import Held, Member

    return Member(rank, dp[0], dp[1], {name: Held(*h) for name, h in held.items()})


def test_a_pair_exchanges_only_what_it_holds_as_writer_and_copy_alike():
    from megatron_ucp.engine.tied import tied_names

    emb, out = "embedding.word_embeddings.weight", "output_layer.weight"
    first = _member(0, {emb: ("boxes", True, (0, 8)), "decoder.layers.0.x": ("b", True, None)})
    last = _member(2, {emb: ("boxes", False, (4, 16)), out + "x": ("b", True, None)})
    assert tied_names([first, last]) == ([emb], None)
    assert tied_names([last, first]) == ([emb], None)
    assert tied_names([first, _member(2, {out: ("b", True, None)})]) == ([], None)  # untied
    assert tied_names([first]) == ([], None)  # no pipeline parallelism
    names, why = tied_names([first, _member(2, {emb: ("other boxes", False, None)})])
    assert names == [] and "other parts" in why and "ranks 0 and 2" in why
    names, why = tied_names([_member(0, {}), last])
    assert names == [] and "writer and copy" in why
    names, why = tied_names([first, _member(2, {emb: ("boxes", False, None)}, dp=(1, 2))])
    assert names == [] and "members 0 and 1" in why


def _partition(cuts, total):
    bounds = [0] + sorted(cuts) + [total]
    return [(bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1)]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.lists(st.integers(0, 200), max_size=6), st.lists(st.integers(0, 200), max_size=6))
def test_each_moment_element_of_the_copies_comes_once_from_the_fragment_that_holds_it(total, a, b):
    from megatron_ucp.engine.tied import moment_transfers

    sources = [(10 + k, lo, hi) for k, (lo, hi) in enumerate(_partition([min(c, total) for c in a], total))]
    sinks = [(20 + k, lo, hi) for k, (lo, hi) in enumerate(_partition([min(c, total) for c in b], total))]
    transfers = moment_transfers(sources, sinks)
    for dst, lo, hi in sinks:
        mine = sorted((start, stop, src) for src, d, start, stop in transfers if d == dst)
        assert [(s, e) for s, e, _ in mine] == [(s, e) for s, e, _ in mine if s < e]
        pos = lo
        for start, stop, src in mine:  # they tile the sink's range, each from the source holding it
            assert start == pos and any(r == src and a <= start and stop <= b for r, a, b in sources)
            pos = stop
        assert pos == hi
    with pytest.raises(LayoutError):
        moment_transfers([(0, 0, 5)], [(1, 3, 8)])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 3)), max_size=40), st.integers(1, 100),
       st.integers(1, 400))
def test_small_shares_travel_in_batches_of_their_reader(raw, small, limit):
    """Each share is broadcast once; one over `small` bytes alone; the small ones of a reader
    in item order, batches within `limit` unless one share is more, in the order of their first item."""
    from megatron_ucp.engine.replicas import batches

    sizes, readers = [n for n, _ in raw], [r for _, r in raw]
    out = batches(sizes, readers, small, limit)
    assert sorted(k for b in out for k in b) == list(range(len(raw)))
    assert [b[0] for b in out] == sorted(b[0] for b in out)
    for b in out:
        assert b == sorted(b) and len({readers[k] for k in b}) == 1
        assert len(b) == 1 or (all(sizes[k] <= small for k in b) and sum(sizes[k] for k in b) <= limit)
    for reader in set(readers):  # a reader's small shares: each batch full up to the next one's first
        mine = [b for b in out if readers[b[0]] == reader and sizes[b[0]] <= small]
        for b, nxt in zip(mine, mine[1:]):
            assert sum(sizes[k] for k in b) + sizes[nxt[0]] > limit
    assert batches(sizes, readers, small, limit) == out  # what every member computes alike
    assert batches([2, 2, 2, 5, 2], [0, 0, 0, 0, 1], 4, 4) == [[0, 1], [2], [3], [4]]  # full at the limit


def test_both_ends_of_a_transfer_plan_it_alike():
    from types import SimpleNamespace

    from megatron_ucp.engine.tied import plan_transfers

    emb = "embedding.word_embeddings.weight"
    pairs = [((0, {emb: (0, 6)}), (4, {emb: (0, 10)})), ((1, {emb: (6, 12)}), (5, {emb: (10, 12)}))]
    tensors = [SimpleNamespace(name="x"), SimpleNamespace(name=emb)]
    sends = plan_transfers([emb], pairs, tensors, 1)
    receives = plan_transfers([emb], pairs, tensors, 4)
    assert sends == [(4, True, 1, "exp_avg", 6, 10), (4, True, 1, "exp_avg_sq", 6, 10),
                     (5, True, 1, "exp_avg", 10, 12), (5, True, 1, "exp_avg_sq", 10, 12)]
    assert receives == [(0, False, 1, "exp_avg", 0, 6), (0, False, 1, "exp_avg_sq", 0, 6),
                        (1, False, 1, "exp_avg", 6, 10), (1, False, 1, "exp_avg_sq", 6, 10)]
    assert [(s, a, b) for p, _, _, s, a, b in receives if p == 1] == \
        [(s, a, b) for p, _, _, s, a, b in sends if p == 4]  # rank 1 -> 4, posted in one order


def test_replica_class_follows_what_each_rank_holds():
    from types import SimpleNamespace

    from megatron_ucp.engine.reads import replica_class
    from megatron_ucp.format.layout import Box

    def t(boxes, shape=(8, 4), padded_rows=None, expert=False):
        return SimpleNamespace(boxes=tuple(boxes), atomic_shape=shape, padded_rows=padded_rows, expert=expert)

    whole, half = [Box(0, (0, 0), (8, 4))], [Box(0, (4, 0), (4, 4))]
    for dist_opt in (False, True):
        assert replica_class(t(whole), "param", 2, dist_opt) == "tensor+data"  # a norm, TP2
        assert replica_class(t(whole), "param", 1, dist_opt) == "data"  # no tensor parallelism
        assert replica_class(t(half), "param", 2, dist_opt) == "data"  # a TP rank's half rows
        assert replica_class(t([Box(0, (0, 0), (8, 2)), Box(16, (0, 2), (8, 2))]), "param", 2, dist_opt) == "data"
        assert replica_class(t(whole, padded_rows=16), "param", 2, dist_opt) == "data"  # vocabulary rows
        assert replica_class(t(whole, expert=True), "param", 2, dist_opt) == "expert"
        assert replica_class(t([Box(0, (0,), (8,))], shape=(8,)), "param", 4, dist_opt) == "tensor+data"
    # Moments: as the weights without the distributed optimizer; with it, each data-parallel
    # rank's own fragment, which the TP ranks of a tensor held whole share.
    assert replica_class(t(whole), "exp_avg", 2, False) == "tensor+data"
    assert replica_class(t(whole), "exp_avg_sq", 2, True) == "tensor"
    assert replica_class(t(whole), "exp_avg", 1, True) is None
    assert replica_class(t(half), "exp_avg", 2, True) is None
    assert replica_class(t(half), "exp_avg", 2, False) == "data"
    assert replica_class(t(whole, expert=True), "exp_avg", 2, True) is None
    assert replica_class(t(whole, expert=True), "exp_avg", 2, False) == "expert"
