"""A restart from the local tier, step 3 (local_restore.py): the pieces a node lacks, from the
node that holds them, each byte once per receiving node, kept in the node's dir as its own
copies (written beside and renamed; marked complete where the node had none of the
iteration), so that a restart killed meanwhile leaves the tier usable and the next one reads
them locally."""

import torch.distributed as dist

from megatron_ucp.engine import local_plan
from megatron_ucp.engine.local_tier import exchange_bytes
from megatron_ucp.format import local_piece


def receive(tier, choice, held: dict, here: dict, found) -> tuple:
    """Collective: every node's leader receives the pieces its node lacks from the node that
    holds them (each byte once per receiving node) and keeps them as this node's copies
    (local_piece.keep_copy; the iteration marked complete here once all are down). `held`: the
    pieces this leader sends; `here`: {saving rank: (bytes, header digest)} of those this node
    checked. Returns ({saving rank: (bytes, header digest)} of every piece on this node, on
    every rank of the node; {host: bytes it received}; why a node cannot keep them, or None)."""
    rank = dist.get_rank()
    moves = local_plan.transfers(choice, tier.hosts)
    sends = [(receiver, held[saved]) for sender, receiver, saved in moves if sender == rank]
    receiving = [(sender, saved) for sender, receiver, saved in moves if receiver == rank]
    received = exchange_bytes(sends, [s for s, _ in receiving], tier.group)
    checked, refused, nbytes = dict(here), None, 0
    if tier.leader:
        incoming = {saved: received[i] for i, (_, saved) in enumerate(receiving)}
        received = None
        nbytes = sum(len(d) for d in incoming.values())
        crcs = {c.rank: c.crc32 for node in found for it in node if it.iteration == choice.iteration
                and it.refused is None for c in it.copies if c.bad is None and c.host in choice.holders.get(c.rank, ())}
        try:
            refused = keep(tier, choice, incoming, crcs, found)
        except OSError as e:
            refused = f"keeping the received pieces on {tier.host} failed ({e})"
        checked.update({saved: (len(data), digest(data)) for saved, data in incoming.items()})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (tier.host, checked, nbytes, refused) if tier.leader else None, group=tier.group)
    mine = next(x for x in everyone if x is not None and x[0] == tier.host)
    by_node = {x[0]: x[2] for x in everyone if x is not None}
    return mine[1], by_node, next((x[3] for x in everyone if x is not None and x[3]), None)


def digest(data: bytes) -> str:
    """The header digest of a piece's bytes (local_piece.read_header's)."""
    n = int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    return local_piece.header_digest(data[8:8 + n])


def keep(tier, choice, incoming: dict, crcs: dict, found):
    """Leaders: the received pieces kept in this node's folder of the iteration (made and
    marked as the job's where the node listed none of it; then marked complete: it holds every
    piece now). Returns why they cannot be (a folder of that iteration the tier did not write
    for this job, or a link), or None."""
    if not incoming:
        return None
    # A node whose inventory listed copies of the iteration holds this job's folder of it;
    # any other folder of that name is made anew (prepare: a foreign one or a link is refused).
    fresh = not local_plan.held_copies(found, choice.iteration, tier.host)
    if fresh:
        refused = local_piece.prepare(tier.node_dir, choice.iteration, tier.job)
        if refused:
            return refused
    slot = {"world": choice.world, "job": tier.job}
    for saved, data in sorted(incoming.items()):
        local_piece.keep_copy(tier.node_dir, choice.iteration, saved, data, crcs[saved], slot)
    if fresh:
        local_piece.mark_complete(tier.node_dir, choice.iteration, choice.world, tier.job,
                                  local_plan.padded_vocab_of(found, choice.iteration))
    return None


def sent_by(tier, choice) -> set:
    """The saving ranks whose pieces this rank sends to other nodes (local_plan.transfers)."""
    return {saved for sender, _, saved in local_plan.transfers(choice, tier.hosts) if sender == dist.get_rank()}


def traffic(received: dict, loads: list) -> str:
    """Per node: MB received from other nodes / MB its ranks loaded (from the pieces and from
    their replica groups; a byte two ranks of a node load counts twice)."""
    loaded: dict = {}
    for host, nbytes in loads:
        loaded[host] = loaded.get(host, 0) + nbytes
    return "MB received / loaded: " + ", ".join(
        f"{host} {received.get(host, 0) / 1e6:.1f} / {loaded[host] / 1e6:.1f}" for host in sorted(loaded))
