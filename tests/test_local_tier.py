"""The local checkpoint tier (issue 37, docs/elastic.md "The local tier"), end to end on CPU.

One job of 4 processes on 2 pretended nodes (node0: ranks 0-1, node1: ranks 2-3) saves locally
every 2 iterations with one replica and persistently every 5, and is SIGKILLed after iteration
7 (the local save of 6 complete). Restarts on 2 processes and another layout (--elastic: TP2
PP2 becomes TP2 PP1) then restore from the local tier, or fall back, and their losses are held
to an uninterrupted run's.
"""

import json
import re
import shutil
import zlib
from pathlib import Path

import pytest

from harness import BASE, losses, max_loss_delta, ok, run_steps

ITERS, LOCAL, PERSISTENT, KILL = 10, 2, 5, 7
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--elastic"]


def _argv(root: Path, iters=ITERS, local_interval=LOCAL, save=True):
    argv = BASE + LAYOUT + ["--train-iters", str(iters), "--load", str(root / "ckpt"),
                            "--local-ckpt-dir", str(root / "local"), "--local-save-interval",
                            str(local_interval), "--loss-log", str(root / "losses.jsonl")]
    if save:
        argv += ["--save", str(root / "ckpt"), "--save-interval", str(PERSISTENT)]
    return argv


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """(reference losses, folder of the killed job's tiers)."""
    root = tmp_path_factory.mktemp("local_tier")
    reference = run_steps(4, [{"name": "reference", "op": "train",
                               "argv": BASE + LAYOUT + ["--train-iters", str(ITERS)]}], root / "reference")
    job = root / "job"
    complete = [str(job / "local" / node / "iter_0000006" / "COMPLETE") for node in ("node0", "node1")]
    run_steps(4, [{"name": "job", "op": "train", "argv": _argv(job), "kill_after": KILL,
                   "hosts": ["node0", "node0", "node1", "node1"], "wait_for": complete}],
              job, allow_failure=True)
    logged = [json.loads(line) for line in (job / "losses.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in logged] == list(range(1, KILL + 1)), "the job was not killed after 7"
    assert (job / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(PERSISTENT)
    for node in ("node0", "node1"):  # the newest two complete local iterations are kept
        kept = sorted(p.name for p in (job / "local" / node).iterdir() if p.name.startswith("iter_"))
        assert kept == ["iter_0000004", "iter_0000006"], (node, kept)
    ref = losses(reference, "reference")
    for r in logged:  # the killed job trained as the reference did
        assert abs(r["loss"] - ref[r["iteration"]]) <= 1e-4, r
    return ref, job


def _restart(crashed, tmp_path, hosts, damage=None):
    """Copy the killed job's tiers, apply `damage`, restart on len(hosts) processes."""
    ref, job = crashed
    root = tmp_path / "restart"
    shutil.copytree(job / "ckpt", root / "ckpt")
    shutil.copytree(job / "local", root / "local")
    if damage:
        damage(root / "local")
    result = run_steps(len(hosts), [{"name": "restart", "op": "train", "hosts": hosts,
                                     "argv": _argv(root, local_interval=100, save=False)}], root)
    return ref, ok(result, "restart")


def _with(argv, flag, value):
    """`argv` with `flag`'s value replaced."""
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _piece(local: Path, node: str, rank: int, iteration: int = 6) -> Path:
    return local / node / f"iter_{iteration:07d}" / f"rank_{rank:05d}.safetensors"


def test_node_loss_restores_from_local_tier(crashed, tmp_path):
    """node1 is lost (its dir deleted): node0's originals and node1's replicas on node0 restore
    iteration 6 on 2 processes of another layout; losses from 7 on are the uninterrupted ones."""
    ref, r = _restart(crashed, tmp_path, ["node0", "node0"],
                      damage=lambda local: shutil.rmtree(local / "node1"))
    resumed = {int(k): v for k, v in r["losses"].items()}
    assert sorted(resumed) == list(range(7, ITERS + 1))
    assert max_loss_delta(ref, resumed) <= 1e-4
    assert "restored iteration 6 saved on 4 ranks from node0" in r["stdout"], r["stdout"]
    assert "TP2 PP1" in r["stdout"]
    print(f"work lost: {KILL - 6} iteration with the local tier, {KILL - PERSISTENT} from the "
          f"persistent checkpoint of {PERSISTENT} (a persistent interval of {PERSISTENT}: up to "
          f"{PERSISTENT - 1}); max |dloss| {max_loss_delta(ref, resumed):.2e}")


def test_a_new_node_receives_only_the_bytes_its_ranks_read_and_a_kill_meanwhile_leaves_the_tier_usable(
        crashed, tmp_path):
    """Issue 48: node1 lost its copy of iteration 6 (a new node); a restart on both nodes (TP2
    PP1: node1's rank reads its TP half of both stages' pieces) sends node1 the headers of the
    pieces, then only the bytes its rank reads of them, each once: the bytes it received are
    the bytes it read of them, far fewer than the pieces (the whole-piece path received all
    four). A restart SIGKILLed while node1 writes what it received leaves the tier usable: the
    next restart restores 6 (the losses from 7 on are the uninterrupted ones); nothing received
    is kept (node1 holds no copy of 6, its staging folder is gone)."""
    import re

    ref, job = crashed
    root = tmp_path / "restart"
    shutil.copytree(job / "ckpt", root / "ckpt")
    shutil.copytree(job / "local", root / "local")
    shutil.rmtree(root / "local" / "node1" / "iter_0000006")
    argv = _argv(root, local_interval=100, save=False)
    hosts = ["node0", "node1"]
    run_steps(2, [{"name": "killed", "op": "train", "hosts": hosts, "argv": argv,
                   "die_receiving": {"rank": 1, "call": 2}}], root / "killed", allow_failure=True)
    staging = root / "local" / "node1" / ".ucp_receiving"
    assert len(list(staging.glob("rank_*.part"))) == 4, "the restart was not killed while staging what it received"
    r = ok(run_steps(2, [{"name": "restart", "op": "train", "hosts": hosts, "argv": argv}], root), "restart")
    resumed = {int(k): v for k, v in r["losses"].items()}
    assert sorted(resumed) == list(range(7, ITERS + 1))
    assert max_loss_delta(ref, resumed) <= 1e-4
    assert "restored iteration 6 saved on 4 ranks from node0" in r["stdout"], r["stdout"]
    found = re.search(r"bytes received / read of the pieces a node lacked: node1 (\d+) / (\d+)", r["stdout"])
    assert found, r["stdout"][-3000:]
    received, read = int(found[1]), int(found[2])
    whole = sum(_piece(root / "local", "node0", rank).stat().st_size for rank in range(4))
    assert received == read > 0, (received, read)
    assert received < 0.6 * whole, (received, whole)
    assert "headers received: node1 " in r["stdout"]
    assert not staging.exists() and not (root / "local" / "node1" / "iter_0000006").exists()
    print(f"node1 received {received} bytes (read {read}) of pieces of {whole} bytes")


def test_a_new_node_that_cannot_stage_what_it_receives_falls_back_to_persistent(crashed, tmp_path):
    """Issue 48: node1 lacks iteration 6 and its staging folder cannot be made (a file holds its
    name): one line naming node1 and why, then the persistent checkpoint of 5, the losses from
    6 on the uninterrupted ones."""
    ref, job = crashed
    root = tmp_path / "restart"
    shutil.copytree(job / "ckpt", root / "ckpt")
    shutil.copytree(job / "local", root / "local")
    shutil.rmtree(root / "local" / "node1" / "iter_0000006")
    (root / "local" / "node1" / ".ucp_receiving").write_text("not a folder")
    r = ok(run_steps(2, [{"name": "restart", "op": "train", "hosts": ["node0", "node1"],
                          "argv": _argv(root, local_interval=100, save=False)}], root), "restart")
    lines = [x for x in r["stdout"].splitlines() if "local checkpoint tier: iteration 6 not restored" in x]
    assert len(lines) == 1 and "staging the received headers on node1 failed" in lines[0], r["stdout"][-3000:]
    assert "falling back to the persistent checkpoint (iteration 5)" in lines[0]
    resumed = {int(k): v for k, v in r["losses"].items()}
    assert sorted(resumed) == list(range(6, ITERS + 1))
    assert max_loss_delta(ref, resumed) <= 1e-4


def test_corrupt_copy_takes_the_other(crashed, tmp_path):
    """A flipped byte in rank 0's original (node0): the restart (one process per node) takes
    its replica from node1, sent over the job's group, and names the bad file on one line."""
    ref, r = _restart(crashed, tmp_path, ["node0", "node1"],
                      damage=lambda local: _flip_byte(_piece(local, "node0", 0)))
    resumed = {int(k): v for k, v in r["losses"].items()}
    assert sorted(resumed) == list(range(7, ITERS + 1))
    assert max_loss_delta(ref, resumed) <= 1e-4
    lines = [line for line in r["stdout"].splitlines() if "local checkpoint tier: restored" in line]
    assert len(lines) == 1 and "node0/iter_0000006/rank_00000.safetensors: bytes [" in lines[0], r["stdout"]
    assert "CRC-32" in lines[0]


def test_both_copies_bad_fall_back_to_persistent(crashed, tmp_path):
    """Rank 0's piece of 6 bad on both nodes: iteration 4 is older than the persistent 5, so
    the restart loads the persistent checkpoint, after one line naming both bad copies."""
    def damage(local):
        _flip_byte(_piece(local, "node0", 0))
        _flip_byte(_piece(local, "node1", 0))

    line = _fell_back(crashed, tmp_path, damage)
    for node in ("node0", "node1"):
        assert re.search(rf"{node}/iter_0000006/rank_00000.safetensors: bytes \[\d+, \d+\) \(chunk \d+\): CRC-32",
                         line), line
    assert "no sound copy of the pieces of ranks 0" in line
    assert "falling back to the persistent checkpoint (iteration 5)" in line


def _fell_back(crashed, tmp_path, damage) -> str:
    """Restart on node0 and node1 after `damage`; assert that it resumed from the persistent
    checkpoint with the reference's losses, and return its one line that says why."""
    ref, r = _restart(crashed, tmp_path, ["node0", "node1"], damage=damage)
    resumed = {int(k): v for k, v in r["losses"].items()}
    assert sorted(resumed) == list(range(PERSISTENT + 1, ITERS + 1))
    assert max_loss_delta(ref, resumed) <= 1e-4
    lines = [line for line in r["stdout"].splitlines() if "local checkpoint tier:" in line and "falling back" in line]
    assert len(lines) == 1, r["stdout"]
    return lines[0]


def _rechunk(local: Path, node: str, rank: int, chunk: int, iteration: int = 6) -> None:
    """Rank `rank`'s sidecar on `node` recording the CRC-32s of `chunk`-byte chunks of its piece
    (the pieces of this small model are one default chunk each): what a large piece's is."""
    sidecar = local / node / f"iter_{iteration:07d}" / f"rank_{rank:05d}.json"
    data = _piece(local, node, rank, iteration).read_bytes()
    record = json.loads(sidecar.read_text())
    record.update(chunk_bytes=chunk, chunk_crc32=[zlib.crc32(data[i:i + chunk]) for i in range(0, len(data), chunk)])
    sidecar.write_text(json.dumps(record))


def test_a_copy_damaged_past_its_header_is_found_by_its_sender_as_it_streams(crashed, tmp_path):
    """node1 is lost; node0's replica of rank 3's piece (what node1's rank reads) has a byte
    flipped in its middle, recorded in 4 kB chunks: the headers go (their chunks are sound),
    then node0 finds the bad chunk as it streams the spans node1 reads (its own rank reading
    its pieces meanwhile), before any byte of that chunk is sent; every rank drops that copy,
    and with no other one (iteration 4 is older than the persistent 5) the restart loads the
    persistent checkpoint, after one line naming the chunk's bytes."""
    def damage(local):
        shutil.rmtree(local / "node1")
        _rechunk(local, "node0", 3, 4096)
        _flip_byte(_piece(local, "node0", 3))

    line = _fell_back(crashed, tmp_path, damage)
    size = _piece(crashed[1] / "local", "node0", 3).stat().st_size
    at = size // 2 // 4096 * 4096
    assert f"node0/iter_0000006/rank_00003.safetensors: bytes [{at}, {min(at + 4096, size)}) (chunk {at // 4096}): " \
        "CRC-32" in line, line
    assert "falling back to the persistent checkpoint (iteration 5)" in line


def _rewrite_meaning(local: Path, node: str, rank: int, iteration: int = 6) -> None:
    """Rank `rank`'s piece with its first region's weights scaled, its sidecar's CRC redone: the
    bytes are sound, the state is not (what only the resume proof sees)."""
    from megatron_ucp.format import local_piece

    node_dir = str(local / node)
    path = str(_piece(local, node, rank, iteration))
    meta, regions = local_piece.decode(Path(path).read_bytes(), path)
    items = [(name, region) for name, region, _ in regions]
    arrays = [dict(states) for _, _, states in regions]
    arrays[0]["param"] = arrays[0]["param"] * 1.5
    sidecar = json.loads(Path(local_piece.sidecar_path(node_dir, iteration, rank)).read_text())
    slot = {k: v for k, v in sidecar.items() if k not in ("rank", "iteration", "bytes", "crc32")}
    local_piece.write_piece(node_dir, iteration, rank, local_piece.encode(items, arrays, meta), slot)


def test_a_copy_that_fails_its_resume_proof_is_set_aside(crashed, tmp_path):
    """Rank 0's piece of 6 rewritten with other weights on both nodes, every CRC redone: the
    restored state fails the resume proof recorded at the local save; iteration 6 is set aside
    (its COMPLETE markers removed: no later restart takes it), and the persistent 5 serves."""
    def damage(local):
        _rewrite_meaning(local, "node0", 0)
        _rewrite_meaning(local, "node1", 0)

    ref, r = _restart(crashed, tmp_path, ["node0", "node1"], damage=damage)
    resumed = {int(k): v for k, v in r["losses"].items()}
    assert sorted(resumed) == list(range(PERSISTENT + 1, ITERS + 1))
    assert max_loss_delta(ref, resumed) <= 1e-4
    lines = [line for line in r["stdout"].splitlines() if "fails its resume proof (local tier)" in line]
    assert len(lines) == 1 and "local checkpoint tier: iteration 6 set aside" in lines[0], r["stdout"]
    for node in ("node0", "node1"):
        assert not (tmp_path / "restart" / "local" / node / "iter_0000006" / "COMPLETE").exists()


def test_persistent_save_into_a_full_disk_keeps_training(tmp_path):
    """The persistent save of iteration 4 fails with ENOSPC (every positional write of rank 0
    raises it: a full shared file system, simulated at the write calls; no tmpfs without root
    here): a warning, training goes on, iteration 2 stays intact and the tracker on it, no
    folder of 4, and 6 saves once space returns. --exit-on-save-failure stops at 4 instead.
    Then another model (hidden 64, another run) pointed at that run's local tier starts from
    scratch after one line, before loading anything."""
    from megatron_ucp.format.manifest import read_manifest

    def argv(name, *extra):
        return BASE + ["--train-iters", "6", "--save", str(tmp_path / name), "--save-interval", "2",
                       "--local-ckpt-dir", str(tmp_path / f"{name}_local"), "--local-save-interval", "1",
                       *extra]

    results = run_steps(2, [
        {"name": "tolerant", "op": "train", "argv": argv("tolerant"), "disk_full_at": [4],
         "env": {"UCP_MAPPED_WRITES": "0"}},
        {"name": "strict", "op": "train", "argv": argv("strict", "--exit-on-save-failure"),
         "disk_full_at": [4], "fatal": False},
        # another model pointed at the tolerant run's tier (left at iterations 3, 5): one line, from scratch
        {"name": "other_model", "op": "train", "fatal": False,
         "argv": _with(BASE, "--hidden-size", "64") + [
             "--train-iters", "1", "--local-ckpt-dir", str(tmp_path / "tolerant_local"),
             "--local-save-interval", "100"]},
    ], tmp_path, allow_failure=True)
    r = ok(results, "tolerant")
    assert sorted(int(k) for k in r["losses"]) == list(range(1, 7))
    assert "warning: persistent save failed, training goes on" in r["stdout"]
    assert "No space left on device" in r["stdout"]
    folders = sorted(p.name for p in (tmp_path / "tolerant").iterdir() if p.name.startswith("iter_"))
    assert folders == ["iter_0000002", "iter_0000006"], folders
    assert not [p for p in (tmp_path / "tolerant").iterdir() if p.name.startswith(".")
                and p.is_dir()], "a failed save left a temporary folder"
    assert (tmp_path / "tolerant" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert read_manifest(str(tmp_path / "tolerant" / "iter_0000002")).iteration == 2
    strict = results["strict"]
    assert "error" in strict and "No space left on device" in strict["error"], strict
    assert (tmp_path / "strict" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (tmp_path / "strict" / "iter_0000004").exists()
    other = ok(results, "other_model")
    assert list(other["losses"]) == ["1"], other
    line = [x for x in other["stdout"].splitlines() if "local checkpoint tier: local iteration 5 not used" in x]
    assert len(line) == 1 and "COMPLETE: another job's (job " in line[0], other["stdout"]
    assert "training from scratch" in line[0], line


def test_piece_checksum_is_over_every_byte(tmp_path):
    """A piece's sidecar CRC covers header and data: a flipped byte anywhere is refused."""
    import numpy as np

    from megatron_ucp.errors import IntegrityError
    from megatron_ucp.format import local_piece
    from megatron_ucp.format.layout import Region

    data = local_piece.encode([("w", Region("", (0, 0), (2, 3), 1, 5))],
                              [{"param": np.arange(4, dtype=np.float32)}], {"iteration": 3})
    local_piece.write_piece(str(tmp_path), 3, 1, data)
    meta, regions = local_piece.decode(local_piece.read_piece(str(tmp_path), 3, 1, len(data), zlib.crc32(data)), "p")
    assert meta["iteration"] == 3 and regions[0][1] == Region("", (0, 0), (2, 3), 1, 5)
    assert regions[0][2]["param"].tolist() == [0, 1, 2, 3]
    path = Path(local_piece.piece_path(str(tmp_path), 3, 1))
    for at in (3, len(data) - 1):
        raw = bytearray(data)
        raw[at] ^= 1
        path.write_bytes(bytes(raw))
        with pytest.raises(IntegrityError, match=f"{path}: CRC-32 {zlib.crc32(bytes(raw)):08x}"):
            local_piece.read_piece(str(tmp_path), 3, 1, len(data), zlib.crc32(data))


def test_a_fifo_in_the_tier_is_a_bad_copy_not_a_hang(tmp_path):
    """A FIFO in place of a piece, its sidecar or a COMPLETE marker: the piece or sidecar is
    refused by name (the restart takes another copy), the marker's iteration not believed, and
    no read blocks (a FIFO without a writer would hang open() or read())."""
    import os

    import numpy as np

    from megatron_ucp.errors import IntegrityError
    from megatron_ucp.format import local_piece
    from megatron_ucp.format.layout import Region

    data = local_piece.encode([("w", Region("", (0,), (4,), 0, 4))], [{"param": np.zeros(4, np.float32)}], {})
    local_piece.write_piece(str(tmp_path), 3, 1, data, {"world": 2, "job": None})
    local_piece.mark_complete(str(tmp_path), 3, 2)
    path = Path(local_piece.piece_path(str(tmp_path), 3, 1))
    from megatron_ucp.errors import FormatError

    side = path.with_suffix(".json")
    readers = {path: lambda: local_piece.read_header(str(path)),
               side: lambda: local_piece.sidecar(str(tmp_path), 3, 1)}
    for victim, read in readers.items():
        saved = victim.read_bytes()
        victim.unlink()
        os.mkfifo(victim)
        with pytest.raises(FormatError, match=f"{victim} is a FIFO, expected a regular file"):
            read()
        if victim == path:
            with pytest.raises(IntegrityError, match=f"{path}: unreadable .*is a FIFO, expected a regular file"):
                local_piece.read_piece(str(tmp_path), 3, 1, len(data), zlib.crc32(data))
        victim.unlink()
        victim.write_bytes(saved)
    assert local_piece.sidecar(str(tmp_path), 3, 1)["bytes"] == len(data)
    marker = tmp_path / "iter_0000003" / local_piece.COMPLETE
    marker.unlink()
    os.mkfifo(marker)
    assert local_piece.complete_iterations(str(tmp_path)) == {}
    assert "is a FIFO" in local_piece.markers(str(tmp_path))[3][1]


def test_free_space_check_refuses_with_numbers(tmp_path, monkeypatch):
    """A node dir without room for 3 iterations of its pieces and replicas: one line with the
    numbers; with room: nothing."""
    import collections
    import types

    from megatron_ucp.engine import local_tier
    from megatron_ucp.errors import ConfigError

    tier = types.SimpleNamespace(leader=True, node_dir=str(tmp_path / "n0"), host="n0", root=str(tmp_path),
                                 hosts=["n0", "n0", "n1", "n1"], replicas=1, job={"id": "a", "run": "b"})
    usage = collections.namedtuple("usage", "total used free")
    gib = 2**30
    monkeypatch.setattr(local_tier.shutil, "disk_usage", lambda path: usage(0, 0, 5 * gib))
    local_tier._check_space(tier, [gib // 4] * 4)  # 3 x (0.5 + 0.5) GiB = 3 GiB <= 5
    with pytest.raises(ConfigError) as e:
        local_tier._check_space(tier, [gib] * 4)  # 3 x (2 + 2) GiB = 12 GiB > 5
    message = str(e.value)
    assert "\n" not in message
    for text in ("needs 12.00 GiB on n0", "3 iterations x (2.00 GiB of its 2 ranks' pieces + 2.00 GiB of "
                 "replicas)", "5.00 GiB are free", str(tmp_path / "n0")):
        assert text in message, message


def test_check_loss_sets_a_bad_local_iteration_aside(tmp_path):
    """--local-ckpt-check-loss: a NaN first loss after a local restore removes the iteration's
    COMPLETE marker and stops with one error; a finite one keeps it."""
    import argparse
    import math
    import types

    import torch.distributed as dist

    from harness import free_port
    from megatron_ucp.errors import IntegrityError
    from megatron_ucp.format import local_piece
    from megatron_ucp.train import loop

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        for loss, kept in ((1.5, True), (math.nan, False)):
            node = tmp_path / str(kept) / "n0"
            (node / "iter_0000006").mkdir(parents=True)
            local_piece.mark_complete(str(node), 6, 4)
            tier = types.SimpleNamespace(leader=True, node_dir=str(node), group=None, restored=6)
            args = argparse.Namespace(local_ckpt_check_loss=True, local_ckpt_dir=str(node.parent))
            if kept:
                loop._check_restored_loss(args, tier, loss)
            else:
                with pytest.raises(IntegrityError, match="first loss after restoring local iteration 6 is nan"):
                    loop._check_restored_loss(args, tier, loss)
            assert local_piece.complete_iterations(str(node)) == ({6: 4} if kept else {})
            assert tier.restored is None  # checked once, after the first iteration only
    finally:
        dist.destroy_process_group()


def _forge(local: Path, node: str, rank: int, data: bytes, **sidecar) -> None:
    """`data` as `node`'s copy of `rank`'s piece of 6, with a sidecar that matches it (size and
    CRC-32): what a hostile or mistaken copy looks like to the restore."""
    path = _piece(local, node, rank)
    path.write_bytes(data)
    side = path.with_suffix(".json")
    record = dict(json.loads(side.read_text()), bytes=len(data), crc32=zlib.crc32(data), **sidecar)
    side.write_text(json.dumps(record))


def _without_a_region(data: bytes) -> bytes:
    from megatron_ucp.format import local_piece

    meta, regions = local_piece.decode(data, "piece")
    kept = regions[:-1]
    return local_piece.encode([(n, r) for n, r, _ in kept], [s for _, _, s in kept], meta)


def _complete_says_world_1(local: Path) -> None:
    for node in ("node0", "node1"):
        marker = local / node / "iter_0000006" / "COMPLETE"
        marker.write_text(json.dumps(dict(json.loads(marker.read_text()), world=1)))


def _sparse_with_lying_sidecar(local: Path) -> None:
    path = _piece(local, "node0", 0)
    with open(path, "r+b") as f:
        f.truncate(3 * 2**30)
    side = path.with_suffix(".json")  # a sidecar consistent with the size it claims
    side.write_text(json.dumps(dict(json.loads(side.read_text()), bytes=3 * 2**30, chunk_bytes=2**30,
                                    chunk_crc32=[0, 0, 0])))


# damage to the killed job's tiers -> (restored from: 6 = the other node's sound copies, 5 = the
# persistent checkpoint, 0 = a new job: from scratch), text the one line names
HOSTILE = {
    "swapped": (lambda local: _forge(local, "node0", 1, _piece(local, "node0", 0).read_bytes()), 6,
                "node0/iter_0000006/rank_00001.safetensors: records rank 0, expected 1"),
    "other_iteration": (lambda local: _forge(local, "node0", 1, _piece(local, "node0", 1, 4).read_bytes(),
                                             iteration=6), 6,
                        "node0/iter_0000006/rank_00001.safetensors: records iteration 4, expected 6"),
    "sparse": (_sparse_with_lying_sidecar, 6, "node0/iter_0000006/rank_00000.safetensors: 3221225472 bytes, "
               "its regions make"),
    "world_1": (_complete_says_world_1, 5, "records world 4, expected 1"),
    "dropped": (lambda local: [_forge(local, n, 1, _without_a_region(_piece(local, n, 1).read_bytes()))
                               for n in ("node0", "node1")], 5, "its pieces do not cover the tensors"),
}


def test_hostile_copies_are_named_and_never_used(crashed, tmp_path):
    """Issue 47: copies that name another slot (with matching CRCs), a sparse 3 GiB piece whose
    sidecar says so, a COMPLETE marker that shrinks the world (with --no-load-rng), a region
    dropped from both copies, and a new job on an old job's tier. Each restart (one group of 2
    processes on node0 and node1, the job's tiers copied per case) names the bad copy in one line
    and restores from the sound copy on the other node, or the persistent checkpoint, with the
    uninterrupted run's losses: before, each took the copy and trained on half-zero or foreign
    state ("restored iteration 6")."""
    ref, job = crashed
    steps = []
    for name, (damage, _, _) in HOSTILE.items():
        root = tmp_path / name
        shutil.copytree(job / "ckpt", root / "ckpt")
        shutil.copytree(job / "local", root / "local")
        damage(root / "local")
        steps.append({"name": name, "op": "train", "hosts": ["node0", "node1"], "fatal": False,
                      "argv": _argv(root, local_interval=100, save=False) + ["--no-load-rng"]})
    new = tmp_path / "new_job"  # its own --save, no checkpoint yet, the old job's tier
    shutil.copytree(job / "local", new / "local")
    steps.append({"name": "new_job", "op": "train", "hosts": ["node0", "node1"], "fatal": False,
                  "argv": _with(_argv(new, iters=3, local_interval=100), "--save-interval", "100")})
    results = run_steps(2, steps, tmp_path, allow_failure=True)
    wrong = {}  # every case judged, so that a failure lists each case that failed
    for name, (_, start, named) in HOSTILE.items():
        r = results.get(name, {})
        resumed = {int(k): v for k, v in r.get("losses", {}).items()}
        lines = [x for x in r.get("stdout", "").splitlines() if "local checkpoint tier:" in x and "iteration 6" in x]
        if "error" in r or not resumed or min(resumed) != start + 1 or max_loss_delta(ref, resumed) > 1e-4:
            wrong[name] = (f"resumed {sorted(resumed)[:1]}, expected {start + 1}", r.get("error"), lines)
        elif not (len(lines) == 1 and named in lines[0]):
            wrong[name] = ("line", lines)
    r = results.get("new_job", {})  # a fresh start on another layout: its own initialisation
    lines = [x for x in r.get("stdout", "").splitlines() if "local checkpoint tier: local iteration 6 not used" in x]
    if sorted(int(k) for k in r.get("losses", {})) != [1, 2, 3] or len(lines) != 1 or "another job's" not in lines[0]:
        wrong["new_job"] = (sorted(r.get("losses", {})), r.get("error"), lines)
    assert not wrong, wrong
