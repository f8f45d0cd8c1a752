"""A restart from the local tier, on any world size and layout.

1. Each surviving node's leader takes the inventory of its dir: complete iterations, and every
   piece (original or replica) checked against its CRC-32.
2. All ranks agree (local_plan.choose) on the newest iteration newer than the persistent
   checkpoint of which every saving rank's piece has a sound copy on some surviving node.
3. Each node's leader reads the pieces its node holds and receives the others from a node that
   holds them, then writes them into a universal checkpoint folder under its dir (the save's
   own file layout and block checksums).
4. Every rank loads that folder universally: it reads just its slices, resharded.
Anything missing or bad is one line, and the caller falls back to the persistent tier.
"""

import os
import shutil
import time

import torch.distributed as dist

from megatron_ucp.engine import local_plan
from megatron_ucp.engine.collective import run_everywhere
from megatron_ucp.engine.load import load_universal
from megatron_ucp.engine.local_tier import exchange_bytes
from megatron_ucp.engine.planner import part_shapes_of
from megatron_ucp.engine.save import _checksum
from megatron_ucp.format import folder, local_piece, tensor_io
from megatron_ucp.format.layout import region_runs
from megatron_ucp.format.manifest import FORMAT_VERSION
from megatron_ucp.format.tensor_entry import TensorEntry, file_layout, file_tensor_name
from megatron_ucp.mcore import rng


def inventory(node_dir: str, host: str) -> list:
    """What this node holds of the local tier, every copy checked (local_plan.Iteration)."""
    out = []
    for iteration, world in sorted(local_piece.complete_iterations(node_dir).items()):
        copies = []
        for rank in local_piece.held_ranks(node_dir, iteration):
            nbytes, bad = local_piece.check_piece(node_dir, iteration, rank)
            copies.append(local_plan.Copy(host, rank, nbytes, bad))
        out.append(local_plan.Iteration(iteration, world, tuple(copies)))
    return out


def _gather_pieces(tier, choice) -> dict:
    """Leaders: {saving rank: bytes} of every piece of the chosen iteration, read here or
    received from the node that holds it; other ranks: {}."""
    rank, it = dist.get_rank(), choice.iteration
    moves = local_plan.transfers(choice, tier.hosts)
    sends = [(receiver, local_piece.read_piece(tier.node_dir, it, saved))
             for sender, receiver, saved in moves if sender == rank]
    receiving = [(sender, saved) for sender, receiver, saved in moves if receiver == rank]
    received = exchange_bytes(sends, [s for s, _ in receiving], tier.group)
    if not tier.leader:
        return {}
    pieces = {saved: received[i] for i, (_, saved) in enumerate(receiving)}
    for saved, holding in choice.holders.items():
        if tier.host in holding:
            pieces[saved] = local_piece.read_piece(tier.node_dir, it, saved)
    return pieces


def assemble(root: str, iteration: int, pieces: dict) -> str:
    """Write `pieces` ({saving rank: bytes}) as the universal checkpoint of `iteration` under
    `root`: files at full size, every region written where it belongs, block checksums, the
    manifest from rank 0's piece, commit. Returns the folder."""
    decoded = {r: local_piece.decode(data, local_piece.piece_path("<received>", iteration, r))
               for r, data in pieces.items()}
    head = dict(decoded[0][0]["head"])
    where = f"rank 0's local piece of iteration {iteration}"
    entries = {n: TensorEntry.from_json(n, e, where, FORMAT_VERSION) for n, e in head["tensors"].items()}
    layouts = {n: file_layout(e) for n, e in entries.items()}
    part_shapes = part_shapes_of(entries)
    shutil.rmtree(root, ignore_errors=True)
    tmp = folder.begin(root, iteration)
    tensor_io.in_parallel(lambda n: tensor_io.create_tensor_file(os.path.join(tmp, entries[n].file), layouts[n]),
                          list(entries))
    for saved, (meta, regions) in sorted(decoded.items()):
        for name, region, states in regions:
            runs = region_runs(part_shapes[(name, region.part)], region)
            for state, data in states.items():
                tensor_io.write_runs(os.path.join(tmp, entries[name].file), layouts[name],
                                     file_tensor_name(state, region.part), runs, data)
        if meta.get("rng") is not None:
            rng.save(os.path.join(tmp, "rng"), saved, meta["rng"])
    sums = _checksum(tmp, entries, layouts, list(entries))
    head["tensors"] = {n: e.written(**sums[n]).to_json() for n, e in entries.items()}
    return folder.commit(root, tmp, iteration, head)


def restore(tier, args, state, newer_than: int, reseed=None):
    """Restore the newest usable local iteration newer than `newer_than`; returns the engine's
    LoadResult, or None (after one line saying why) when the persistent tier must serve."""
    start = time.perf_counter()
    rank = dist.get_rank()
    mine = run_everywhere(lambda: inventory(tier.node_dir, tier.host) if tier.leader else None,
                          group=tier.group)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine, group=tier.group)
    choice = local_plan.choose([f for f in found if f is not None], newer_than)
    if choice.iteration is None:
        if rank == 0 and choice.notes:
            target = f"iteration {newer_than}" if newer_than >= 0 else "none yet: training from scratch"
            print(" local checkpoint tier: " + "; ".join(choice.notes)
                  + f"; falling back to the persistent checkpoint ({target})", flush=True)
        return None
    pieces = run_everywhere(_gather_pieces, tier, choice, group=tier.group)
    root = os.path.join(tier.node_dir, local_piece.RESTORE)
    run_everywhere(lambda: assemble(root, choice.iteration, pieces) if tier.leader else None,
                   group=tier.group)
    del pieces
    result = load_universal(root, state.model, state.optimizer, state.scheduler,
                            vocab_size=args.vocab_size, iteration=choice.iteration,
                            load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
                            load_scheduler=not args.no_load_scheduler, strict=not args.no_strict_load,
                            verify=not args.no_verify_checkpoint, reseed=reseed,
                            read_policy=args.ckpt_read_policy)
    dist.barrier(group=tier.group)
    if tier.leader:
        shutil.rmtree(root, ignore_errors=True)
    tier.restored = choice.iteration
    if rank == 0:
        nodes = sorted({h for hs in choice.holders.values() for h in hs})
        notes = f" ({'; '.join(choice.notes)})" if choice.notes else ""
        print(f" local checkpoint tier: restored iteration {choice.iteration} saved on {choice.world} "
              f"ranks from {', '.join(nodes)} in {time.perf_counter() - start:.2f} s (persistent: "
              f"{newer_than if newer_than >= 0 else 'none'}){notes}", flush=True)
    return result


def set_aside(tier, iteration: int) -> None:
    """Collective: the leaders remove `iteration`'s COMPLETE marker, so that no restart takes
    it again (--local-ckpt-check-loss found it bad)."""
    if tier.leader:
        marker = os.path.join(folder.iteration_dir(tier.node_dir, iteration), local_piece.COMPLETE)
        if os.path.exists(marker):
            os.remove(marker)
    dist.barrier(group=tier.group)
