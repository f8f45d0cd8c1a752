"""A restart from the local tier, on any world size and layout.

1. Each surviving node's leader takes the inventory of its dir: this job's complete iterations
   and the pieces (originals and replicas) their sidecars list, each record checked against
   its slot (another job's iterations are named and never used).
2. All ranks agree (local_plan.choose) on the newest iteration newer than the persistent
   checkpoint of which every saving rank's piece has a copy on some surviving node; the
   leaders check that iteration's pieces from their headers (slot, size, regions, and that
   together they cover every tensor: local_check); a bad copy makes them choose again
   without it (the next copy, the next iteration). No piece is read whole: its bytes are
   checked by chunk (local_piece.check_chunks), by whoever reads them, as they are read.
3. A rank of each node receives the header of each piece its node lacks from a rank of a node
   that holds it (local_plan.transfers spreads the pieces over the ranks of both; the manifest
   head, the RNG states and the regions are in the headers) and stages it as a sparse file of
   the piece's size (local_receive.py); the data comes in step 4, once the load's read plan
   says which bytes the node's ranks read: each node gets the union of its ranks' spans, each
   byte once, nothing else, streamed into the staged files beside the reads of what the node
   holds (before any read where no persistent checkpoint could overwrite a partial load). The
   sender reads only the chunks of what it sends, each checked before any byte of it goes; a
   failed check makes every rank choose again without that copy. Nothing received is kept:
   the staging folder is removed after the load and at the start of every restore (a restart
   killed meanwhile leaves the tier as it was). No folder is assembled.
4. Every rank loads universally from the pieces in place (piece_reads.PieceSource): the
   manifest is rank 0's piece's head, the RNG states the pieces' metadata, and each slice it
   needs is read from the pieces that hold it through an index of their runs, nothing else
   (a rank of the saving layout that owned all it holds reads its own piece alone). Each rank
   checks the CRC-32 of a piece's chunk the first time it reads from it (a received piece was
   checked by its sender), so a node's pieces are checked by the ranks that read them, in
   parallel, and the chunks no rank reads are not read at all; a failed check is raised on
   every rank, and the restore starts again without that copy. Each rank also checks that a
   piece's header is the one its leader checked. The resume proof runs after the load; a
   disproved iteration is set aside, the next one tried.
Anything missing or bad is one line, and the caller falls back to the persistent tier.
Before the model is built, `peek` tells the trainers the padded vocabulary of the iteration a
restore will take (its COMPLETE markers record it): padding rows take part in the softmax, so
the model must be built with the checkpoint's, as for a persistent checkpoint.
"""

import os
import socket
import time

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_ucp.engine import local_check, local_plan, local_receive
from megatron_ucp.engine.collective import all_true, on_rank_zero, run_everywhere
from megatron_ucp.engine.load import load_universal
from megatron_ucp.engine.local_tier import CPU
from megatron_ucp.engine.proof import ResumeProofError
from megatron_ucp.engine.piece_reads import PieceSource
from megatron_ucp.errors import FormatError, IncompleteCheckpointError, IntegrityError, LayoutError
from megatron_ucp.format import folder, local_piece
from megatron_ucp.format.manifest import architecture, check_architecture
from megatron_ucp.mcore.flag_validation import keeps_saved_padding
from megatron_ucp.mcore.model_map import padded_vocab, unwrap


def inventory(node_dir: str, host: str, job) -> list:
    """What this node holds of the local tier (local_plan.Iteration), as its markers and
    sidecars say, each checked against its slot (folder, file name, marker, `job`): another
    job's iteration is refused, a sidecar that names another slot makes its copy bad. The
    pieces are checked when the chosen iteration's are read."""
    out = []
    for iteration, (record, why) in sorted(local_piece.markers(node_dir).items()):
        marker = os.path.join(folder.iteration_dir(node_dir, iteration), local_piece.COMPLETE)
        if record is None:
            out.append(local_plan.Iteration(iteration, 0, refused=why))
        elif record.get("job") != job:
            out.append(local_plan.Iteration(iteration, record["world"], refused=(
                f"{marker}: another job's ({local_check.whose(record.get('job'), job)})")))
        else:
            padded = record.get("padded_vocab_size")
            out.append(local_plan.Iteration(iteration, record["world"], tuple(
                _copy(node_dir, host, iteration, record["world"], job, rank)
                for rank in local_piece.held_ranks(node_dir, iteration)),
                padded_vocab=padded if type(padded) is int and padded > 0 else None))
    return out


def _copy(node_dir, host, iteration, world, job, rank) -> local_plan.Copy:
    path = local_piece.sidecar_path(node_dir, iteration, rank)
    try:
        record = local_piece.sidecar(node_dir, iteration, rank)
    except (FormatError, IncompleteCheckpointError) as e:
        return local_plan.Copy(host, rank, 0, f"sidecar unreadable ({e})")
    problem = local_check.slot_problem(record, rank, iteration, world, job)
    if problem:
        return local_plan.Copy(host, rank, 0, f"{path}: {problem}")
    return local_plan.Copy(host, rank, record["bytes"], crc32=record["crc32"], chunk_bytes=record["chunk_bytes"],
                           chunk_crc32=tuple(record["chunk_crc32"]))


def _seen(tier, choice, copies, job):
    """Leaders: (local_check.Seen of each copy this node holds of the chosen iteration, and
    {rank: (header digest, regions, rank 0's head)} of the sound ones), from its header alone:
    the slot its metadata records; its regions, of which its size follows, equal to the file's
    and the sidecar's. Other ranks: ([], {})."""
    seen, details = [], {}
    if not tier.leader:
        return seen, details
    for rank, copy in sorted(copies.items()):
        if tier.host not in choice.holders.get(rank, ()):
            continue
        path = local_piece.piece_path(tier.node_dir, choice.iteration, rank)
        digest = ""
        try:
            meta, table, header_len, size, digest = local_piece.read_header(path)
            problem = local_check.slot_problem(meta, rank, choice.iteration, choice.world, job)
            if not problem:
                regions, expected = local_check.piece_layout(meta, table, header_len, path)
                if not expected == size == copy.nbytes:
                    problem = f"{size} bytes, its regions make {expected} and its sidecar says {copy.nbytes} (not read)"
                details[rank] = (digest, tuple(regions), meta.get("head") if rank == 0 else None)
        except (FormatError, IncompleteCheckpointError) as e:
            problem = str(e).replace(f"{path}: ", "")
        seen.append(local_check.Seen(tier.host, rank, path, copy.crc32, digest, problem))
    return seen, details


def _vet(tier, choice, copies):
    """Collective: local_check.vet of the chosen iteration's copies, decided on rank 0 from
    every copy's Seen and the regions of one copy of each distinct header, and the same on
    every rank: ([(host, rank, why)], why the iteration is unusable or None), and the header
    digests of this node's copies (what their reads, and the ranks that send them, must find)."""
    seen, details = run_everywhere(_seen, tier, choice, copies, tier.job, group=tier.group)
    seen = _gathered(seen, tier.group)
    carry = local_check.carriers(seen)
    sent = {(rank, d[0]): d[1:] for rank, d in details.items() if (tier.host, rank) in carry}
    carried = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(sent, carried, dst=0, group=tier.group)
    verdict = on_rank_zero(lambda: local_check.vet(seen, {k: v for part in carried for k, v in part.items()}),
                           group=tier.group)
    return verdict, {c.rank: c.digest for c in seen if c.host == tier.host}  # on every rank of the node


def peek(root: str, newer_than: int, job):
    """Collective, before the model is built: (iteration, padded vocabulary its markers record,
    None if none) of the local iteration a restore would take first (the newest of `job`'s
    newer than `newer_than` with a copy of every piece listed), or None. The pieces are not read: if the
    restore takes another one, its padding check (`_padding_misfit`) decides."""
    host = socket.gethostname()
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host)
    leader = local_plan.leaders(hosts)[host] == dist.get_rank()
    node_dir = os.path.join(root, host)
    mine = run_everywhere(lambda: inventory(node_dir, host, job) if leader else None)
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    found = [f for f in found if f is not None]
    choice = local_plan.choose(found, newer_than)
    if choice.iteration is None:
        return None
    return choice.iteration, local_plan.padded_vocab_of(found, choice.iteration)


def _gathered(value, group) -> list:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value, group=group)
    return [x for rank_value in everyone for x in rank_value]


def _choose(tier, found: list, newer_than: int):
    """(choice, {saving rank: header digest} of the pieces this node holds of it): choose, and
    check the chosen iteration's copies from their headers (slot, size, regions, the coverage
    of every tensor: local_check.vet); choose again without what was found bad until they are
    sound. Their bytes are checked by chunk as they are read (piece_reads) or sent
    (local_receive)."""
    while True:
        choice = local_plan.choose(found, newer_than)
        if choice.iteration is None:
            return choice, {}
        copies = local_plan.held_copies(found, choice.iteration, tier.host)
        (bad, problem), digests = _vet(tier, choice, copies)
        if problem is not None:
            found = local_plan.refuse(found, choice.iteration, problem)
        elif not bad:
            return choice, digests
        else:
            found = local_plan.mark_bad(found, [(h, choice.iteration, r, w) for h, r, w in bad])


def restore(tier, args, state, newer_than: int, reseed=None, found=None):
    """Restore the newest usable local iteration newer than `newer_than`; returns the engine's
    LoadResult, or None (after one line saying why) when the persistent tier must serve.
    `found`: the nodes' inventories as a failed attempt left them (its bad copies marked)."""
    start = time.perf_counter()
    rank = dist.get_rank()
    if found is None:
        mine = run_everywhere(lambda: inventory(tier.node_dir, tier.host, tier.job) if tier.leader else None,
                              group=tier.group)
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine, group=tier.group)
        found = [f for f in found if f is not None]
    choice, digests = _choose(tier, found, newer_than)
    target = f"iteration {newer_than}" if newer_than >= 0 else "none yet: training from scratch"
    if choice.iteration is None:
        if rank == 0 and choice.notes:
            print(" local checkpoint tier: " + "; ".join(choice.notes)
                  + f"; falling back to the persistent checkpoint ({target})", flush=True)
        return None
    marks = [time.perf_counter()]
    copies = local_plan.held_copies(found, choice.iteration, tier.host)
    here = {r: (copies[r].nbytes, d) for r, d in digests.items()}
    checked, staged, headers, refused, bad = run_everywhere(local_receive.headers, tier, choice, here, found,
                                                            group=tier.group)
    if bad:  # a sender's copy failed its CRC-32: nothing is loaded yet, choose again without it
        local_receive.clear(tier)
        return restore(tier, args, state, newer_than, reseed, local_plan.mark_bad(found, bad))
    marks.append(time.perf_counter())
    source, misfit = None, None
    if refused is None:
        sums = {r: (copies[r].chunk_bytes, copies[r].chunk_crc32) for r in checked
                if tier.host in choice.holders.get(r, ()) and r in copies}
        source, refused = run_everywhere(_open, tier.node_dir, choice.iteration, checked, sums, staged,
                                         group=tier.group)
    if source is not None:
        if local_plan.transfers(choice, tier.hosts):  # the same on every rank; none after a crash
            source.fetch = lambda needs: local_receive.fetch(tier, choice, found, staged, needs, source.bad)
            source.overlap = newer_than >= 0  # a failed transfer after reads began: the persistent tier overwrites
        misfit = _misfit(source.manifest, state.model, args.vocab_size, source.where)
        misfit = misfit or _padding_misfit(source.manifest, state.model, args.vocab_size)
    marks.append(time.perf_counter())
    if not all_true(refused is None and misfit is None, group=tier.group, device=CPU):
        if rank == 0:
            why = (f"was saved by another model ({misfit or 'on another rank'})" if refused is None
                   else f"not restored ({refused})")
            print(f" local checkpoint tier: iteration {choice.iteration} {why}; falling back to the persistent "
                  f"checkpoint ({target})", flush=True)
        if source is not None:
            source.close()
        local_receive.clear(tier)
        return None
    try:
        result = load_universal(tier.node_dir, state.model, state.optimizer, state.scheduler,
                                vocab_size=args.vocab_size, iteration=choice.iteration,
                                load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
                                load_scheduler=not args.no_load_scheduler, strict=not args.no_strict_load,
                                verify=False, reseed=reseed, read_policy=args.ckpt_read_policy,
                                prove=not getattr(args, "no_resume_proof", False), tier="local", source=source)
    except ResumeProofError as e:
        source.close()  # before the next iteration's restore opens its own
        return _disproved(tier, args, state, newer_than, reseed, choice.iteration, e)
    except IncompleteCheckpointError:  # raised on every rank (the transfer's: before the load returned)
        source.settle()
        if source.refused is None:
            raise
        if rank == 0:
            print(f" local checkpoint tier: iteration {choice.iteration} not restored ({source.refused}); "
                  f"falling back to the persistent checkpoint ({target})", flush=True)
        return None
    except IntegrityError as e:  # raised on every rank (the load agrees on errors)
        source.settle()  # a sender's finding is in its `bad` once its transfer ended
        bad = _gathered([(tier.host, choice.iteration, r, why) for r, why in sorted(source.bad.items())], tier.group)
        if not bad:
            raise
        source.close()
        return _damaged(tier, args, state, newer_than, reseed, local_plan.mark_bad(found, bad), e)
    finally:
        source.close()
        local_receive.clear(tier)
    received = source.received_by_node
    tier.restored = choice.iteration
    loads = [None] * dist.get_world_size()  # what each rank loaded: from the pieces, from replicas
    dist.all_gather_object(loads, (tier.host, sum(source.touched.values()) + result.bytes_exchanged,
                                   {p: local_plan.merge(s) for p, s in source.spans.items()}), group=tier.group)
    needed = local_receive.needed(loads)
    tier.restore_stats = {"received": received.get(tier.host, 0), "read": dict(source.touched),
                          "needed": needed.get(tier.host, 0), "headers": headers.get(tier.host, 0)}  # node; rank
    loads = [(host, nbytes) for host, nbytes, _ in loads]
    if rank == 0:
        nodes = sorted({h for hs in choice.holders.values() for h in hs})
        notes = f" ({'; '.join(choice.notes)})" if choice.notes else ""
        spans = (f"inventory and checks {marks[0] - start:.2f}, headers {marks[1] - marks[0]:.2f}, index "
                 f"{marks[2] - marks[1]:.2f}, load with the transfers {time.perf_counter() - marks[2]:.2f}")
        print(f" local checkpoint tier: restored iteration {choice.iteration} saved on {choice.world} "
              f"ranks from {', '.join(nodes)} in {time.perf_counter() - start:.2f} s ({spans}; persistent: "
              f"{newer_than if newer_than >= 0 else 'none'}; {local_receive.traffic(received, loads, needed, headers)})"
              f"{notes}",
              flush=True)
    return result


def _open(node_dir: str, iteration: int, checked: dict, sums: dict, staged: dict):
    """(the pieces' reader, None), or (None, why it cannot read them: a piece that changed
    after the leader checked it, a head that is no manifest)."""
    try:
        return PieceSource(node_dir, iteration, checked, sums, staged), None
    except (FormatError, IncompleteCheckpointError, IntegrityError, LayoutError) as e:
        return None, str(e)


def _disproved(tier, args, state, newer_than: int, reseed, iteration: int, error):
    """A local iteration whose restored state failed its resume proof: set aside on every node
    (no restart takes it again), then the next local iteration, else the persistent tier. The
    model already holds the refused state: with no persistent checkpoint to overwrite it, the
    job stops and its restart trains from scratch."""
    set_aside(tier, iteration)
    if dist.get_rank() == 0:
        print(f" local checkpoint tier: iteration {iteration} set aside: {error}", flush=True)
    result = restore(tier, args, state, newer_than, reseed)
    if result is None and newer_than < 0:
        raise IntegrityError(f"local checkpoint tier {args.local_ckpt_dir}: iteration {iteration} failed its "
                             "resume proof and no persistent checkpoint holds the job's state: restart to "
                             "train from scratch (the refused iteration is set aside)")
    return result


def _damaged(tier, args, state, newer_than: int, reseed, found, error):
    """A copy whose CRC-32 failed as the load read it: the restore again, without it (the next
    copy, the next iteration, else the persistent tier). The model holds part of the load: with
    no persistent checkpoint to overwrite it, the job stops (its restart trains from scratch)."""
    result = restore(tier, args, state, newer_than, reseed, found)
    if result is None and newer_than < 0:
        raise IntegrityError(f"local checkpoint tier {args.local_ckpt_dir}: {error}; no other copy and no "
                             "persistent checkpoint holds the job's state: restart to train from scratch")
    return result


def _misfit(m, model, vocab_size: int, where: str):
    """Why the pieces' manifest `m` does not fit this model (a tier left by another run in the
    same dir), or None; checked before any tensor is loaded, so that the fallback starts clean."""
    try:
        check_architecture(m.architecture, architecture(unwrap(model[0]), vocab_size), where)
    except LayoutError as e:
        return str(e).split(": ", 1)[-1]
    return None


def _padding_misfit(m, model, vocab_size: int):
    """Why the assembled checkpoint's padded vocabulary is not the model's where a restart
    restoring it keeps it (padding rows take part in the softmax: other padding, another loss),
    or None. The trainers build the padding of the iteration `peek` finds; this catches a
    restore that ends on another one, or markers that do not record it."""
    saved = m.layout.get("padded_vocab_size")
    built = _other_padding(saved, model, vocab_size)
    if built is None:
        return None
    return (f"padded vocabulary: checkpoint {saved} rows, model {built}; a restart restoring it "
            f"builds {saved} (padding rows take part in the softmax)")


def fallback_padding_note(model, vocab_size: int, saved):
    """After the local tier fell back to the persistent checkpoint: a warning when that one's
    padded vocabulary (`saved`) is not the model's, which was built for the local iteration that
    could not be restored, where a restart restoring it keeps it; else None."""
    built = _other_padding(saved, model, vocab_size)
    if built is None:
        return None
    return (f"WARNING: the model was built with the local tier's padded vocabulary of {built} rows, "
            f"but the persistent checkpoint it falls back to has {saved}: padding rows take part in "
            f"the softmax, so the loss changes; a restart without those local iterations builds {saved}")


def _other_padding(saved, model, vocab_size: int):
    """The model's padded vocabulary when it differs from `saved` where keeps_saved_padding
    would keep `saved`, else None."""
    built = padded_vocab(model)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if built is None or saved == built or not keeps_saved_padding(saved, vocab_size, tp):
        return None
    return built


def set_aside(tier, iteration: int) -> None:
    """Collective: the leaders remove `iteration`'s COMPLETE marker, so that no restart takes
    it again (--local-ckpt-check-loss found it bad)."""
    if tier.leader:
        marker = os.path.join(folder.iteration_dir(tier.node_dir, iteration), local_piece.COMPLETE)
        if os.path.exists(marker):
            os.remove(marker)
    dist.barrier(group=tier.group)
