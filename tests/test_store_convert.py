"""`export-torch-dist` from and `convert` into an object store (moto on 127.0.0.1,
tests/s3_server.py), each against the same command on local disk.

One small run (1 process, 2 steps, distributed optimizer) saves a universal checkpoint on disk;
it is uploaded object for file. export-torch-dist to TP2 reads it from s3:// (ranged GETs) and
from the folder; both torch_dist checkpoints are converted back on disk and hold the same bits.
One of them is converted into s3:// too (staged, then store_save's protocol): its objects are the
on-disk conversion's bytes, and a load from the store gives the state that was exported.
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


def test_export_torch_dist_from_the_store_and_convert_into_it(work, tmp_path):
    work, client = work
    _cli(["export-torch-dist", f"s3://{BUCKET}/A", str(tmp_path / "T_s3"), "--", *TP2])
    _cli(["export-torch-dist", str(work / "A"), str(tmp_path / "T_disk"), "--", *TP2])
    it = f"iter_{ITER:07d}"
    for name in ("T_s3", "T_disk"):  # back to universal on disk: the two exports hold the same state
        _cli(["convert", "--input", str(tmp_path / name), "--output", str(tmp_path / f"U_{name}"),
              "--no-proof", "--no-progress"])
    assert_same_state(tmp_path / "U_T_s3" / it, tmp_path / "U_T_disk" / it)
    assert_same_state(tmp_path / "U_T_s3" / it, work / "A" / it)  # and the exported one

    staging = tmp_path / "staging"
    staging.mkdir()
    _cli(["convert", "--input", str(tmp_path / "T_s3"), "--output", f"s3://{BUCKET}/U", "--no-proof",
          "--no-progress", "--staging-dir", str(staging)])
    assert _objects(client, "U") == _files(tmp_path / "U_T_s3")  # bitwise the on-disk conversion's
    assert not list(staging.iterdir())

    from megatron_ucp.format.store_inspection import verify

    assert verify(f"s3://{BUCKET}/U") == []
    # the conversion in the store exports again (a load by ranged GETs on another layout)
    _cli(["export-torch-dist", f"s3://{BUCKET}/U", str(tmp_path / "T2"), "--", "--use-distributed-optimizer"])
    _cli(["convert", "--input", str(tmp_path / "T2"), "--output", str(tmp_path / "U2"), "--no-proof", "--no-progress"])
    assert_same_state(tmp_path / "U2" / it, work / "A" / it)
