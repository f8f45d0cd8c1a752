"""Save planning at scale, simulated: no processes, no tensors.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_scale.py [--quick] [--json OUT]

For real model shapes and rank counts, every rank's tensors come from the model's shape and the
layout (megatron_ucp/mcore/model_shapes.py, checked against model_map on small real models by
tests/test_model_shapes.py); each rank's offers from plan.offer_items and its manifest entries
from save._tensor_entries, as the real save makes them. The plan is then built with the real
save's planner (plan.route_offers -> plan.plan_owned on each owner -> plan.finish_plan, rank 0's
plan.file_creators): the three all-to-all exchanges of save._plan are made here by handing each
pickled payload to its destination. Every rank of the world is simulated (no representative
classes), each step timed on the rank that runs it. Reported per layout:

- plan s/rank: the most any rank spends planning (its offers, its payloads pickled, the owner
  work for the tensors it owns, its replies unpickled; rank 0's file assignment): the eight
  slowest ranks of the pass, rank 0 and the rank that exchanges the most timed again alone,
  best of three (the first pass's maximum and the median are printed too);
- peak MiB/rank: tracemalloc peak of that work on the slowest rank, the rank receiving the most
  and rank 0;
- meta MiB/rank: bytes a rank sends plus receives over the three exchanges (pickled payloads,
  plus the all-to-all's one length per rank each way), the most of any rank;
- written max/mean: bytes each rank writes (fp32 master weight and two Adam moments);
- files, their sizes, the manifest's size and its parse time (json.loads, best of three);
- read/ckpt: bytes read from storage per checkpoint byte by a load on the same layout: with the
  read policy "per-rank" (each rank reads its whole TP-local weights and its fragment's
  moments: reads.ranges), and with "once" (read_plan.split run for each replica group's
  weights, one group per class: the groups of a class hold the same needs; the moments are
  each rank's own). Each TP rank of a TP-replicated tensor (norms) and a tied copy read it
  again: their own groups.

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

from megatron_ucp.format import manifest as mf  # noqa: E402
from megatron_ucp.engine import plan as pl, planner  # noqa: E402
from megatron_ucp.engine import read_plan  # noqa: E402
from megatron_ucp.engine.read_plan import Need  # noqa: E402
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
STATES = mf.STATES


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
        for buf in bufs:
            mine += [dataclasses.replace(tensors[i], fragment=f) for i, f in shard(buf, c.edp if buf[4] else c.dp)]
        yield rank, c, mine, entries, tensors


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
    routed, holds, param_read, moments = {}, {}, np.zeros(world), 0
    once_read, seen = 0, set()
    for rank, c, mine, entries, tensors in rank_inputs(shape, par):
        # Read once: each replica group reads its shared weights once. The data-parallel group
        # of (TP, PP) holds the dense ones, the expert data-parallel group of (PP, expert TP, EP)
        # the experts.
        for expert, key in ((False, (c.tp, c.pp)), (True, (c.pp, c.etp, c.ep))):
            if (expert, key) not in seen:
                seen.add((expert, key))
                once_read += read_once_bytes(tensors, par, expert)
        offers = clock.run(rank, lambda: [i for i, _, _ in pl.offer_items(mine, len(STATES), True, lambda t: t.numel)])
        routed[rank] = clock.run(rank, planner.route_offers, offers, entries, world)
        holds[rank] = (mine, entries)
        # Today's load reads each whole TP-local weight and the fragment's two moments.
        param_read[rank] = 4 * sum(t.numel for t in tensors)
        moments += 8 * sum(t.fragment.stop - t.fragment.start for t in mine if t.fragment is not None)
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
    sizes = {n: mf.file_layout(e).file_size for n, e in entries.items()}
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
    data = sum(4 * (e["shape"][0] + e["padding_rows"]) * math.prod(e["shape"][1:]) * len(e["states"])
               for e in entries.values())  # the vocabulary's padding rows are saved too
    assert abs(written.sum() - data) < 1, (written.sum(), data)  # every element once (owners checked coverage)
    manifest_bytes, parse_s = manifest_figures(entries, sizes)
    file_sizes = np.array(sorted(sizes.values()), dtype=np.float64)
    return {
        "ranks": world, "plan_s": max(again.values()), "plan_s_first_pass": float(clock.s.max()),
        "plan_s_median": float(np.median(clock.s)),
        "peak_mib": peak, "meta_mib": float(meta.max() / 2**20), "meta_mib_median": float(np.median(meta) / 2**20),
        "written_max_mean": float(written.max() / written.mean()), "files": len(sizes),
        "file_mib": {q: float(np.percentile(file_sizes, p) / 2**20) for q, p in
                     (("min", 0), ("p50", 50), ("p90", 90), ("max", 100))},
        "checkpoint_gib": float(data / 2**30), "manifest_mib": manifest_bytes / 2**20, "manifest_parse_s": parse_s,
        "read_per_byte_today": float((param_read.sum() + moments) / data),
        "read_per_byte_once": float((once_read + moments) / data),
    }


def read_once_bytes(tensors, par, expert: bool):
    """Storage bytes one replica group's shared weights cost under the read policy "once" (the
    data-parallel group's dense weights, or the expert data-parallel group's experts):
    read_plan.split, the load's own planner, cuts the needs into one run per member, and each
    run is read once. Moments are each rank's own under the distributed optimizer."""
    needs = [Need(t.name, "param", 0, t.numel) for t in tensors if t.expert == expert]
    if not needs:
        return 0
    needs = [needs[i] for i in read_plan.order(needs)]
    shares = read_plan.split(needs, par.expert_dp if expert else par.dp)
    return 4 * sum(sh.stop - sh.start for sh in shares)


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


def retimed(ranks, *inputs, repeats=3):
    """The slowest ranks' planning timed again, alone (best of `repeats`): a single pass on a
    shared machine charges other processes' time slices to whichever rank was running."""
    out = {}
    for rank in ranks:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            rank_work(rank, *inputs)
            best = min(best, time.perf_counter() - start)
        out[rank] = best
    return out


def peak_memory(ranks, *inputs):
    """tracemalloc peak of rank_work, the most over `ranks`."""
    out = 0
    for rank in ranks:
        gc.collect()
        tracemalloc.start()
        rank_work(rank, *inputs)
        out = max(out, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    return out / 2**20


def manifest_figures(entries, sizes):
    """Size of the manifest's tensor entries with their block checksums, and json.loads time."""
    rng = random.Random(0)
    tensors = {}
    for name, e in entries.items():
        blocks = -(-sizes[name] // (4 * 2**20))
        tensors[name] = dict(e, file_size=sizes[name], block_bytes=4 * 2**20,
                             checksums=[rng.getrandbits(32) for _ in range(blocks)])
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
    for rank, c, mine, entries, _ in rank_inputs(shape, par):
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
           ("manifest_parse_s", "manifest parse s", "{:.3f}"), ("read_per_byte_today", "read/ckpt per-rank", "{:.1f}"),
           ("read_per_byte_once", "read/ckpt once", "{:.3f}")]


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
