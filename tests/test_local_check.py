"""The local tier's checks of a node's pieces (engine/local_check.py, issue 47): one process,
one pretended node holding a job's iterations 4 and 6 saved by 2 ranks, each hostile copy the
issue found taken silently. Every case must leave iteration 6 (named, one line) and restore 4:
nothing of another slot or job is used and no missing region loads as zeros."""

import json
import os
import shutil
import time
import types
import zlib
from pathlib import Path

import numpy as np
import pytest

from megatron_ucp.engine import local_check, local_plan
from megatron_ucp.errors import FormatError
from megatron_ucp.format import local_piece
from megatron_ucp.format.layout import Region
from megatron_ucp.format.tensor_entry import TensorEntry

JOB = {"id": "a1", "run": "r1"}
OTHER = {"id": "b2", "run": "r1"}
SHAPES = {"a": (4, 3), "b": (5,)}
# rank 0: rows 0-1 of a and all of b; rank 1: rows 2-3 of a
SHARES = {0: [("a", Region("", (0, 0), (2, 3), 0, 6)), ("b", Region("", (0,), (5,), 0, 5))],
          1: [("a", Region("", (2, 0), (2, 3), 0, 6))]}


def _head():
    return {"tensors": {n: TensorEntry.new(n, s, False, 0, ("param",)).to_json() for n, s in SHAPES.items()}}


def _encode(iteration, rank, job=JOB, world=2, items=None):
    items = SHARES[rank] if items is None else items
    arrays = [{"param": np.full(r.numel, 10 * iteration + rank, np.float32)} for _, r in items]
    meta = {"iteration": iteration, "rank": rank, "world": world, "job": job}
    if rank == 0:
        meta["head"] = _head()
    return local_piece.encode(items, arrays, meta)


def _save(node: Path, iteration, job=JOB, world=2):
    """What the tier writes for one iteration on a node holding every rank's piece."""
    assert local_piece.prepare(str(node), iteration, job) is None
    for rank in range(world):
        local_piece.write_piece(str(node), iteration, rank, _encode(iteration, rank, job, world),
                                {"world": world, "job": job})
    local_piece.mark_complete(str(node), iteration, world, job)


def _forge(node: Path, iteration, rank, data, **sidecar):
    """A piece with a sidecar that matches it (size, CRC-32), as a hostile copy would have."""
    path = Path(local_piece.piece_path(str(node), iteration, rank))
    path.write_bytes(data)
    record = {"rank": rank, "iteration": iteration, "world": 2, "job": JOB, "bytes": len(data),
              "crc32": zlib.crc32(data), **sidecar}
    path.with_suffix(".json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist

    from harness import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _restore_choice(node: Path, newer_than=-1):
    """The restore's inventory and choice on this one node (local_restore._choose)."""
    from megatron_ucp.engine import local_restore

    tier = types.SimpleNamespace(leader=True, node_dir=str(node), host="n0", job=JOB, group=None)
    found = [local_restore.inventory(str(node), "n0", JOB)]
    return local_restore._choose(tier, found, newer_than)


@pytest.fixture
def node(tmp_path):
    n = tmp_path / "n0"
    _save(n, 4)
    _save(n, 6)
    return n


def _other_job_folder(node: Path) -> Path:
    other = node.parent / "other"
    _save(other, 6, OTHER)
    return other / "iter_0000006"


CASES = {
    "rank 0's piece under rank 1's name": (
        lambda n: _forge(n, 6, 1, _encode(6, 0)), "rank_00001.safetensors: records rank 0, expected 1"),
    "rank 1's piece from iteration 4": (
        lambda n: _forge(n, 6, 1, _encode(4, 1)), "rank_00001.safetensors: records iteration 4, expected 6"),
    "another job's piece": (
        lambda n: _forge(n, 6, 1, _encode(6, 1, OTHER)), "rank_00001.safetensors: another job's piece (job b2"),
    "another job's sidecar": (
        lambda n: _forge(n, 6, 1, _encode(6, 1), job=OTHER), "rank_00001.json: another job's piece (job b2"),
    "one region dropped": (
        lambda n: _forge(n, 6, 0, _encode(6, 0, items=SHARES[0][:1])),
        "local iteration 6 not used: its pieces do not cover the tensors (1 part(s); e.g. b part '': none of"),
    "half a region dropped": (
        lambda n: _forge(n, 6, 1, _encode(6, 1, items=[("a", Region("", (2, 0), (2, 3), 0, 4))])),
        "do not cover the tensors (1 part(s); e.g. a part '': elements [10, 12) missing)"),
    "a region twice": (
        lambda n: _forge(n, 6, 1, _encode(6, 1, items=SHARES[1] + SHARES[0][:1])),
        "a part '': elements from 0 held twice"),
    "iteration folder symlinked to another job's": (
        lambda n: (shutil.rmtree(n / "iter_0000006"), os.symlink(_other_job_folder(n), n / "iter_0000006")),
        "iter_0000006 is a symbolic link"),
    "COMPLETE says world 1": (
        lambda n: (n / "iter_0000006" / "COMPLETE").write_text(json.dumps({"world": 1, "job": JOB})),
        "rank_00000.json: records world 2, expected 1"),
    "COMPLETE says world 100000000": (
        lambda n: (n / "iter_0000006" / "COMPLETE").write_text('{"world": 100000000}'),
        "COMPLETE: 'world' is 100000000, expected an integer >= 1 and <= 131072"),
    "COMPLETE of another job": (
        lambda n: (n / "iter_0000006" / "COMPLETE").write_text(json.dumps({"world": 2, "job": OTHER})),
        "iter_0000006/COMPLETE: another job's (job b2, this job is a1)"),
    "a region of a tensor the manifest lacks": (
        lambda n: _forge(n, 6, 1, _encode(6, 1, items=[("zz", Region("", (2, 0), (2, 3), 0, 6))])),
        "rank_00001.safetensors: region of tensor 'zz', which the manifest head lacks"),
    "a region of a part the manifest lacks": (
        lambda n: _forge(n, 6, 1, _encode(6, 1, items=[("a", Region("padding", (2, 0), (2, 3), 0, 6))])),
        "rank_00001.safetensors: region of part 'padding' of a, which the manifest head lacks"),
    "a region outside its tensor": (
        lambda n: _forge(n, 6, 1, _encode(6, 1, items=[("a", Region("", (3, 0), (2, 3), 0, 6))])),
        "rank_00001.safetensors: region of a part '': box offset [3, 0] shape [2, 3] outside the tensor's [4, 3]"),
    "a rank beyond the world": (
        lambda n: (_forge(n, 6, 0, _encode(6, 0, world=1), world=1),
                   (n / "iter_0000006" / "COMPLETE").write_text(json.dumps({"world": 1, "job": JOB}))),
        "do not cover the tensors (1 part(s); e.g. a part '': elements [6, 12) missing)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_copy_is_named_and_never_used(group, node, case):
    damage, named = CASES[case]
    assert _restore_choice(node)[0].iteration == 6  # sound: the newest
    damage(node)
    choice, held = _restore_choice(node)
    assert choice.iteration == 4, (case, choice.notes)
    line = "; ".join(choice.notes)
    assert named in line, line
    assert "\n" not in line
    assert sorted(held) == [0, 1]
    for rank, digest in held.items():  # what is restored is iteration 4's own pieces, their headers checked
        meta, _, _, _, found = local_piece.read_header(local_piece.piece_path(str(node), 4, rank))
        assert (meta["iteration"], meta["rank"], meta["job"], found) == (4, rank, JOB, digest)


def test_a_lying_sidecar_does_not_make_a_sparse_file_read(group, node, monkeypatch):
    """A 3 GiB sparse piece whose sidecar claims 3 GiB (and its CRC): refused from its header
    (its regions make a few hundred bytes), its data never read."""
    path = Path(local_piece.piece_path(str(node), 6, 1))
    data = _encode(6, 1)
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(3 * 2**30)
    record = json.loads(path.with_suffix(".json").read_text())
    path.with_suffix(".json").write_text(json.dumps(dict(record, bytes=3 * 2**30, chunk_bytes=2**30,
                                                         chunk_crc32=[0, 0, 0])))
    reads, original, chunked = [], local_piece.read_bounded, local_piece.read_chunks
    monkeypatch.setattr(local_piece, "read_bounded", lambda p, *a: reads.append(p) or original(p, *a))
    monkeypatch.setattr(local_piece, "read_chunks", lambda fd, p, *a: reads.append(p) or chunked(fd, p, *a))
    checked = local_piece.check_chunks  # a mapped piece's data is checked through it (piece_reads, the sender)
    monkeypatch.setattr(local_piece, "check_chunks", lambda d, p, *a: reads.append(p) or checked(d, p, *a))
    start = time.perf_counter()
    choice, _ = _restore_choice(node)
    assert choice.iteration == 4 and time.perf_counter() - start < 10
    assert f"{path}: 3221225472 bytes, its regions make {len(data)} and its sidecar says 3221225472 (not read)" \
        in choice.notes[0], choice.notes
    assert str(path) not in reads


def test_a_newer_iteration_of_another_job_is_named_once_and_never_used(group, node):
    _save(node, 8, OTHER)
    choice, _ = _restore_choice(node)
    assert choice.iteration == 6
    assert choice.notes == [f"local iteration 8 not used: {node}/iter_0000008/COMPLETE: another job's "
                            "(job b2, this job is a1)"]
    # the same --save folder's id with other run arguments (e.g. another --lr) is not this run
    _save(node, 10, {"id": "a1", "run": "r2"})
    choice, _ = _restore_choice(node)
    assert choice.iteration == 6 and "this job's id with other run arguments (digest r2, this run's r1)" \
        in choice.notes[0]


def test_a_huge_world_in_a_marker_builds_nothing_per_rank():
    """A marker's world is believed only as far as the pieces the nodes list (choose), one line."""
    copies = tuple(local_plan.Copy("n0", r, 10) for r in range(2))
    found = [[local_plan.Iteration(6, 100_000, copies), local_plan.Iteration(4, 2, copies)]]
    start = time.perf_counter()
    choice = local_plan.choose(found, newer_than=-1)
    assert choice.iteration == 4 and time.perf_counter() - start < 0.5
    assert choice.notes == ["local iteration 6: its COMPLETE marker says 100000 ranks saved, the nodes hold "
                            "pieces of 2"]


def test_copies_that_differ_keep_the_one_that_completes_the_tensors():
    """Rank 1's copy on n0 lost a region (CRC-32 recomputed); n1's is whole: n1's is kept. Only
    one copy of each distinct header carries its regions to the check."""
    carried = {(0, "h0"): (tuple((n, r, ("param",)) for n, r in SHARES[0]), _head()),
               (1, "h1"): (tuple((n, r, ("param",)) for n, r in SHARES[1]), None),
               (1, "torn"): ((), None), (1, "torn2"): ((), None)}

    def seen(host, rank, digest, crc):
        return local_check.Seen(host, rank, f"{host}/rank_{rank}", crc, digest)

    whole = [seen(h, r, f"h{r}", 7 + r) for h in ("n0", "n1") for r in (0, 1)]
    assert local_check.carriers(whole) == {("n0", 0), ("n0", 1)}
    assert local_check.vet(whole, carried) == ([], None)
    torn = [s for s in whole if not (s.host == "n0" and s.rank == 1)] + [seen("n0", 1, "torn", 99)]
    assert local_check.carriers(torn) == {("n0", 0), ("n0", 1), ("n1", 1)}
    bad, problem = local_check.vet(torn, carried)
    assert problem is None and bad == [("n0", 1, "n0/rank_1: differs from the copy on n1 and leaves the "
                                                 "tensors incomplete")]
    both = [s for s in torn if not (s.host == "n1" and s.rank == 1)] + [seen("n1", 1, "torn2", 98)]
    bad, problem = local_check.vet(both, carried)  # neither completes: both copies bad, named
    assert {(h, r) for h, r, _ in bad} == {("n0", 1), ("n1", 1)} and problem is None
    same_header = whole[:3] + [seen("n1", 1, "h1", 5)]  # equal regions, other data: undecidable
    bad, _ = local_check.vet(same_header, carried)
    assert {(h, r) for h, r, _ in bad} == {("n0", 1), ("n1", 1)} and "none can be told sound" in bad[0][2]


def test_piece_layout_is_the_file_size_and_refuses_a_lying_table(tmp_path):
    data = _encode(6, 0)
    path = tmp_path / "p.safetensors"
    path.write_bytes(data)
    meta, table, n, size, _ = local_piece.read_header(str(path))
    regions, expected = local_check.piece_layout(meta, table, n, str(path))
    assert expected == size == len(data) and [r for _, r, _ in regions] == [r for _, r in SHARES[0]]
    table["0.param"]["shape"] = [7]
    with pytest.raises(FormatError, match=r"p.safetensors: tensor '0.param' is .*expected F32 of shape \[6\]"):
        local_check.piece_layout(meta, table, n, str(path))
    with pytest.raises(FormatError, match="region 0 is .*expected"):
        local_check.piece_layout(dict(meta, regions=[["a", "", [0], [1, 2], 0, 1]]), {}, n, str(path))


def test_prune_removes_only_the_jobs_own_folders(tmp_path):
    """The tier's prune, with a persistent checkpoint and another job's iteration in its dir:
    only this job's marked folders older than the two kept go."""
    node = tmp_path / "n0"
    (node / "iter_0000003").mkdir(parents=True)  # a persistent checkpoint (--save inside the dir)
    (node / "iter_0000003" / "ucp.json").write_text("{}")
    _save(node, 1, OTHER)
    for it in (2, 4, 6):
        _save(node, it)
    local_piece.prune(str(node), 2, JOB)
    assert sorted(p.name for p in node.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000001", "iter_0000003", "iter_0000004", "iter_0000006"]
    # a save over another job's folder of the same iteration leaves it alone, with why
    assert "is not this job's" in local_piece.prepare(str(node), 1, JOB)
    assert "is not this job's" in local_piece.prepare(str(node), 3, JOB)
    assert local_piece.prepare(str(node), 6, JOB) is None  # this job's older attempt: replaced
    assert sorted(p.name for p in (node / "iter_0000006").iterdir()) == [local_piece.MARK]


def test_job_id_is_made_once_and_read_back(tmp_path):
    first = local_piece.job_id(str(tmp_path / "save"), create=True)
    assert first and local_piece.job_id(str(tmp_path / "save"), create=True) == first
    assert local_piece.job_id(str(tmp_path / "save"), create=False) == first
    assert local_piece.job_id(str(tmp_path / "none"), create=False) is None
    (tmp_path / "save" / local_piece.JOB_FILE).write_text('{"id": "../x"}')
    with pytest.raises(FormatError, match=f"{local_piece.JOB_FILE}: job id '../x', expected"):
        local_piece.job_id(str(tmp_path / "save"), create=False)


def _tier(root, **kw):
    return types.SimpleNamespace(leader=True, root=str(root), node_dir=os.path.join(str(root), "n0"), host="n0",
                                 hosts=["n0"], replicas=0, job=JOB, **kw)


def test_an_unusable_tier_dir_is_one_line_at_start(tmp_path, monkeypatch):
    """--local-ckpt-dir a regular file, /dev/null, or read-only: a ConfigError naming it, not an
    OSError traceback from the space check."""
    import errno

    from megatron_ucp.engine import local_tier
    from megatron_ucp.errors import ConfigError

    (tmp_path / "file").write_text("x")
    for root in (tmp_path / "file", Path("/dev/null")):
        with pytest.raises(ConfigError, match=f"--local-ckpt-dir {root}: cannot use {root}/n0 .*expected a "
                                              "writable folder"):
            local_tier._check_space(_tier(root), [1])

    def read_only(path, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(local_tier.os, "makedirs", read_only)
    with pytest.raises(ConfigError, match="cannot use .*Read-only file system"):
        local_tier._check_space(_tier(tmp_path / "ro"), [1])


def test_two_live_jobs_on_one_tier_dir_are_refused(tmp_path):
    """A node dir held by a live process of another job is refused as a --save folder is."""
    import socket

    from megatron_ucp.engine import local_tier, ownership
    from megatron_ucp.errors import SaveError

    tier = _tier(tmp_path)
    os.makedirs(tier.node_dir)
    live = os.getppid()  # a live process that is not this one
    (Path(tier.node_dir) / ownership.OWNER).write_text(json.dumps(
        {"job": "another", "host": socket.gethostname(), "pid": live, "start": ownership.process_start(live)}))
    with pytest.raises(SaveError, match=f"{tier.node_dir} is being written by another job .*use another "
                                        "--local-ckpt-dir folder"):
        local_tier._check_space(tier, [1])


def test_save_and_tier_dirs_are_kept_apart(tmp_path):
    """--save inside the tier's dir (the tier would prune it) or the tier inside --save: refused
    at start, in the own loop's validation and in Megatron-LM's flags (the plug-in's adopt)."""
    import argparse

    from megatron_ucp.errors import ConfigError
    from megatron_ucp.mcore.flag_validation import check_tier_apart
    from megatron_ucp.megatron_lm import local_tier as plugin

    local = tmp_path / "L"
    for save, where in ((local / "n0", "is inside"), (local, "is"), (tmp_path, "holds")):
        with pytest.raises(ConfigError, match=f"--save {save} {where} --local-ckpt-dir {local}: "):
            check_tier_apart(str(save), str(local))
    check_tier_apart(str(tmp_path / "ckpt"), str(local))
    check_tier_apart(str(tmp_path / "L2"), str(local))  # a shared prefix is not nesting
    from megatron_ucp.mcore.flag_validation import validate_local_tier

    own = argparse.Namespace(local_ckpt_dir=str(local), local_save_interval=2, local_ckpt_replicas=1,
                             ckpt_format="universal", save=str(local / "n0"))
    with pytest.raises(ConfigError, match=f"--save {local / 'n0'} is inside --local-ckpt-dir {local}: "):
        validate_local_tier(own)  # the own loop's validation
    args = argparse.Namespace(non_persistent_ckpt_type="local", ckpt_format="universal",
                              non_persistent_local_ckpt_dir=str(local), non_persistent_save_interval=2,
                              save=str(local / "n0"), replication=False, replication_factor=2)
    with pytest.raises(ConfigError, match="is inside --non-persistent-local-ckpt-dir"):
        plugin.adopt(args)


def test_a_piece_must_still_hold_the_header_that_was_checked(tmp_path):
    """The data read after the check must carry the checked header (a piece replaced between
    the two reads, CRC and all, is refused by name)."""
    from megatron_ucp.errors import IntegrityError

    _save(tmp_path, 6)
    path = local_piece.piece_path(str(tmp_path), 6, 1)
    digest = local_piece.read_header(path)[4]
    data = Path(path).read_bytes()
    assert local_piece.read_piece(str(tmp_path), 6, 1, len(data), zlib.crc32(data), digest) == data
    with pytest.raises(IntegrityError, match=f"{path}: its header changed after it was checked"):
        local_piece.read_piece(str(tmp_path), 6, 1, len(data), zlib.crc32(data), "0" * 64)

