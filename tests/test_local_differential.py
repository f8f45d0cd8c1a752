"""The local tier against the persistent tier (issue 46): a rank's state after a restore from
the local tier is bitwise its state after a restore of the same iteration from the persistent
checkpoint: weights, main params, Adam's moments and step, param groups, scheduler, RNG,
iteration, consumed samples and the next batch's tokens.

One save run per source layout writes both tiers at iteration K (the local save at K, the final
persistent save at K); then per target world size one process group restores each target both
ways, each as its restart does (model built by the restart, tests/runner.py `restore_both`),
and compares in memory. The vocabulary (307 rows, padded to a multiple of 128 x TP) pads to 384
rows at TP1 and 512 at TP2: a restart must build the padding of the checkpoint it restores (its
padding rows take part in the softmax).

Both trainers: the own loop (megatron-core 0.16, tests/runner.py), and Megatron-LM's trainer
through the plug-in (megatron-core >= 0.17, tests/mlm_restore_probe.py, below). The default
suite runs a few pairs that cover each dimension; the fuller matrix is marked slow (the own
loop's took 169 s, the trainer's 455 s on this shared 2-core machine; the default part 3 to 4
minutes).
"""

from pathlib import Path

import pytest

from harness import BASE, ok, run_steps

K = 3
VOCAB = ["--vocab-size", "307", "--make-vocab-size-divisible-by", "128", "--lr-decay-style", "cosine",
         "--lr-warmup-iters", "1", "--lr-decay-iters", "20"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
VPP = PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]
DIST = ["--use-distributed-optimizer"]
SP = ["--sequence-parallel"]  # megatron trains MoE with TP only with it
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear"]
EP2 = ["--expert-model-parallel-size", "2"]
BF16 = ["--bf16"]


def _base(model):
    return BASE + VOCAB + model


def save_step(name, root: Path, model, layout):
    """Train to K on `layout`, saving both tiers at K."""
    return {"name": f"save_{name}", "op": "train",
            "argv": _base(model) + layout + ["--train-iters", str(K), "--save", str(root / name / "persistent"),
                                             "--local-ckpt-dir", str(root / name / "local"),
                                             "--local-save-interval", str(K)]}


def restore_step(source, root: Path, model, layout):
    """Restore `source`'s iteration K on `layout` from each tier; compare."""
    common = _base(model) + layout + ["--train-iters", str(K + 1)]
    return {"name": f"{source}->{' '.join(layout) or 'one process'}", "op": "restore_both", "fatal": False,
            # --save names the job whose tier it is (local_tier.job_identity); no --load: the
            # local iteration K is the newest the restart knows of
            "local_argv": common + ["--local-ckpt-dir", str(root / source / "local"),
                                    "--local-save-interval", "1000", "--save", str(root / source / "persistent")],
            "persistent_argv": common + ["--load", str(root / source / "persistent")]}


def check(results: dict, name: str) -> dict:
    r = ok(results, name)
    for rank, held in enumerate(r["ranks"]):
        assert held["local_restored"] == K, f"{name}: rank {rank} did not restore iteration {K} from the local tier"
        assert held["iteration"] == K and held["keys"] > 20, (name, rank, held)
        assert not held["differences"], \
            f"{name}: rank {rank}: local and persistent restores differ: {held['differences']}"
    return r


# (source name, model flags, saving layout, world size)
SOURCES = {
    "pp2": ([], PP2, 2),
    "tp2pp2_dist": ([], TP2 + PP2 + DIST, 4),
    "moe_ep2_tp2": (MOE, TP2 + SP + EP2 + DIST, 4),
}
# target world size -> [(source, layout)]; one process group per world size.
ELASTIC = ["--elastic"] + TP2 + PP2 + DIST  # asks for TP2 x PP2; --elastic fits one process
TARGETS = {
    1: [("tp2pp2_dist", []), ("tp2pp2_dist", ELASTIC)],
    2: [("pp2", PP2), ("tp2pp2_dist", PP2), ("tp2pp2_dist", DIST), ("tp2pp2_dist", VPP), ("moe_ep2_tp2", EP2 + DIST)],
}
SLOW_SOURCES = {
    "tp1": ([], [], 1),
    "pp2_vpp_dp2_dist": ([], VPP + DIST, 4),
    "dp2_bf16_dist": (BF16, DIST, 2),
    "moe_ep2_pp2": (MOE, EP2 + PP2, 4),
}
SLOW_TARGETS = {
    1: [("tp1", []), ("pp2_vpp_dp2_dist", []), ("dp2_bf16_dist", []), ("moe_ep2_pp2", []), ("moe_ep2_tp2", [])],
    2: [("tp2pp2_dist", TP2), ("tp1", TP2), ("tp1", PP2 + DIST), ("pp2_vpp_dp2_dist", TP2), ("pp2_vpp_dp2_dist", VPP),
        ("dp2_bf16_dist", TP2), ("dp2_bf16_dist", PP2 + DIST), ("moe_ep2_pp2", EP2), ("moe_ep2_pp2", PP2),
        ("moe_ep2_tp2", TP2 + SP + EP2 + ["--expert-tensor-parallel-size", "1"])],
    4: [("tp2pp2_dist", TP2 + PP2 + DIST), ("tp2pp2_dist", ["--tensor-model-parallel-size", "4"]),
        ("pp2_vpp_dp2_dist", TP2 + DIST), ("dp2_bf16_dist", TP2 + PP2),
        ("moe_ep2_tp2", ["--expert-model-parallel-size", "4"]), ("moe_ep2_pp2", TP2 + SP + EP2 + DIST)],
}


def _saved(root: Path, sources: dict) -> None:
    """One process group per saving world size."""
    by_world = {}
    for name, (model, layout, world) in sources.items():
        by_world.setdefault(world, []).append(save_step(name, root, model, layout))
    for world, steps in sorted(by_world.items()):
        results = run_steps(world, steps, root / f"save{world}")
        for step in steps:
            ok(results, step["name"])


def _restored(root: Path, sources: dict, targets: dict, extra=None) -> dict:
    """Every target's comparison, one process group per world size (plus the `extra` steps
    {world: [step]} in that group); returns the results of all steps."""
    failures, everything = [], {}
    for world in sorted(set(targets) | set(extra or {})):
        pairs = targets.get(world, [])
        steps = [restore_step(source, root, sources[source][0], layout) for source, layout in pairs]
        results = run_steps(world, steps + (extra or {}).get(world, []), root / f"restore{world}")
        everything.update(results)
        for step in steps:
            try:
                check(results, step["name"])
            except AssertionError as e:
                failures.append(str(e).splitlines()[0])
    assert not failures, "\n".join(failures)
    return everything


def _corrupt_copy(root: Path, source: str) -> Path:
    """`source`'s local tier with one byte of rank 0's piece flipped (its only copy: one node)."""
    import shutil

    copy = root / f"{source}_corrupt"
    shutil.copytree(root / source / "local", copy)
    (piece,) = copy.glob(f"*/iter_{K:07d}/rank_00000.safetensors")
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 0x40
    piece.write_bytes(bytes(data))
    return copy


def _same_job(root: Path, source: str, name: str) -> Path:
    """A save folder of `source`'s job: its job id (local_piece.JOB_FILE) copied there, so that
    a run saving into it restores `source`'s local tier (local_tier.job_identity)."""
    import shutil

    from megatron_ucp.format.local_piece import JOB_FILE

    folder = root / name
    folder.mkdir(exist_ok=True)
    shutil.copy(root / source / "persistent" / JOB_FILE, folder / JOB_FILE)
    return folder


def _unrecorded_copy(root: Path, source: str) -> Path:
    """`source`'s local tier with COMPLETE markers that record no padded vocabulary (as an
    older release wrote them)."""
    import json
    import shutil

    copy = root / f"{source}_unrecorded"
    shutil.copytree(root / source / "local", copy)
    for marker in copy.glob("*/iter_*/COMPLETE"):
        record = json.loads(marker.read_text())
        record.pop("padded_vocab_size")
        marker.write_text(json.dumps(record))
    return copy


def _new_node_step(root: Path, source: str, layout, hosts) -> dict:
    """A restore of `source` on `layout` whose ranks pretend to run on `hosts`, from a copy of
    its tier held by node0 alone: the other nodes are new and receive what they read."""
    import shutil

    copy = root / f"{source}_on_node0"
    if not copy.exists():
        (saved,) = (root / source / "local").iterdir()
        shutil.copytree(saved, copy / "node0")
    step = restore_step(source, root, SOURCES[source][0], layout)
    step["name"] += f" on {'+'.join(hosts)}"
    step["hosts"] = hosts
    step["local_argv"] = [str(copy) if a == str(root / source / "local") else a for a in step["local_argv"]]
    return step


def _received_only_what_is_read(r: dict, hosts, overlapping=False) -> None:
    """Issue 48: each node that lacked pieces received exactly the bytes its ranks read of them,
    each once (with overlapping reads on a node: fewer than its ranks read together); node0,
    which held every piece, nothing."""
    by_rank = [held["pieces"] for held in r["ranks"]]
    for rank, (host, pieces) in enumerate(zip(hosts, by_rank)):
        if host == "node0":
            assert pieces["received"] == pieces.get("needed", 0) == pieces.get("headers", 0) == 0, (rank, pieces)
        else:  # the whole-piece path received more than the node's ranks read
            read = sum(sum(p["read"].values()) for h, p in zip(hosts, by_rank) if h == host)
            assert pieces["received"] < read if overlapping else pieces["received"] <= read, (rank, pieces, read)
            assert pieces["received"] == pieces["needed"] > 0 and pieces["headers"] > 0, (rank, pieces)


def test_local_restore_is_the_persistent_restore(tmp_path):
    """The default suite's pairs: PP2 to itself (each rank reads its own piece alone), TP1 (one
    process, also as --elastic chooses it), PP2, DP2 with
    the distributed optimizer and VPP from TP2 x PP2 (distributed optimizer); MoE EP2 x TP2 to EP2 x DP2 (TP2 targets:
    in Megatron-LM's trainer below, and in the slow matrix). And the restore's guard: a local
    iteration whose markers do not say its padded vocabulary (512 rows) while the restart built
    384 is not loaded (one line; here no persistent checkpoint: training from scratch).
    """
    _saved(tmp_path, SOURCES)
    unrecorded = _unrecorded_copy(tmp_path, "tp2pp2_dist")
    guard_save = _same_job(tmp_path, "tp2pp2_dist", "guard_save")  # the tier is this job's
    guard = {"name": "guard", "op": "train", "argv": _base([]) + [
        "--train-iters", "1", "--local-ckpt-dir", str(unrecorded), "--local-save-interval", "1000",
        "--save", str(guard_save)]}
    # The fallback: a persistent checkpoint of 384 rows at K - 1 (TP1), and a local iteration K
    # recorded at 512 rows whose only copy of rank 0's piece is corrupt.
    corrupt = _corrupt_copy(tmp_path, "tp2pp2_dist")
    older = str(_same_job(tmp_path, "tp2pp2_dist", "tp1_older"))
    fallback = [{"name": "older", "op": "train", "argv": _base([]) + ["--train-iters", str(K - 1), "--save", older]},
                {"name": "fallback", "op": "train", "argv": _base([]) + [
                    "--train-iters", str(K), "--load", older, "--local-ckpt-dir", str(corrupt),
                    "--local-save-interval", "1000"]}]
    # issue 48: new nodes receive only what their ranks read, each byte once per node: PP2 on two
    # nodes; TP2 x DP2 read per rank on two nodes of two (node1's TP ranks both read the norms)
    new_node = _new_node_step(tmp_path, "tp2pp2_dist", PP2, ["node0", "node1"])
    per_rank = _new_node_step(tmp_path, "tp2pp2_dist", TP2 + ["--ckpt-read-policy", "per-rank"],
                              ["node0", "node0", "node1", "node1"])
    results = _restored(tmp_path, SOURCES, TARGETS, extra={1: [guard] + fallback, 2: [new_node], 4: [per_rank]})
    _same_layout_reads_its_own_piece(tmp_path, ok(results, "pp2->" + " ".join(PP2)))
    _received_only_what_is_read(check(results, new_node["name"]), new_node["hosts"])
    _received_only_what_is_read(check(results, per_rank["name"]), per_rank["hosts"], overlapping=True)
    out = ok(results, "guard")
    assert list(out["losses"]) == ["1"], out["losses"]
    lines = [x for x in out["stdout"].splitlines() if "local checkpoint tier: iteration" in x]
    assert len(lines) == 1, out["stdout"]
    assert (f"iteration {K} was saved by another model (padded vocabulary: checkpoint 512 rows, model 384; "
            "a restart restoring it builds 512" in lines[0]), lines[0]
    assert "falling back to the persistent checkpoint (none yet: training from scratch)" in lines[0]
    out = ok(results, "fallback")
    assert list(out["losses"]) == [str(K)], out["losses"]
    assert " keeping local iteration 3's padded vocabulary of 512 rows (instead of 384)" in out["stdout"]
    assert "falling back to the persistent checkpoint (iteration 2)" in out["stdout"]
    assert (" WARNING: the model was built with the local tier's padded vocabulary of 512 rows, but the "
            "persistent checkpoint it falls back to has 384" in out["stdout"]), out["stdout"]


def _same_layout_reads_its_own_piece(root: Path, restored: dict) -> None:
    """Issue 48's fast path: restored on the saving layout (PP2), each rank read its own piece,
    all of its data, and of the other pieces only what it holds and did not own at the save:
    the last stage's copy of the tied embedding (the first stage's piece holds it); nothing was
    received (one node)."""
    import json
    import struct

    def data_bytes(rank, tensor=""):
        (piece,) = (root / "pp2" / "local").glob(f"*/iter_{K:07d}/rank_{rank:05d}.safetensors")
        with open(piece, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            table = json.loads(f.read(n))
        regions = json.loads(table.pop("__metadata__")["ucp_local"])["regions"]
        return sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in table.items()
                   if tensor in regions[int(k.split(".")[0])][0])

    tied = data_bytes(0, "word_embeddings")
    assert tied > 0
    want = [{"0": data_bytes(0)}, {"1": data_bytes(1), "0": tied}]
    for rank, held in enumerate(restored["ranks"]):
        assert held["pieces"] == {"received": 0, "read": want[rank], "needed": 0, "headers": 0}, \
            (rank, held["pieces"], want[rank])


@pytest.mark.slow
def test_local_restore_is_the_persistent_restore_matrix(tmp_path):
    """More sources (TP1, PP2 x VPP x DP2, bf16 DP2, MoE EP2 x PP2) and targets (TP4, EP4, the
    saving layouts themselves)."""
    sources = {**SOURCES, **SLOW_SOURCES}
    _saved(tmp_path, sources)
    _restored(tmp_path, sources, SLOW_TARGETS)


def test_markers_record_the_padded_vocabulary(tmp_path):
    """The COMPLETE marker records the saving model's padded vocabulary; the nodes' records
    agree or say nothing (local_plan.padded_vocab_of); a re-choice keeps them (mark_bad)."""
    from megatron_ucp.engine import local_plan
    from megatron_ucp.format import local_piece

    for iteration, padded in ((4, 512), (6, None)):
        (tmp_path / f"iter_{iteration:07d}").mkdir()
        local_piece.mark_complete(str(tmp_path), iteration, 2, padded_vocab_size=padded)
    assert local_piece.marked_padded_vocab(str(tmp_path), 4) == 512
    assert local_piece.marked_padded_vocab(str(tmp_path), 6) is None  # an older release's marker
    assert local_piece.marked_padded_vocab(str(tmp_path), 8) is None  # none
    assert local_piece.complete_iterations(str(tmp_path)) == {4: 2, 6: 2}

    def node(host, padded):
        return [local_plan.Iteration(4, 1, (local_plan.Copy(host, 0, 10),), padded_vocab=padded)]

    assert local_plan.padded_vocab_of([node("a", 512), node("b", 512)], 4) == 512
    assert local_plan.padded_vocab_of([node("a", 512), node("b", 384)], 4) is None
    assert local_plan.padded_vocab_of([node("a", 512)], 6) is None
    marked = local_plan.mark_bad([node("a", 512)], [("a", 4, 0, "CRC")])
    assert marked[0][0].padded_vocab == 512 and marked[0][0].copies[0].bad == "CRC"


# -- Megatron-LM's trainer through the plug-in (megatron-core >= 0.17): the same comparison in
# one torchrun group per target world size (tests/mlm_restore_probe.py). NullTokenizer's 307
# entries pad to 384 rows at TP1, 512 at TP2. --

MLM_VOCAB = ["--vocab-size", "307", "--make-vocab-size-divisible-by", "128", "--ckpt-format", "universal",
             "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--lr-decay-iters", "20"]
MLM_SOURCES = {"tp2pp2_dist": ([], TP2 + PP2 + DIST, 4)}
MLM_TARGETS = {1: [("tp2pp2_dist", []), ("tp2pp2_dist", ELASTIC)],
               2: [("tp2pp2_dist", PP2), ("tp2pp2_dist", DIST), ("tp2pp2_dist", TP2)]}
MLM_SLOW_SOURCES = {"pp2_vpp_dp2_dist": ([], PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"] + DIST, 4),
                    "moe_ep2_tp2": (MOE[:-1] + ["--disable-bias-linear"], TP2 + SP + EP2 + DIST, 4)}
MLM_SLOW_TARGETS = {
    1: [("pp2_vpp_dp2_dist", []), ("moe_ep2_tp2", [])],
    2: [("pp2_vpp_dp2_dist", TP2), ("tp2pp2_dist", PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]),
        ("moe_ep2_tp2", EP2 + DIST), ("moe_ep2_tp2", PP2)],
    4: [("tp2pp2_dist", TP2 + PP2 + DIST), ("moe_ep2_tp2", ["--expert-model-parallel-size", "4"])],
}


def _mlm_saved(python, root: Path, sources: dict) -> None:
    """Per source one trainer run to K: the local save at K (non-persistent interval K), the
    final persistent save at K."""
    from mlm_harness import run

    for name, (model, layout, world) in sources.items():
        run(python, root / name / "run", world, model + layout + MLM_VOCAB + [
            "--save", str(root / name / "persistent"), "--save-interval", "1000",
            "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(root / name / "local"),
            "--non-persistent-save-interval", str(K)], K).check()


def _mlm_restored(python, root: Path, sources: dict, targets: dict) -> None:
    import json
    import os

    import launch
    from harness import REPO
    from mlm_harness import BASE as MLM_BASE

    failures = []
    for world, pairs in sorted(targets.items()):
        work = root / f"mlm_restore{world}"
        (work / "empty").mkdir(parents=True)
        spec = {"result": str(work / "result.json"), "pairs": []}
        for source, layout in pairs:
            # the scheduler's weight-decay span follows --train-iters: the checkpoint's is kept
            common = MLM_BASE + ["--cpu"] + sources[source][0] + layout + MLM_VOCAB + [
                "--train-iters", str(K + 1), "--use-checkpoint-opt_param-scheduler"]
            spec["pairs"].append({
                "name": f"{source}->{' '.join(layout) or 'one process'}",
                # --load of a folder without a checkpoint but with the saving job's id
                # (local_tier.job_identity): the local iteration K is the newest it knows of
                "local": common + ["--load", str(_same_job(root, source, f"mlm_empty{world}_{source}")),
                                   "--non-persistent-ckpt-type", "local",
                                   "--non-persistent-local-ckpt-dir", str(root / source / "local"),
                                   "--non-persistent-save-interval", "1000"],
                "persistent": common + ["--load", str(root / source / "persistent")]})
        (work / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), UCP_INLINE_HASH_BYTES="1",
                   UCP_PROBE_SPEC=str(work / "spec.json"))
        proc = launch.start(python, world, ["-m", "megatron_ucp.megatron_lm", "--cpu",
                                            str(REPO / "tests" / "mlm_restore_probe.py")],
                            env, work, 900, (work / "result.json").exists)
        output = proc.stdout + proc.stderr
        results = json.loads((work / "result.json").read_text()) if (work / "result.json").exists() else {}
        for pair in spec["pairs"]:
            r = results.get(pair["name"])
            if r is None or "error" in r:
                why = r["error"] + r["traceback"] if r else "did not run"
                failures.append(f"{pair['name']}: {why}\n{output[-3000:]}")
                continue
            for rank, held in enumerate(r["ranks"]):
                if held["iteration"] != K or held["keys"] <= 20:
                    failures.append(f"{pair['name']}: rank {rank}: {held}")
                elif held["differences"]:
                    failures.append(f"{pair['name']}: rank {rank}: local and persistent restores differ: "
                                    f"{held['differences']}")
        restored = output.count(f"local checkpoint tier: restored iteration {K} ")
        if restored != len(pairs):
            failures.append(f"world {world}: {restored} restores from the local tier, expected {len(pairs)}")
    assert not failures, "\n".join(failures)


def test_local_restore_is_the_persistent_restore_in_megatron_lms_trainer(tmp_path):
    """From TP2 x PP2 (distributed optimizer) into one process (also as --elastic chooses it),
    PP2, DP2 (distributed optimizer) and TP2."""
    from mlm_harness import trainer_python

    python = trainer_python()
    _mlm_saved(python, tmp_path, MLM_SOURCES)
    _mlm_restored(python, tmp_path, MLM_SOURCES, MLM_TARGETS)


@pytest.mark.slow
def test_local_restore_is_the_persistent_restore_in_megatron_lms_trainer_matrix(tmp_path):
    """More sources (PP2 x VPP x DP2, MoE EP2 x TP2) and targets (VPP, EP2, EP4, the saving layout)."""
    from mlm_harness import trainer_python

    python = trainer_python()
    sources = {**MLM_SOURCES, **MLM_SLOW_SOURCES}
    _mlm_saved(python, tmp_path, sources)
    _mlm_restored(python, tmp_path, sources, MLM_SLOW_TARGETS)


def test_a_fallback_to_another_padding_is_one_warning(monkeypatch):
    """The local tier fell back to a persistent checkpoint whose padded vocabulary a restart
    keeps but the model (built for the local iteration) lacks: one line with both sizes; none
    where the sizes agree or the new TP size does not divide the saved one."""
    from megatron_ucp.engine import local_restore

    monkeypatch.setattr(local_restore, "padded_vocab", lambda model: 384)
    tp = {"size": 1}
    monkeypatch.setattr(local_restore.parallel_state, "get_tensor_model_parallel_world_size", lambda: tp["size"])
    note = local_restore.fallback_padding_note(None, 307, 512)
    assert note.startswith("WARNING: the model was built with the local tier's padded vocabulary of 384 rows, "
                           "but the persistent checkpoint it falls back to has 512") and "\n" not in note, note
    assert local_restore.fallback_padding_note(None, 307, 384) is None
    assert local_restore.fallback_padding_note(None, 307, None) is None  # not recorded: nothing to keep
    tp["size"] = 3  # 512 does not divide over TP3: a restart pads anew too
    assert local_restore.fallback_padding_note(None, 307, 512) is None
