"""Universal checkpoints in an object store (s3://), against a real S3 endpoint on 127.0.0.1
(moto's server behind a fault-injecting proxy: tests/s3_server.py), started here.

Two torchrun groups of 4 CPU ranks share everything: the first trains TP2 x PP2 saving to the
store, resumes on TP1 x DP4 from it, loads it once more reading once (bytes counted) and is
SIGKILLed in a save; the second resumes after the kill, resumes the same checkpoint from a
local copy, and loads damaged copies (missing, short, changed object; 503 SlowDown always).
"""


import importlib.util
import json

import numpy as np
import pytest

pytest.importorskip("boto3", reason="the s3-tests extra (run.sh setup installs it)")
pytest.importorskip("moto", reason="the s3-tests extra (run.sh setup installs it)")
# multi-storage-client (the msc extra) is installed with megatron-core 0.19 only: importing it
# under 0.16 breaks megatron's torch_dist writer processes late in a long process (run.sh)
HAVE_MSC = importlib.util.find_spec("multistorageclient") is not None
needs_msc = pytest.mark.skipif(not HAVE_MSC, reason="multi-storage-client (the msc extra; megatron-core 0.19 venv)")

from harness import BASE, losses, ok, run_steps  # noqa: E402
from s3_server import s3_endpoint  # noqa: E402

N, K = 10, 5
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DIST = ["--use-distributed-optimizer"]
BUCKET = "ucp"
A = f"s3://{BUCKET}/A"
MSC_PROFILE = "ucp-test"
FAULTS = ("missing", "short", "changed", "slowdown", "reset")  # reset: the body cut mid-object, every attempt


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with s3_endpoint() as (url, faults, env), pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        import boto3

        from botocore.config import Config

        # a Multi-Storage Client profile (as Megatron-LM's --enable-msc reads) over the same bucket
        config = tmp_path_factory.mktemp("msc") / "msc_config.json"
        config.write_text(json.dumps({"profiles": {MSC_PROFILE: {
            "storage_provider": {"type": "s3", "options": {"base_path": BUCKET, "endpoint_url": url,
                                                           "region_name": "us-east-1"}},
            "credentials_provider": {"type": "S3Credentials",
                                     "options": {"access_key": "testing", "secret_key": "testing"}},
            "retry": {"attempts": 2, "delay": 0.1}}}}))
        mp.setenv("MSC_CONFIG", str(config))

        # the tests' own changes go to moto directly (no faults, no proxy hop), many at once
        client = boto3.client("s3", endpoint_url=env["UCP_TEST_MOTO_URL"],
                              config=Config(max_pool_connections=16))
        client.create_bucket(Bucket=BUCKET)
        yield client, faults


def _objects(client, prefix: str) -> dict:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", ())})
    return out


def _train(name, extra, iters=N, save=None, interval=None, load=None, step=None):
    argv = BASE + extra + ["--train-iters", str(iters)]
    if save:
        argv += ["--save", save, "--save-interval", str(interval)]
    if load:
        argv += ["--load", load, "--load-universal"] + (["--ckpt-step", str(step)] if step is not None else [])
    return {"name": name, "op": "train", "argv": argv}


@pytest.fixture(scope="module")
def first(endpoint, tmp_path_factory):
    """Train TP2xPP2 to the store; resume on TP1xDP4; a read-once load counted; a save killed."""
    client, faults = endpoint
    work = tmp_path_factory.mktemp("s3_first")
    steps = [
        _train("a_tp2pp2", TP2PP2 + DIST, save=A, interval=K),
        _train("b_tp1dp4", DIST, load=A, step=K),
        {"name": "r_once", "op": "roundtrip", "argv": BASE + DIST + [
            "--train-iters", str(N), "--load", A, "--ckpt-step", str(K), "--ckpt-read-policy", "once"],
         "save_to": str(work / "R"), "env": {}},
        # rank 0 dies as it commits: every rank's files are uploaded, the manifest is not
        {"name": "kill", "op": "kill_during_save", "rank": 0, "function": "_commit", "after": 1,
         "argv": BASE + DIST + ["--train-iters", str(N), "--load", A, "--ckpt-step", str(N), "--save", A]},
    ]
    gets = faults.seen.get("GET", 0)
    results = run_steps(4, steps, work, allow_failure=True)
    killed = _objects(client, f"A/iter_{N + 1:07d}/")
    return results, killed, faults.seen.get("GET", 0) - gets


def _copy(client, src: str, dest: str) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    objects = _objects(client, src + "/")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: client.copy_object(Bucket=BUCKET, Key=dest + key[len(src):],
                                                     CopySource={"Bucket": BUCKET, "Key": key}), objects))
    return {dest + key[len(src):]: size for key, size in objects.items()}


def _damage(client, faults, kind: str) -> str:
    """A copy of A's iteration K under F_<kind>, its largest tensor object damaged; its path."""
    prefix = f"F_{kind}"
    copied = _copy(client, f"A/iter_{K:07d}", f"{prefix}/iter_{K:07d}")
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/latest_checkpointed_iteration.txt", Body=f"{K}\n".encode())
    key = max((k for k in copied if "/tensors/" in k), key=lambda k: copied[k])
    data = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    if kind == "missing":
        client.delete_object(Bucket=BUCKET, Key=key)
    elif kind == "short":
        client.put_object(Bucket=BUCKET, Key=key, Body=data[:-100])
    elif kind == "changed":  # same size, one byte of the last block changed after the manifest
        client.put_object(Bucket=BUCKET, Key=key, Body=data[:-7] + bytes([data[-7] ^ 0x40]) + data[-6:])
    elif kind == "slowdown":
        faults.add("GET", f"/{key}", "503")
    elif kind == "reset":
        faults.add("GET", f"/{key}", "cut")
    else:  # reset_served: the connection reset mid-object twice, fewer than the client's 3 attempts
        faults.add("GET", f"/{key}", "cut", 2)
    return f"s3://{BUCKET}/{key}"


@pytest.fixture(scope="module")
def second(endpoint, first, tmp_path_factory):
    """After the kill: resume from the store's tracker (and save again); the same resume from a
    local copy of the checkpoint; loads of damaged copies."""
    client, faults = endpoint
    work = tmp_path_factory.mktemp("s3_second")
    local = work / "A_local"
    for key in _objects(client, f"A/iter_{K:07d}/"):
        (local / key[len("A/"):]).parent.mkdir(parents=True, exist_ok=True)
        client.download_file(BUCKET, key, str(local / key[len("A/"):]))
    damaged = {kind: _damage(client, faults, kind) for kind in FAULTS + ("reset_served",)}
    steps = [
        _train("after_kill", DIST, iters=N + 2, save=A, interval=2, load=A),
        _train("b_disk", DIST, load=str(local), step=K),
        _train("b_reset_served", DIST, load=f"s3://{BUCKET}/F_reset_served", step=K),
    ] + ([_train("b_msc", DIST, load=f"msc://{MSC_PROFILE}/A", step=K)] if HAVE_MSC else []) + [  # through MSC
        {"name": f"e_{kind}", "op": "load_expecting_error",
          "argv": BASE + DIST + ["--train-iters", str(N), "--load", f"s3://{BUCKET}/F_{kind}", "--load-universal"]}
         for kind in FAULTS]
    results = run_steps(4, steps, work)
    served = "/" + damaged["reset_served"].split("/", 3)[3]  # s3://BUCKET/KEY -> /KEY, the rule's text
    cuts_left = [rule[3] for rule in faults.rules if rule[1] == served]
    faults.clear()
    return results, dict(damaged, cuts_left=cuts_left)


def test_tp2pp2_saved_to_s3_resumes_on_tp1dp4_with_the_same_losses(first, second):
    results, _, _ = first
    reference, resumed = losses(results, "a_tp2pp2"), losses(results, "b_tp1dp4")
    assert sorted(resumed) == list(range(K + 1, N + 1))
    # the state from the store is the state from disk: the same resume from a local copy of the
    # same objects trains the same losses, bitwise
    assert resumed == losses(second[0], "b_disk")
    if HAVE_MSC:
        assert resumed == losses(second[0], "b_msc")
    assert max(abs(reference[i] - resumed[i]) for i in resumed) <= 1e-6  # fp32 (1.2e-7 seen)


def test_read_once_from_s3_requests_each_byte_once(endpoint, first):
    client, _ = endpoint
    results, _, _ = first
    per_rank = ok(results, "r_once")["per_rank"]
    from megatron_ucp.format import manifest as mf
    from megatron_ucp.format.tensor_entry import file_layout

    m = mf.read_manifest(f"{A}/iter_{K:07d}")
    data = sum(file_layout(e).file_size - len(file_layout(e).header) for e in m.tensors.values())
    assert sum(r["read"] for r in per_rank) == data  # every byte requested once, nothing else
    assert all(r["hashed_after"] == 0 for r in per_rank)  # verified from the bytes read
    assert all(0 < r["read"] <= r["owned"] for r in per_rank) and not any(r["notes"] for r in per_rank)


def test_sigkill_during_a_save_to_s3_leaves_the_previous_checkpoint(endpoint, first, second):
    client, _ = endpoint
    results, killed, _ = first
    assert "survived" not in results.get("kill", {})
    assert any("/tensors/" in k for k in killed) and f"A/iter_{N + 1:07d}/ucp.json" not in killed
    ok(second[0], "after_kill")
    out = ok(second[0], "after_kill")["stdout"]
    assert f"iteration {N}" in out.split("resumed", 1)[1].splitlines()[0], out[-2000:]
    after = _objects(client, "A/")
    # the next save removed the dead save's objects, committed its own, moved the tracker
    assert not any(k.startswith(f"A/iter_{N + 1:07d}/") for k in after)
    assert f"A/iter_{N + 2:07d}/ucp.json" in after
    tracker = client.get_object(Bucket=BUCKET, Key="A/latest_checkpointed_iteration.txt")["Body"].read()
    assert tracker.strip() == str(N + 2).encode()


@pytest.mark.parametrize("kind", FAULTS)
def test_a_faulty_store_is_one_line_naming_the_object(second, kind):
    results, damaged = second
    raised = ok(results, f"e_{kind}").get("raised")
    assert raised, f"the load of a {kind} object succeeded"
    for message in raised:
        assert "\n" not in message and damaged[kind] in message, message
    expected = {"missing": "missing", "short": "truncated", "changed": "crc32", "slowdown": "SlowDown",
                "reset": "failed after 3 attempts"}[kind]
    assert expected in raised[0], raised[0]


def test_a_connection_reset_mid_object_is_retried_then_served(second):
    """The largest tensor object's body cut short twice during a training load: retried, and the
    resume is the local copy's to the bit."""
    results, damaged = second
    assert damaged["cuts_left"] == [0], damaged["cuts_left"]  # both cuts happened
    assert losses(results, "b_reset_served") == losses(results, "b_disk")


def test_the_store_retries_what_s3_clients_retry_then_names_the_object(endpoint, tmp_path, monkeypatch):
    """In this process: multipart upload; 503 SlowDown and a body cut mid-object retried, then
    one line naming the object; a missing object; a ranged read past a short object's end."""
    from megatron_ucp.errors import IncompleteCheckpointError, IntegrityError, StorageError
    from megatron_ucp.format.s3_store import S3Store

    client, faults = endpoint
    monkeypatch.setenv("UCP_S3_PART_BYTES", str(5 * 2**20))
    store = S3Store(BUCKET)
    big = tmp_path / "big"
    big.write_bytes(np.random.default_rng(0).bytes(11 * 2**20))
    posts = faults.seen.get("POST", 0)
    store.upload(f"s3://{BUCKET}/u/big", str(big))
    assert faults.seen["POST"] - posts == 2  # a multipart upload: created, completed
    assert store.head(f"s3://{BUCKET}/u/big", 8) == (big.read_bytes()[:8], big.stat().st_size)
    wanted = [(0, 10), (6 * 2**20, 6 * 2**20 + 100)]
    expected = [big.read_bytes()[lo:hi] for lo, hi in wanted]
    for kind in ("503", "cut"):
        faults.add("GET", "/u/big", kind, 2)  # fewer than the attempts: retried, then served
        assert store.read_ranges(f"s3://{BUCKET}/u/big", wanted) == expected
        faults.clear()
        faults.add("GET", "/u/big", kind)
        with pytest.raises(StorageError, match=f"s3://{BUCKET}/u/big: .*after 3 attempts"):
            store.read_ranges(f"s3://{BUCKET}/u/big", wanted)
        faults.clear()
    with pytest.raises(IncompleteCheckpointError, match=f"s3://{BUCKET}/u/nothing: object is missing"):
        store.read_ranges(f"s3://{BUCKET}/u/nothing", [(0, 1)])
    store.write(f"s3://{BUCKET}/u/small", b"0123456789")
    with pytest.raises(IntegrityError, match=f"s3://{BUCKET}/u/small: object ends at byte offset 10"):
        store.read_ranges(f"s3://{BUCKET}/u/small", [(4, 20)])
    assert store.head(f"s3://{BUCKET}/u/nothing", 8) is None


@needs_msc
def test_msc_store_reads_writes_lists_and_names_a_missing_object(endpoint, tmp_path):
    """msc://PROFILE/path through the Multi-Storage Client, over the loopback endpoint."""
    from megatron_ucp.errors import IncompleteCheckpointError, IntegrityError
    from megatron_ucp.format import stores

    path = f"msc://{MSC_PROFILE}/m/x"
    store = stores.store_for(path)
    store.write(path, b"0123456789")
    local = tmp_path / "f"
    local.write_bytes(b"abc" * 100)
    store.upload(f"msc://{MSC_PROFILE}/m/f", str(local))
    assert store.read_ranges(path, [(2, 4), (8, 10)]) == [b"23", b"89"]
    assert store.head(path, 3) == (b"012", 10) and store.read(path, 100, "x") == b"0123456789"
    assert store.list(f"msc://{MSC_PROFILE}/m") == [(f"msc://{MSC_PROFILE}/m/f", 300), (path, 10)]
    with pytest.raises(IntegrityError, match=f"{path}: object ends at byte offset 10"):
        store.read_ranges(path, [(8, 12)])
    store.delete([path])
    assert store.size(path) is None
    with pytest.raises(IncompleteCheckpointError, match=f"{path}: object is missing"):
        store.read_ranges(path, [(0, 1)])


@needs_msc
def test_msc_owner_record_is_read_back_at_the_next_save(endpoint):
    """The owner record on msc://: a second claim (the job's next save) reads the record back,
    with its age from the client's metadata (was os.path.getmtime of the URL: FileNotFoundError
    at the second save of every msc:// job); a fresh record of another job is refused."""
    from megatron_ucp.engine import ownership, store_owner
    from megatron_ucp.errors import SaveError
    from megatron_ucp.format import stores

    prefix = f"msc://{MSC_PROFILE}/owned"
    store_owner.claim(prefix)
    store_owner.claim(prefix)  # the next save
    record, _, age = stores.store_for(prefix).read_meta(f"{prefix}/{ownership.OWNER}", 1 << 16)
    assert json.loads(record)["pid"] == ownership.me()["pid"] and 0 <= age < 600
    other = dict(ownership.me(), job="another-job", host="elsewhere")  # fresh: not stale for an hour
    stores.store_for(prefix).write(f"{prefix}/{ownership.OWNER}", json.dumps(other).encode())
    with pytest.raises(SaveError, match="being written by another job .another-job"):
        store_owner.claim(prefix)
    stores.store_for(prefix).delete([f"{prefix}/{ownership.OWNER}"])


def test_a_missing_client_package_is_one_line(monkeypatch):
    """The package runs without the s3 extra; an s3:// path then names what to install."""
    import sys

    from megatron_ucp.errors import ConfigError
    from megatron_ucp.format import storage, stores

    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 raises ImportError
    monkeypatch.setattr(stores, "_STORES", {})
    with pytest.raises(ConfigError, match=r"^s3://nobucket: s3:// paths need the package 'boto3' "
                                          r"\(pip install boto3, or megatron-ucp\[s3\]\)$"):
        stores.store_for("s3://nobucket/x")
    assert not storage.is_remote("/tmp/s3:/x") and storage.scheme_of("msc://p/x") == "msc"


def test_prepare_and_keep_last_on_a_store(endpoint):
    """In this process: a save's preparation deletes what dead saves left (folders without a
    manifest, unfinished multipart uploads) and uncommits the iteration it saves again;
    --keep-last deletes older complete checkpoints, never the newest."""
    from megatron_ucp.engine import store_save
    from megatron_ucp.format import stores

    client, _ = endpoint
    root = f"s3://{BUCKET}/K"
    store = stores.store_for(root)
    for i in (1, 2, 3, 5):
        store.write(f"{root}/iter_{i:07d}/tensors/w.safetensors", b"w")
        if i != 5:
            store.write(f"{root}/iter_{i:07d}/ucp.json", b"{}")
    store.write(f"{root}/iter_{4:07d}/tensors/w.safetensors", b"dead")  # a killed save's
    client.create_multipart_upload(Bucket=BUCKET, Key=f"K/iter_{4:07d}/tensors/big.safetensors")
    assert store_save.prepare(store, root, 3) == 1 + 3  # the upload; iterations 3 (uncommitted), 4, 5
    left = set(_objects(client, "K/"))
    assert f"K/iter_{3:07d}/ucp.json" not in left and f"K/iter_{3:07d}/tensors/w.safetensors" not in left
    assert not any(k.startswith((f"K/iter_{4:07d}/", f"K/iter_{5:07d}/")) for k in left)
    assert not client.list_multipart_uploads(Bucket=BUCKET, Prefix="K/").get("Uploads")
    store.write(f"{root}/iter_{3:07d}/ucp.json", b"{}")
    assert store_save.prune(store, root, 1, newest=3) == [1, 2]
    assert set(_objects(client, "K/")) == {f"K/iter_{3:07d}/ucp.json", "K/.ucp_owner.json"}  # prepare claimed it


def test_inspect_verifies_a_checkpoint_in_the_store(second, capsys):
    """`megatron-ucp inspect s3://ROOT --verify --json` (the save root resolves through its
    tracker): of a checkpoint with one object changed after the manifest, that object is the
    one problem, named with its block; every other object verified sound."""
    from megatron_ucp.commands import inspect_checkpoint

    _, damaged = second
    assert inspect_checkpoint.main([f"s3://{BUCKET}/F_changed", "--verify", "--json"]) == 1
    out = capsys.readouterr()
    desc = json.loads(out.out)
    assert desc["iteration"] == K and desc["path"] == f"s3://{BUCKET}/F_changed/iter_{K:07d}"
    assert len(desc["problems"]) == 1 and desc["problems"][0].startswith(f"{damaged['changed']}: block 0 (bytes ")
    assert "has crc32" in desc["problems"][0] and "FAILED: 1 problem" in out.err


def test_coalescing_merges_close_runs_only():
    from megatron_ucp.engine.store_source import coalesce

    spans = [(100, 200), (0, 50), (210, 300), (1000, 1100)]
    assert coalesce(spans, 0) == [(0, 50), (100, 200), (210, 300), (1000, 1100)]  # exactly the runs
    assert coalesce(spans, 10) == [(0, 50), (100, 300), (1000, 1100)]
    assert coalesce(spans, 50) == [(0, 300), (1000, 1100)]


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear"]


@pytest.mark.slow
def test_moe_ep2_saved_to_s3_resumes_on_ep1(endpoint, tmp_path):
    """EP2 -> EP1 through the store (slow: a torchrun group of its own, 2 ranks): the resume
    proof finds every state digest of the saved checkpoint, and the losses follow the
    uninterrupted run within fp32 noise (1.2e-7 seen)."""
    root = f"s3://{BUCKET}/MOE"
    results = run_steps(2, [
        _train("a_ep2", MOE + DIST + ["--expert-model-parallel-size", "2"], save=root, interval=K),
        _train("b_ep1", MOE + DIST, load=root, step=K),
    ], tmp_path)
    reference, resumed = losses(results, "a_ep2"), losses(results, "b_ep1")
    assert sorted(resumed) == list(range(K + 1, N + 1))
    assert max(abs(reference[i] - resumed[i]) for i in resumed) <= 1e-6
    assert "resume proof passed" in ok(results, "b_ep1")["stdout"]


def test_one_job_owns_a_prefix_through_conditional_writes(endpoint, monkeypatch):
    """The owner record on a store: a second job is refused in one line naming the record; a
    writer holding an old version loses (If-Match), as does a second creator (If-None-Match);
    a record of another host not written for `stale_after` seconds is taken over; a clean
    release lets the next job in."""
    from megatron_ucp.engine import ownership, store_owner
    from megatron_ucp.errors import SaveError
    from megatron_ucp.format import stores

    root = f"s3://{BUCKET}/O"
    record = f"{root}/.ucp_owner.json"
    store = stores.store_for(root)
    monkeypatch.setattr(ownership, "_JOB_ID", "job-a")
    store_owner.claim(root)
    data, tag, _ = store.read_meta(record, 1 << 16)
    assert json.loads(data)["job"] == "job-a"
    assert not store.write_if(record, b"{}", None) and not store.write_if(record, b"{}", '"0123"')
    monkeypatch.setattr(ownership, "_JOB_ID", "job-b")
    with pytest.raises(SaveError, match=rf"^{root} is being written by another job \(job-a, .*delete {record}$"):
        store_owner.claim(root)
    assert store.write_if(record, json.dumps(dict(ownership.me(), job="job-a", host="elsewhere")).encode(), tag)
    said = []
    store_owner.claim(root, stale_after=0.0, announce=lambda line, **_: said.append(line))
    assert "taking over" in said[0] and "on another host" in said[0]
    store_owner.release(root)
    assert store.size(record) is None
