"""The local checkpoint tier: every N iterations each rank writes its piece of the universal
checkpoint (the regions it owns, format/local_piece.py) to its node's local dir, in the
background, and sends replicas to ranks on other nodes over a gloo group of the job, which
write them to theirs. Training waits only for the in-memory copy. Restores are
local_restore.py's.

Why a piece and not the atomic files: a node-local dir sees only its own ranks' writes, so
each node keeps whole pieces that any node can read back or send, and a restart loads them
as a universal checkpoint on any layout, in place (engine/piece_reads.py; docs/elastic.md,
"The local tier").
"""

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist

from megatron_ucp.engine import local_plan, ownership, proof
from megatron_ucp.engine.collective import all_true, on_rank_zero, run_everywhere
from megatron_ucp.engine.save import _digests, _manifest_head, _plan, _snapshot
from megatron_ucp.errors import ConfigError, SaveError
from megatron_ucp.format import local_piece
from megatron_ucp.format.tensor_entry import STATES
from megatron_ucp.mcore import rng
from megatron_ucp.mcore.model_map import local_tensors, padded_vocab
from megatron_ucp.mcore.saved_args import CHECKPOINT_ARGS

KEPT = 2  # complete local iterations kept per node
CPU = torch.device("cpu")
# The arguments that define a run beside its model (none that a restart on another layout, or
# with more iterations, changes): a tier's iterations are the run's only while they agree.
RUN_ARGS = CHECKPOINT_ARGS + ("seed", "lr", "min_lr", "lr_decay_style", "weight_decay", "clip_grad", "adam_beta1",
                              "adam_beta2", "global_batch_size", "data_path", "tokenizer_type", "fp16", "bf16")


def job_identity(args) -> dict:
    """The job a tier's records name: {"id": the id kept in the --save folder (made at the
    job's first start; read from --load on a restart without --save; None without either),
    "run": a digest of RUN_ARGS}. It survives the job's restarts (torchrun's new run ids,
    other nodes, other layouts); another job, or the same folder with other run arguments,
    gets another."""
    defining = {k: getattr(args, k, None) for k in RUN_ARGS}
    if not defining.get("group_query_attention"):
        # Megatron-LM's trainer sets num_query_groups by the layout without GQA (1 at TP1, the
        # head count at TP2: measured on 0.19.2); it defines nothing then
        defining["num_query_groups"] = None
    run = json.dumps(defining, sort_keys=True, default=str)
    if getattr(args, "save", None):
        job = local_piece.job_id(args.save, create=True)
    elif getattr(args, "load", None):
        job = local_piece.job_id(args.load, create=False)
    else:
        job = None
    return {"id": job, "run": hashlib.sha256(run.encode()).hexdigest()[:16]}


def tolerating_save_failure(args, fn) -> None:
    """fn(), a persistent save; with a local tier (and without --exit-on-save-failure) its
    SaveError (raised on every rank, nothing committed, the earlier checkpoints as they were)
    is a warning: training goes on, the local tier holds its state, the next interval saves
    again (a full or unreachable shared file system must not kill a healthy job)."""
    try:
        fn()
    except SaveError as e:
        if args is None or not getattr(args, "local_ckpt_dir", None) or args.exit_on_save_failure:
            raise
        if dist.get_rank() == 0:
            print(f" warning: persistent save failed, training goes on (the local tier holds its "
                  f"state; the next --save-interval tries again; --exit-on-save-failure stops "
                  f"instead): {e}", flush=True)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def exchange_bytes(sends, receives, group) -> dict:
    """Point-to-point transfers of byte strings: `sends` [(peer, bytes)], `receives` [peer]
    (each as often as that peer sends here, in the same order on both sides); returns
    {index in `receives`: the bytes (a memoryview of the receive buffer: no copy)}. Sizes travel
    first, then the bytes."""
    sizes = [torch.empty(1, dtype=torch.int64) for _ in receives]
    ops = [dist.P2POp(dist.isend, torch.tensor([len(b)], dtype=torch.int64), p, group) for p, b in sends]
    ops += [dist.P2POp(dist.irecv, s, p, group) for p, s in zip(receives, sizes)]
    _run(ops)
    bufs = [torch.empty(int(s.item()), dtype=torch.uint8) for s in sizes]
    with warnings.catch_warnings():  # the send buffers are only read: bytes need no writable copy
        warnings.simplefilter("ignore", UserWarning)
        ops = [dist.P2POp(dist.isend, torch.frombuffer(b, dtype=torch.uint8), p, group) for p, b in sends if len(b)]
    ops += [dist.P2POp(dist.irecv, buf, p, group) for p, buf in zip(receives, bufs) if buf.numel()]
    _run(ops)
    return {i: memoryview(buf.numpy()) for i, buf in enumerate(bufs)}


def _run(ops) -> None:
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


class LocalTier:
    """One job's local tier: its node dir, the hosts of its ranks, its own gloo group (saves
    run in a background thread beside training's collectives) and the save in flight."""

    def __init__(self, root: str, replicas: int, hosts, group, job=None):
        self.root, self.replicas, self.hosts, self.group, self.job = root, replicas, list(hosts), group, job
        self.host = socket.gethostname()
        self.node_dir = os.path.join(root, self.host)
        self.targets = local_plan.replica_targets(self.hosts, replicas)
        self.leader = local_plan.leaders(self.hosts)[self.host] == dist.get_rank()
        self.pending = None
        self.restored = None  # the local iteration this run restored (for --local-ckpt-check-loss)
        self.padded_vocab = None  # the model's padded vocabulary, recorded in each COMPLETE marker
        self.staging = {}  # the last snapshot's buffers, reused by the next (the write is done then)
        self.stall_parts = {}  # the last save's stall: seconds of the proof's probe, of the copy

    # -- saving ---------------------------------------------------------------------------------

    def save(self, args, state, iteration: int, consumed: int) -> None:
        """Copy this rank's piece into memory now (into the previous save's buffers: no page
        of it is new after the first save) and run the resume proof's probe; the proof's
        digests of the copy, the write and the replicas run in the background."""
        self.wait()
        optimizer = None if args.no_save_optim else state.optimizer
        states = STATES if optimizer is not None else ("param",)
        tensors = local_tensors(state.model, optimizer, args.vocab_size)
        plan, sources, entries, part_shapes, _ = _plan(tensors, states, optimizer is not None, merge=False)
        start = time.perf_counter()
        probed = proof.record_probe(state.model, args.vocab_size)
        dtypes = proof.source_dtypes(data for _, data in sources.values())
        copied = time.perf_counter()
        snapshot = _snapshot(plan.items, sources, states, copy=True, staging=self.staging)
        self.stall_parts = {"probe": copied - start, "copy": time.perf_counter() - copied}
        self.staging = {(key, s): chunk for key, by_state in snapshot.items() for s, chunk in by_state.items()}
        rank = dist.get_rank()
        meta = {"iteration": iteration, "rank": rank, "world": dist.get_world_size(), "job": self.job,
                "rng": None if args.no_save_rng else rng.capture()}
        head = _manifest_head(iteration, entries, state.model, optimizer,
                              None if optimizer is None else state.scheduler, args.vocab_size, consumed,
                              vars(args), not args.no_save_rng, dict(state.progress), probed) if rank == 0 else None
        items = [(i.name, i.region) for i in plan.items]
        arrays = [snapshot[i.key] for i in plan.items]
        proved = lambda: (_digests(plan.items, snapshot, part_shapes), dtypes)  # noqa: E731
        self.pending = _Background(lambda: self._write(iteration, items, arrays, meta, head, proved))

    def _write(self, iteration, items, arrays, meta, head=None, proved=None) -> bool:
        """Background: the proof's digests summed over the ranks into rank 0's manifest head,
        the piece to this node's dir, replicas to and from other nodes, then the node's
        COMPLETE marker once every rank wrote everything. Returns whether it did."""
        rank, world = dist.get_rank(), dist.get_world_size()
        if proved is not None:
            try:
                mine = proved()
            except Exception as e:  # told to every rank: none is left waiting in the gather
                mine = f"{type(e).__name__}: {e}"
            parts = [None] * world
            dist.all_gather_object(parts, mine, group=self.group)
            failed = next((p for p in parts if isinstance(p, str)), None)
            if failed:
                raise SaveError(f"local checkpoint of iteration {iteration}: the resume proof's digests failed ({failed})")
            if head is not None:
                head = dataclasses.replace(head, proof=proof.with_digests(head.proof, parts))
        if head is not None:
            meta = dict(meta, head=head.to_json())
        refused = _attempt(local_piece.prepare, self.node_dir, iteration, self.job) if self.leader else None
        if refused:
            print(f" warning: local checkpoint of iteration {iteration} on {self.host}: {refused}",
                  file=sys.stderr, flush=True)
        if not all_true(refused is None, group=self.group, device=CPU):
            return False  # no rank wrote anything: another job's folder stays as it was
        data = local_piece.encode(items, arrays, meta)
        slot = {"world": world, "job": self.job}
        error = _attempt(local_piece.write_piece, self.node_dir, iteration, rank, data, slot)
        sources = local_plan.replica_sources(self.targets, rank)
        received = exchange_bytes([(t, data) for t in self.targets[rank]], sources, self.group)
        for i, source in enumerate(sources):
            failed = _attempt(local_piece.write_piece, self.node_dir, iteration, source, received[i], slot)
            error = error or failed
        if error:
            print(f" warning: local checkpoint of iteration {iteration} on {self.host}: {error}",
                  file=sys.stderr, flush=True)
        complete = all_true(error is None, group=self.group, device=CPU)
        if complete and self.leader:
            local_piece.mark_complete(self.node_dir, iteration, world, self.job, self.padded_vocab)
            local_piece.prune(self.node_dir, KEPT, self.job)
        dist.barrier(group=self.group)  # the markers are down before the save counts as done
        return complete

    def wait(self) -> None:
        """Wait for the local save in flight (before the next one, a restore check, and exit)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()

    def close(self) -> None:
        """At a clean end: the save in flight, finished; the node dirs given up (ownership)."""
        self.wait()
        dist.barrier(group=self.group)
        if self.leader:
            ownership.release(self.node_dir)


def _attempt(fn, *args):
    """None when fn(*args) worked, else what went wrong: fn's own answer, or an OSError (a full
    or failed local disk is a warning: the persistent tier still holds the job's checkpoints)."""
    try:
        return fn(*args)
    except OSError as e:
        return f"{type(e).__name__}: {e}"


class _Background:
    def __init__(self, fn):
        self.error = None

        def run():
            try:
                fn()
            except BaseException as e:  # handed to the training thread by wait()
                self.error = e

        self.thread = threading.Thread(target=run, name="ucp-local-save", daemon=False)
        self.thread.start()

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def open_tier(args, state) -> LocalTier:
    """Collective: the tier of `--local-ckpt-dir`, for this job (job_identity), after each
    node's leader took its node dir (refused, like a --save folder, while another live job
    holds it: ownership.py) and checked that it has room for the tier (its ranks' pieces and
    the replicas it keeps, for KEPT + 1 iterations: the kept ones and the one being written),
    refused with the numbers otherwise."""
    group = dist.new_group(backend="gloo")
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    job = on_rank_zero(job_identity, args)
    tier = LocalTier(args.local_ckpt_dir, args.local_ckpt_replicas, hosts, group, job)
    tier.padded_vocab = padded_vocab(state.model)
    optimizer = None if args.no_save_optim else state.optimizer
    states = STATES if optimizer is not None else ("param",)
    plan = _plan(local_tensors(state.model, optimizer, args.vocab_size), states, optimizer is not None,
                 merge=False)[0]
    mine = 4 * len(states) * sum(i.region.numel for i in plan.items)
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, mine)
    run_everywhere(_check_space, tier, sizes)
    if dist.get_rank() == 0:
        print(f" local checkpoint tier: {args.local_ckpt_dir}/<host>/ every {args.local_save_interval} "
              f"iterations, {args.local_ckpt_replicas} replica(s) on other nodes; "
              f"{_gib(sum(sizes))} per copy of the job's state", flush=True)
        if len(set(hosts)) == 1 and args.local_ckpt_replicas:
            print(" local checkpoint tier: warning: all ranks on one node: no replicas (a node "
                  "loss loses the tier)", flush=True)
    return tier


def _check_space(tier: LocalTier, sizes) -> None:
    if not tier.leader:
        return
    try:
        os.makedirs(tier.node_dir, exist_ok=True)
        ownership.claim(tier.node_dir, what="--local-ckpt-dir")
        _check_room(tier, sizes)
    except OSError as e:  # a regular file, /dev/null, a read-only dir: one line, at start
        raise ConfigError(f"--local-ckpt-dir {tier.root}: cannot use {tier.node_dir} ({e.strerror or e}); "
                          "expected a writable folder (node-local: /dev/shm or a local disk)") from None


def _check_room(tier: LocalTier, sizes) -> None:
    ranks = local_plan.nodes_of(tier.hosts)[tier.host]
    originals, replicas = local_plan.node_share(tier.hosts, sizes, tier.replicas, tier.host)
    need = (KEPT + 1) * (originals + replicas)
    held = sum(_tree_bytes(p) for p in local_piece.own_folders(tier.node_dir, tier.job))  # reused, pruned
    free = shutil.disk_usage(tier.node_dir).free
    if need > free + held:
        raise ConfigError(
            f"--local-ckpt-dir {tier.node_dir}: the local tier needs {_gib(need)} on {tier.host} "
            f"({KEPT + 1} iterations x ({_gib(originals)} of its {len(ranks)} ranks' pieces + "
            f"{_gib(replicas)} of replicas)) but {_gib(free)} are free (+ {_gib(held)} it holds "
            "already); free space, lower --local-ckpt-replicas, or point it elsewhere")


def _tree_bytes(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(base, f))
            except OSError:
                continue
    return total

