"""`export-torch-dist` from and `convert` into an object store (moto on 127.0.0.1,
tests/s3_server.py), each against the same command on local disk.

One small run (1 process, 2 steps, distributed optimizer) saves a universal checkpoint on disk;
it is uploaded object for file. export-torch-dist to TP2 reads it from s3:// (ranged GETs) and
writes into s3:// (staged, uploaded, the tracker last), and from the folder into a folder; the
torch_dist in the store (downloaded into a staging folder) and the one on disk convert back to
the same bytes. The one in the store is converted into s3:// too (staged, then store_save's
protocol): its objects are the on-disk conversion's bytes, and a load from the store gives the
state that was exported.
Slow: a training run, two exports and three conversions in subprocesses (about 40-70 s here).
"""

from pathlib import Path

import pytest

pytest.importorskip("boto3", reason="the s3-tests extra (run.sh setup installs it)")
pytest.importorskip("moto", reason="the s3-tests extra (run.sh setup installs it)")

from harness import assert_same_state, ok, run_steps, train_step  # noqa: E402
from s3_server import s3_endpoint  # noqa: E402

BUCKET = "convert"
TP2 = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
ITER = 2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """(work folder, moto client): a universal checkpoint at iteration ITER on disk (A) and in
    the store (s3://BUCKET/A)."""
    work = tmp_path_factory.mktemp("store_convert")
    ok(run_steps(1, [train_step("a", ["--use-distributed-optimizer"], iters=ITER, save=str(work / "A"),
                                interval=ITER)], work / "run"), "a")
    with s3_endpoint() as (_url, _faults, env), pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        import boto3

        client = boto3.client("s3", endpoint_url=env["UCP_TEST_MOTO_URL"])
        client.create_bucket(Bucket=BUCKET)
        for f in (work / "A").rglob("*"):
            if f.is_file() and not f.name.startswith("."):
                client.upload_file(str(f), BUCKET, f"A/{f.relative_to(work / 'A').as_posix()}")
        yield work, client


def _cli(argv) -> None:
    from megatron_ucp.cli import main

    assert main(argv) == 0, argv


def _objects(client, prefix: str) -> dict:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for o in page.get("Contents", ()):
            out[o["Key"][len(prefix) + 1:]] = client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
    return out


def _files(folder: Path) -> dict:
    return {f.relative_to(folder).as_posix(): f.read_bytes() for f in folder.rglob("*")
            if f.is_file() and not f.name.startswith(".")}


def _same_conversion(a: Path, b: Path) -> None:
    """Two conversions of torch_dist checkpoints of the same state: every file bitwise, but the
    manifests' stored training arguments where they name the folders the exports wrote to."""
    import json

    fa, fb = _files(a), _files(b)
    name = f"iter_{ITER:07d}/ucp.json"
    ma, mb = json.loads(fa.pop(name)), json.loads(fb.pop(name))
    assert fa == fb
    args_a, args_b = ma.pop("args"), mb.pop("args")
    assert ma == mb
    differ = {k for k in set(args_a) | set(args_b) if args_a.get(k) != args_b.get(k)}
    assert all(isinstance(args_a.get(k), str) and "ucp-staging-" in args_a[k] for k in differ), \
        {k: (args_a.get(k), args_b.get(k)) for k in differ}


def test_export_torch_dist_from_the_store_into_it_and_convert_back(work, tmp_path):
    work, client = work
    staging = tmp_path / "staging"
    staging.mkdir()
    # store to store: the workers load by ranged GETs, write torch_dist into the staging folder, uploaded
    _cli(["export-torch-dist", f"s3://{BUCKET}/A", f"s3://{BUCKET}/T", "--staging-dir", str(staging), "--", *TP2])
    assert not list(staging.iterdir())
    _cli(["export-torch-dist", str(work / "A"), str(tmp_path / "T_disk"), "--", *TP2])
    it = f"iter_{ITER:07d}"
    exported = _objects(client, "T")
    assert exported["latest_checkpointed_iteration.txt"] == (tmp_path / "T_disk" / "latest_checkpointed_iteration.txt").read_bytes()
    assert {k: len(v) for k, v in exported.items() if not k.endswith(".metadata")} == \
        {k: len(v) for k, v in _files(tmp_path / "T_disk").items() if not k.endswith(".metadata")}
    # back to universal: the torch_dist in the store (downloaded: the tracked iteration) and on disk
    _cli(["convert", "--input", f"s3://{BUCKET}/T", "--output", str(tmp_path / "U_T_s3"), "--no-proof",
          "--no-progress", "--staging-dir", str(staging)])
    _cli(["convert", "--input", str(tmp_path / "T_disk"), "--output", str(tmp_path / "U_T_disk"),
          "--no-proof", "--no-progress"])
    assert not list(staging.iterdir())
    _same_conversion(tmp_path / "U_T_s3", tmp_path / "U_T_disk")
    assert_same_state(tmp_path / "U_T_s3" / it, work / "A" / it)  # of the exported state

    _cli(["convert", "--input", f"s3://{BUCKET}/T", "--output", f"s3://{BUCKET}/U", "--no-proof",
          "--no-progress", "--staging-dir", str(staging)])
    assert _objects(client, "U") == _files(tmp_path / "U_T_s3")  # bitwise the conversion on disk of the same input
    assert not list(staging.iterdir())

    from megatron_ucp.format.store_inspection import verify

    assert verify(f"s3://{BUCKET}/U") == []
    # the conversion in the store exports again (a load by ranged GETs on another layout)
    _cli(["export-torch-dist", f"s3://{BUCKET}/U", str(tmp_path / "T2"), "--", "--use-distributed-optimizer"])
    _cli(["convert", "--input", str(tmp_path / "T2"), "--output", str(tmp_path / "U2"), "--no-proof", "--no-progress"])
    assert_same_state(tmp_path / "U2" / it, work / "A" / it)
