"""Save and load planning at scale, simulated: no processes, no tensors.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py [--quick] [--json OUT]

For real model shapes and rank counts, every rank's tensors come from the model's shape and the
layout (megatron_ucp/mcore/model_shapes.py, checked against model_map on small real models by
tests/test_model_shapes.py); each rank's offers from plan.offer_items and its manifest entries
from save._tensor_entries, as the real save makes them. The plan is then built with the real
save's planner (plan.route_offers -> plan.plan_owned on each owner -> plan.finish_plan, rank 0's
plan.file_creators): the three all-to-all exchanges of save._plan are made here by handing each
pickled payload to its destination. Every rank of the world is simulated (no representative
classes), each step timed on the rank that runs it.

The load of that checkpoint on the same layout (strict, verified, read policy "once") is then
planned on every rank with the real load's own functions, its four all-to-alls made the same
way: the manifest's names each rank owns (planner.names_by_owner) and the files' checkers
(verify.file_checkers); the strict check (names_by_owner of the rank's tensors to their owners,
planner.unclaimed on each owner); the read plan (reads.replica_needs, per replica group the
agreed order, digest and fingerprints of replicas.agreed_split, replicas.split_needs,
reads.take_shares); the hash plan (verify.read_spans and route_spans to the files' owners,
verify.plan_owned_hashes on each owner, collect_hash_plan); after the load, each rank's hashes
to the files' checkers (verify.route_hashes) and each checker's blocks combined
(verify.hash_problems: recorded sums and hashed pieces are all zero, which crc32_combine keeps
zero, so the combining is the real work and finds nothing). The replica groups' agreement is
one all-reduce of replicas.AGREEMENT_BYTES; collective.agree (one int64 a call) is not counted.
Reported per layout:

- plan s/rank (save), load s/rank: the most any rank spends planning (its payloads pickled, the
  owner work for the tensors or files it owns, its replies unpickled; for the save rank 0's file
  assignment): the eight slowest ranks of the pass, rank 0 and the rank that exchanges the
  most timed again alone, best of three (the first pass's maximum and the median are printed
  too);
- peak MiB/rank: tracemalloc peak of that work on the slowest rank, the rank exchanging the
  most and rank 0 (the load's without the manifest, whose size is its own figure);
- meta MiB/rank: bytes a rank sends plus receives over the exchanges (pickled payloads, plus
  the all-to-all's one length per rank each way), the most of any rank;
- written max/mean: bytes each rank writes (fp32 master weight and two Adam moments);
- files, their sizes, the manifest's size and its parse time (json.loads, best of three);
- read/ckpt: bytes read from storage per checkpoint byte by the load: with the read policy
  "per-rank" (each rank reads its whole TP-local weights and its fragment's moments:
  reads.ranges), and with "once" (the simulated load's read plan: what each replica group
  shares, reads.replica_class, read once and split over its members).

and, per model, each figure's growth exponent from the smallest to the largest world (a
least-squares fit of log(figure) over log(ranks); 1.0 is linear). With --baseline the old
planner (every rank gathers every rank's offers and entries and plans the world) is timed on
the smallest world for comparison.
"""

import argparse
import dataclasses
import gc
import json
import math
import os
import pickle
import random
import sys
import time
import tracemalloc
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ucp.engine import plan as pl, planner  # noqa: E402
from megatron_ucp.engine import read_plan, replicas, verify  # noqa: E402
from megatron_ucp.engine import reads as load_reads  # noqa: E402
from megatron_ucp.format import checksums  # noqa: E402
from megatron_ucp.format.manifest import Manifest  # noqa: E402
from megatron_ucp.format.tensor_entry import STATES, file_layout  # noqa: E402
from megatron_ucp.mcore.model_shapes import MLA, ModelShape, Parallel, buffers, coord, registered, shard  # noqa: E402
from megatron_ucp.engine.save import _tensor_entries  # noqa: E402

LLAMA3_70B = ModelShape(num_layers=80, hidden=8192, ffn=28672, heads=64, kv_groups=8, vocab=128256,
                        kv_channels=128, make_vocab_size_divisible_by=128)
# DeepSeek-V3: 3 dense layers then 58 MoE layers (256 routed experts of 2048, one shared of 2048),
# MLA attention, 128 heads; the router's aux-loss-free expert bias. (The MTP layer is left out.)
DEEPSEEK_V3 = ModelShape(num_layers=61, hidden=7168, ffn=18432, heads=128, kv_groups=128, vocab=129280,
                         make_vocab_size_divisible_by=128, num_experts=256, moe_ffn=2048, shared_expert_ffn=2048,
                         moe_layers=(0,) * 3 + (1,) * 58, expert_bias=True,
                         mla=MLA(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
                                 v_head_dim=128))
# 61 layers over 16 stages: the first (with the embedding and the 3 dense layers) and the last
# (with the output layer) hold fewer.
DEEPSEEK_STAGES = (3,) + (4,) * 14 + (2,)

CASES = {
    "llama3-70b TP8xPP8": (LLAMA3_70B, [Parallel(tp=8, pp=8, dp=dp) for dp in (16, 64, 256)]),
    "deepseek-v3 EP64xPP16": (DEEPSEEK_V3, [Parallel(tp=1, pp=16, dp=dp, ep=64, stage_layers=DEEPSEEK_STAGES)
                                            for dp in (64, 256, 1024)]),
}


class Clock:
    """Seconds per rank, accumulated over the steps each rank runs."""

    def __init__(self, world):
        self.s = np.zeros(world)

    def run(self, rank, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.s[rank] += time.perf_counter() - start
        return out


def rank_inputs(shape, par):
    """rank -> (tensors it offers from, its entries): tensors of each (TP, PP, expert) class
    built once, each rank's distributed-optimizer share cut from its class's buffers."""
    classes = {}
    for rank in range(par.world):
        c = coord(par, rank)
        key = (c.tp, c.pp, c.etp, c.ep)
        if key not in classes:
            tensors = registered(shape, par, c)
            classes[key] = (tensors, buffers(tensors, shape, par), _tensor_entries(tensors, STATES))
        tensors, bufs, entries = classes[key]
        mine = [t for t in tensors if t.stateless]
        load = list(tensors)  # what the load fills: every tensor, with its fragment
        for buf in bufs:
            for i, f in shard(buf, c.edp if buf[4] else c.dp):
                load[i] = dataclasses.replace(tensors[i], fragment=f)
                mine.append(load[i])
        yield rank, c, mine, entries, tensors, load


def deliver(sent, clock, sizes, world, keep=False):
    """Payloads (source -> {dest: object}) pickled by their sender, unpickled by their receiver,
    both timed; bytes counted both ways (plus one length per rank each way). With `keep`, the
    pickled payloads are returned (dest -> {source: bytes}) for the receiver to unpickle."""
    inbox = defaultdict(dict)
    for source, payloads in sent.items():
        for dest, obj in payloads.items():
            blob = clock.run(source, pickle.dumps, obj, pickle.HIGHEST_PROTOCOL)
            sizes[source] += len(blob)
            sizes[dest] += len(blob)
            inbox[dest][source] = blob
    sizes += 2 * 8 * world
    if keep:
        for dest, got in inbox.items():
            for blob in got.values():
                clock.run(dest, pickle.loads, blob)  # charged now; unpickled again by the caller
        return inbox
    return {dest: {src: clock.run(dest, pickle.loads, blob) for src, blob in got.items()}
            for dest, got in inbox.items()}


def simulate(shape, par, peaks=True):
    """One layout's figures (see the module docstring)."""
    # The simulator holds every rank's objects at once: a cyclic collection triggered inside one
    # rank's step would scan all of them and be charged to that rank. A real rank holds its own.
    gc.collect()
    gc.disable()
    try:
        return _simulate(shape, par, peaks)
    finally:
        gc.enable()


def _simulate(shape, par, peaks):
    world = par.world
    clock, meta = Clock(world), np.zeros(world)
    routed, holds, loads, groups = {}, {}, {}, defaultdict(list)
    for rank, c, mine, entries, tensors, load in rank_inputs(shape, par):
        offers = clock.run(rank, lambda: [i for i, _, _ in pl.offer_items(mine, len(STATES), True, lambda t: t.numel)])
        routed[rank] = clock.run(rank, planner.route_offers, offers, entries, world)
        holds[rank] = (mine, entries)
        loads[rank] = load
        # The replica groups (replicas.replica_group): the data-parallel group of (TP, PP), the
        # tensor-and-data-parallel group of PP, the tensor-parallel group of (PP, DP) and the
        # expert data-parallel group of (PP, expert TP, EP).
        groups[("data", c.tp, c.pp)].append(rank)
        groups[("tensor+data", c.pp)].append(rank)
        groups[("tensor", c.pp, c.dp)].append(rank)
        groups[("expert", c.pp, c.etp, c.ep)].append(rank)
    at_owner = deliver(routed, clock, meta, world, keep=True)
    del routed
    inbox = {owner: {src: pickle.loads(b) for src, b in got.items()} for owner, got in at_owner.items()}
    replies = {owner: clock.run(owner, planner.plan_owned, received, world) for owner, received in inbox.items()}
    del inbox
    back = deliver(replies, clock, meta, world, keep=True)
    del replies
    plans = {r: clock.run(r, planner.finish_plan, {src: pickle.loads(b) for src, b in back.get(r, {}).items()})
             for r in range(world)}
    errors = plans[0].errors
    if errors:
        raise SystemExit(f"plan failed: {errors[:3]}")
    entries = plans[0].entries
    sizes = {n: file_layout(e).file_size for n, e in entries.items()}
    creators = clock.run(0, planner.file_creators, entries, sizes, world)
    deliver({0: creators}, clock, meta, world)
    inputs = (world, holds, at_owner, back, sizes)
    slowest = [int(r) for r in np.argsort(-clock.s)[:8]]
    # Rank 0 (every entry, the file assignment) and the rank that exchanges the most are timed
    # again whatever the first pass said: a noisy pass may not rank them among the slowest.
    picks = {slowest[0], int(np.argmax(meta)), 0}
    again = retimed(sorted(set(slowest) | picks), *inputs)
    peak = peak_memory(picks, *inputs) if peaks else float("nan")
    written = np.array([sum(i.nbytes for i in plans[r].items) for r in range(world)], dtype=np.float64)
    data = sum(4 * (e.shape[0] + e.padding_rows) * math.prod(e.shape[1:]) * len(e.states)
               for e in entries.values())  # the vocabulary's padding rows are saved too
    assert abs(written.sum() - data) < 1, (written.sum(), data)  # every element once (owners checked coverage)
    manifest_bytes, parse_s = manifest_figures(entries, sizes)
    file_sizes = np.array(sorted(sizes.values()), dtype=np.float64)
    del plans, back, at_owner, holds
    loaded = simulate_load(par, loads, groups, entries, sizes, data, peaks)
    return {
        "ranks": world, "plan_s": max(again.values()), "plan_s_first_pass": float(clock.s.max()),
        "plan_s_median": float(np.median(clock.s)),
        "peak_mib": peak, "meta_mib": float(meta.max() / 2**20), "meta_mib_median": float(np.median(meta) / 2**20),
        "written_max_mean": float(written.max() / written.mean()), "files": len(sizes),
        "file_mib": {q: float(np.percentile(file_sizes, p) / 2**20) for q, p in
                     (("min", 0), ("p50", 50), ("p90", 90), ("max", 100))},
        "checkpoint_gib": float(data / 2**30), "manifest_mib": manifest_bytes / 2**20, "manifest_parse_s": parse_s,
        **loaded,
    }


def sim_manifest(entries, sizes):
    """The manifest's tensor entries as the load reads them. Every block's recorded crc32 and
    every hashed piece's are 0 (crc32_combine of zeros is zero): the checkers combine pieces
    as they would real sums, and find no problem."""
    tensors = {}
    for name, e in entries.items():
        base = len(file_layout(e).header)
        blocks = -(-(sizes[name] - base) // checksums.BLOCK_BYTES)
        tensors[name] = e.written(sizes[name], checksums.BLOCK_BYTES, ["00000000"] * blocks)
    return Manifest(iteration=0, consumed_samples=0, architecture={}, layout={}, optimizer=None, scheduler=None,
                    args={}, tensors=tensors)


def sim_numel(t):
    return t.numel


def load_read_plan(tensors, member, tp, digests=None):
    """reads.read_plan on one simulated rank, policy "once" (the groups span nodes): its
    replica needs, and per replica class (replicas.CLASSES) replicas.agreed_split's pure steps
    (the agreed order, the digest and the fingerprints the group all-reduces, the split), taken
    into its plan by reads.take_shares. `member`: class -> (the group's ranks, this rank's
    index); `digests`: group -> the members' digests (the caller checks that they agree, as the
    all-reduce does)."""
    reads, needs = load_reads.replica_needs(tensors, "once", True, tp, sim_numel)
    plan = load_reads.ReadPlan(reads, [], [])
    for kind in replicas.CLASSES:
        if kind.startswith("tensor") and tp == 1:
            continue  # as read_plan: no tensor-parallel replicas
        ranks, me = member[kind]
        pairs = needs[kind]
        shares = None
        if len(ranks) > 1:
            agreed = read_plan.order([n for n, _ in pairs])
            mine = replicas.digest([pairs[i][0] for i in agreed])
            replicas.fingerprints([mine, "host"])
            if digests is not None:
                digests[(kind, ranks[0])].add(mine)
            shares = replicas.split_needs([n for n, _ in pairs], len(ranks), agreed)
        load_reads.take_shares(plan, pairs, shares, None, ranks, None, me, lambda *a: False)
    return plan


def sim_hashes(hp):
    """What a rank hashed during and after the load (verify.check_hashes' `hashes`): each
    inline piece and each piece after, with crc 0 (sim_manifest)."""
    out = {}
    for name, pieces in hp.inline.items():
        out.setdefault(name, []).extend((lo, hi, 0) for lo, hi in pieces)
    for name, lo, hi in hp.after:
        out.setdefault(name, []).append((lo, hi, 0))
    return out


def route_sim_hashes(hp):
    return verify.route_hashes(sim_hashes(hp), hp.checker)


def no_problems(m, layouts, hp, received):
    problems = verify.hash_problems(m, layouts, hp.checks, received, lambda e: e.file)
    if problems:
        raise SystemExit(f"simulated load failed verification: {problems[:3]}")


def simulate_load(par, loads, groups, entries, sizes, data, peaks):
    """The load's planning on every rank of the world (the module docstring): a strict,
    verified load, read policy "once"."""
    world = par.world
    clock, meta = Clock(world), np.zeros(world)
    m = sim_manifest(entries, sizes)
    member = defaultdict(dict)
    for (kind, *_), ranks in groups.items():
        for me, rank in enumerate(ranks):
            member[rank][kind] = (ranks, me)
    # What every rank computes alike from the manifest (the names it owns, the files' checkers):
    # computed once here, its time charged to every rank.
    start = time.perf_counter()
    by_owner = planner.names_by_owner(m.tensors, world)
    checkers = verify.file_checkers(m.tensors, world)
    clock.s += time.perf_counter() - start
    # The strict check: each rank's names to their owners, each owner's unclaimed names.
    strict_in = deliver({r: clock.run(r, planner.names_by_owner, {t.name for t in loads[r]}, world)
                         for r in range(world)}, clock, meta, world, keep=True)
    for r in range(world):
        told = [pickle.loads(b) for b in strict_in.get(r, {}).values()]
        if clock.run(r, planner.unclaimed, by_owner.get(r, []), told):
            raise SystemExit("simulated strict load: checkpoint tensors claimed by no rank")
    # The read plan, then each rank's read spans to the files' owners.
    digests = defaultdict(set)
    spans, read_once = {}, 0
    for r in range(world):
        plan = clock.run(r, load_read_plan, loads[r], member[r], par.tp, digests)
        read_once += 4 * sum(stop - start for reads in plan.reads for _, start, stop, _ in reads)
        spans[r] = clock.run(r, lambda: verify.route_spans(
            verify.read_spans(m, verify.Layouts(m.tensors), loads[r], plan), world))
        meta[r] += sum(replicas.AGREEMENT_BYTES for kind, (ranks, _) in member[r].items()
                       if len(ranks) > 1 and not (kind.startswith("tensor") and par.tp == 1))
    if any(len(d) != 1 for d in digests.values()):
        raise SystemExit("simulated load: replicas disagree on their needs")
    spans_in = deliver(spans, clock, meta, world, keep=True)
    del spans
    replies = {r: clock.run(r, lambda: verify.plan_owned_hashes(
        m, verify.Layouts(m.tensors), by_owner.get(r, []), {src: pickle.loads(b) for src, b in got.items()},
        world, r)) for r, got in spans_in.items()}
    replies_in = deliver(replies, clock, meta, world, keep=True)
    del replies
    # After the load: each file's hashes to its checker, each checker's blocks combined.
    hash_plans, hashes = {}, {}
    for r in range(world):
        got = {src: pickle.loads(b) for src, b in replies_in.get(r, {}).items()}
        hp = hash_plans[r] = clock.run(r, verify.collect_hash_plan, got, checkers, r)
        hashes[r] = clock.run(r, route_sim_hashes, hp)
    hashes_in = deliver(hashes, clock, meta, world, keep=True)
    del hashes
    for r in range(world):
        received = {src: pickle.loads(b) for src, b in hashes_in.get(r, {}).items()}
        clock.run(r, no_problems, m, verify.Layouts(m.tensors), hash_plans[r], received)
    del hash_plans
    read_per_rank = 4 * sum(stop - start for r in range(world) for t in loads[r]
                            for _, start, stop in load_reads.ranges(t, sim_numel))
    inputs = (world, par.tp, m, loads, member, strict_in, spans_in, replies_in, hashes_in)
    slowest = [int(r) for r in np.argsort(-clock.s)[:8]]
    picks = {slowest[0], int(np.argmax(meta)), 0}
    again = retimed(sorted(set(slowest) | picks), *inputs, work=load_rank_work)
    peak = peak_memory(picks, *inputs, work=load_rank_work) if peaks else float("nan")
    return {"load_s": max(again.values()), "load_s_first_pass": float(clock.s.max()),
            "load_s_median": float(np.median(clock.s)), "load_peak_mib": peak,
            "load_meta_mib": float(meta.max() / 2**20), "load_meta_mib_median": float(np.median(meta) / 2**20),
            "read_per_byte_today": read_per_rank / data, "read_per_byte_once": read_once / data}


def load_rank_work(rank, world, tp, m, loads, member, strict_in, spans_in, replies_in, hashes_in):
    """Everything rank `rank` does to plan a strict, verified load, from its inputs, as the real
    load does it (load.load_universal, reads.read_plan, verify.hash_plan, verify.check_hashes):
    the manifest's names it owns and the files' checkers, its names to their owners, the owner
    check, its read plan, its spans to the files' owners, the hashing of the files it owns, its
    hash plan, its hashes to their checkers, the blocks of its files combined."""
    tensors = loads[rank]
    owned = planner.names_by_owner(m.tensors, world).get(rank, [])
    checkers = verify.file_checkers(m.tensors, world)
    layouts = verify.Layouts(m.tensors)
    send(planner.names_by_owner({t.name for t in tensors}, world))
    planner.unclaimed(owned, [pickle.loads(b) for b in strict_in.get(rank, {}).values()])
    plan = load_read_plan(tensors, member[rank], tp)
    send(verify.route_spans(verify.read_spans(m, layouts, tensors, plan), world))
    told = {src: pickle.loads(b) for src, b in spans_in.get(rank, {}).items()}
    send(verify.plan_owned_hashes(m, layouts, owned, told, world, rank))
    hp = verify.collect_hash_plan({src: pickle.loads(b) for src, b in replies_in.get(rank, {}).items()},
                                  checkers, rank)
    send(route_sim_hashes(hp))
    no_problems(m, layouts, hp, {src: pickle.loads(b) for src, b in hashes_in.get(rank, {}).items()})


def send(payloads):
    """Each payload pickled, as exchange_objects does."""
    for obj in payloads.values():
        pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)


def rank_work(rank, world, holds, at_owner, back, sizes):
    """Everything rank `rank` does to plan, from its inputs: its offers routed and pickled, the
    owner work for the tensors it owns (its inbox unpickled, its replies pickled), its own
    replies unpickled into its plan; on rank 0 the file assignment."""
    mine, rank_entries = holds[rank]
    offers = [i for i, _, _ in pl.offer_items(mine, len(STATES), True, lambda t: t.numel)]
    pickle.dumps(planner.route_offers(offers, rank_entries, world), pickle.HIGHEST_PROTOCOL)
    received = {src: pickle.loads(blob) for src, blob in at_owner.get(rank, {}).items()}
    pickle.dumps(planner.plan_owned(received, world), pickle.HIGHEST_PROTOCOL)
    plan = planner.finish_plan({src: pickle.loads(blob) for src, blob in back.get(rank, {}).items()})
    if rank == 0:
        pickle.dumps(planner.file_creators(plan.entries, sizes, world), pickle.HIGHEST_PROTOCOL)


def retimed(ranks, *inputs, repeats=3, work=None):
    """The slowest ranks' planning timed again, alone (best of `repeats`): a single pass on a
    shared machine charges other processes' time slices to whichever rank was running."""
    work = work or rank_work
    out = {}
    for rank in ranks:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            work(rank, *inputs)
            best = min(best, time.perf_counter() - start)
        out[rank] = best
    return out


def peak_memory(ranks, *inputs, work=None):
    """tracemalloc peak of rank_work (or `work`), the most over `ranks`."""
    work = work or rank_work
    out = 0
    for rank in ranks:
        gc.collect()
        tracemalloc.start()
        work(rank, *inputs)
        out = max(out, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    return out / 2**20


def manifest_figures(entries, sizes):
    """Size of the manifest's tensor entries with their block checksums, and json.loads time."""
    rng = random.Random(0)
    tensors = {}
    for name, e in entries.items():
        blocks = -(-sizes[name] // (4 * 2**20))
        tensors[name] = e.written(sizes[name], 4 * 2**20, [rng.getrandbits(32) for _ in range(blocks)]).to_json()
    text = json.dumps({"tensors": tensors}, indent=1, sort_keys=True)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        json.loads(text)
        best = min(best, time.perf_counter() - start)
    return len(text.encode()), best


def baseline(shape, par):
    """The old planner on one rank: every rank's offers and entries gathered, the whole plan."""
    gathered, bytes_in = [], 0
    for rank, c, mine, entries, _, _ in rank_inputs(shape, par):
        offers = [i for i, _, _ in pl.offer_items(mine, len(STATES), True, lambda t: t.numel)]
        gathered.append((offers, entries))
    bytes_in = sum(len(pickle.dumps(g, pickle.HIGHEST_PROTOCOL)) for g in gathered)
    blobs = [pickle.dumps(g, pickle.HIGHEST_PROTOCOL) for g in gathered]
    del gathered
    gc.collect()
    tracemalloc.start()
    start = time.perf_counter()
    got = [pickle.loads(b) for b in blobs]
    merged = {}
    for _, e in got:
        merged.update(e)
    part_shapes = planner.part_shapes_of(merged)
    offers, sets, _ = pl.merge_rows([o for o, _ in got], part_shapes)
    plan = pl.assign_writers(offers)
    pl.row_merges(plan, sets)
    pl.check_coverage(part_shapes, plan)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"ranks": par.world, "plan_s": seconds, "peak_mib": peak / 2**20, "meta_mib": bytes_in / 2**20}


def exponent(xs, ys):
    """Slope of log(y) over log(x): how a figure grows with the world (1.0: linearly)."""
    xs, ys = np.log(np.asarray(xs, float)), np.asarray(ys, float)
    if np.any(ys <= 0):
        return float("nan")
    return float(np.polyfit(xs, np.log(ys), 1)[0])


FIGURES = [("plan_s", "plan s/rank", "{:.3f}"), ("peak_mib", "peak MiB/rank", "{:.1f}"),
           ("meta_mib", "meta MiB/rank", "{:.3f}"), ("written_max_mean", "written max/mean", "{:.3f}"),
           ("files", "files", "{}"), ("manifest_mib", "manifest MiB", "{:.1f}"),
           ("manifest_parse_s", "manifest parse s", "{:.3f}"), ("load_s", "load plan s/rank", "{:.3f}"),
           ("load_peak_mib", "load peak MiB/rank", "{:.1f}"), ("load_meta_mib", "load meta MiB/rank", "{:.3f}"),
           ("read_per_byte_today", "read/ckpt per-rank", "{:.1f}"), ("read_per_byte_once", "read/ckpt once", "{:.3f}")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the two smallest worlds of each model only")
    parser.add_argument("--baseline", action="store_true", help="time the old gather-everything planner too")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    report = {}
    for model, (shape, layouts) in CASES.items():
        rows = []
        for par in layouts[:2] if args.quick else layouts:
            start = time.perf_counter()
            row = simulate(shape, par)
            row["layout"] = f"TP{par.tp} PP{par.pp} DP{par.dp}" + (f" EP{par.ep} EDP{par.expert_dp}" if par.ep > 1 else "")
            row["simulated_s"] = time.perf_counter() - start
            rows.append(row)
            print(f"{model} {row['layout']}: {row['ranks']} ranks simulated in {row['simulated_s']:.0f} s", flush=True)
        if args.baseline:
            report.setdefault("baseline", {})[model] = baseline(shape, layouts[0])
        report[model] = rows
        print(f"\n{model} (every rank simulated; distributed optimizer; fp32 weight + 2 Adam moments)")
        print(f"{'figure':<20}" + "".join(f"{r['ranks']:>12}" for r in rows) + f"{'exponent':>10}")
        for key, label, fmt in FIGURES:
            values = [r[key] for r in rows]
            print(f"{label:<20}" + "".join(f"{fmt.format(v):>12}" for v in values)
                  + f"{exponent([r['ranks'] for r in rows], values):>10.2f}")
        r = rows[-1]
        print(f"{'file MiB min/p50/p90/max':<20} " + "/".join(f"{r['file_mib'][q]:.1f}" for q in ("min", "p50", "p90", "max"))
              + f" (largest world; checkpoint {r['checkpoint_gib']:.0f} GiB)")
        print(f"{'plan s, 1st pass max':<20}" + "".join(f"{x['plan_s_first_pass']:>12.3f}" for x in rows))
        print(f"{'plan s/rank median':<20}" + "".join(f"{x['plan_s_median']:>12.4f}" for x in rows))
        print(f"{'meta MiB median':<20}" + "".join(f"{x['meta_mib_median']:>12.4f}" for x in rows))
        print(f"{'load s, 1st pass max':<20}" + "".join(f"{x['load_s_first_pass']:>12.3f}" for x in rows))
        print(f"{'load s/rank median':<20}" + "".join(f"{x['load_s_median']:>12.4f}" for x in rows))
        print(f"{'load meta MiB median':<20}" + "".join(f"{x['load_meta_mib_median']:>12.4f}" for x in rows))
        if args.baseline:
            b = report["baseline"][model]
            print(f"old planner at {b['ranks']} ranks (every rank): plan {b['plan_s']:.2f} s, peak {b['peak_mib']:.0f} MiB, "
                  f"gathered {b['meta_mib']:.1f} MiB")
        print(flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
