"""collective.agree on real gloo processes: every rank raises the first failing rank's error,
named by its rank in the group, over the world and over a subgroup."""

import multiprocessing


def _member(rank: int, world: int, store_path: str, out):
    import torch.distributed as dist

    from megatron_ucp.engine.collective import agree
    from megatron_ucp.errors import FormatError

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    seen = {}
    try:
        try:  # the world: ranks 1 and 2 fail, rank 1 first
            agree(FormatError(f"bad file on {rank}") if rank in (1, 2) else None)
            seen["world"] = None
        except Exception as e:
            seen["world"] = (type(e).__name__, str(e), getattr(e, "agreed", False))
        sub = dist.new_group([0, 2])  # every rank makes it; its group rank 1 is global rank 2
        if rank in (0, 2):
            try:
                agree(ValueError("odd") if rank == 2 else None, group=sub)
                seen["sub"] = None
            except Exception as e:
                seen["sub"] = (type(e).__name__, str(e), getattr(e, "agreed", False))
        agree(None)  # nobody failed: returns on every rank
        seen["none"] = "returned"
    finally:
        out.put((rank, seen))
        dist.destroy_process_group()


def test_agree_raises_the_first_failing_ranks_error_on_every_rank(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out, world = ctx.Queue(), 3
    procs = [ctx.Process(target=_member, args=(r, world, str(tmp_path / "store"), out)) for r in range(world)]
    for p in procs:
        p.start()
    seen = dict(out.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    assert seen[0]["world"] == ("FormatError", "bad file on 1 (raised on rank 1)", True)
    assert seen[1]["world"] == ("FormatError", "bad file on 1", True)  # its own
    assert seen[2]["world"] == ("FormatError", "bad file on 2", True)  # its own
    assert seen[0]["sub"] == ("UCPError", "ValueError: odd (raised on rank 1)", True)
    assert seen[2]["sub"] == ("ValueError", "odd", True)
    assert "sub" not in seen[1]
    assert all(s["none"] == "returned" for s in seen.values())
