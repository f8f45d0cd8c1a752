"""The plug-in's local tier in front of a persistent tier in an object store: Megatron-LM's trainer
with `--save s3://... --non-persistent-ckpt-type local` (moto on 127.0.0.1, tests/s3_server.py);
the own loop's version is tests/test_store_local_tier.py.

One job of 2 processes on 2 pretended nodes (--elastic, DP2) saves locally every iteration and
to the store every 5, and is SIGKILLed once iteration 7 is saved locally on both nodes. A
restart whose tier was copied to another folder (as on other nodes) restores the newest local
iteration, not the store's 5; a restart whose local copies are gone loads 5 from the store. The
restarts give the killed job's losses, and each other's, within fp32 1e-6. Slow: three 2-process
trainer runs.
"""

import shutil
from pathlib import Path

import pytest

pytest.importorskip("boto3", reason="the s3-tests extra (run.sh setup installs it)")
pytest.importorskip("moto", reason="the s3-tests extra (run.sh setup installs it)")

from mlm_harness import max_delta, run, trainer_python  # noqa: E402
from s3_server import s3_endpoint  # noqa: E402

pytestmark = pytest.mark.slow

N, PERSISTENT, KILL = 10, 5, 7
BUCKET = "tier"
STORE = f"s3://{BUCKET}/mlm"
HOSTS = ["node0", "node1"]
TOL = 1e-6  # fp32, the same layout: restoring either tier must not change the run


def _argv(local: Path, save: bool) -> list:
    """The job saves to the store every PERSISTENT and locally every iteration; a restart only
    loads (a save of its own at the end would put a newer iteration in the store)."""
    argv = ["--use-distributed-optimizer", "--ckpt-format", "universal", "--elastic", "--load", STORE,
            "--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", str(local),
            "--non-persistent-save-interval", "1" if save else "100"]
    return argv + (["--save", STORE, "--save-interval", str(PERSISTENT)] if save else [])


def _complete(local: Path) -> list:
    """The iterations saved completely on every node of the tier."""
    per_node = [{int(p.parent.name[len("iter_"):]) for p in (local / node).glob("iter_*/COMPLETE")} for node in HOSTS]
    return sorted(set.intersection(*per_node))


@pytest.fixture(scope="module")
def endpoint():
    with s3_endpoint() as (_url, _faults, env), pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        import boto3

        client = boto3.client("s3", endpoint_url=env["UCP_TEST_MOTO_URL"])
        client.create_bucket(Bucket=BUCKET)
        yield client


def test_restarts_take_the_local_tier_then_the_store(endpoint, tmp_path):
    python = trainer_python()
    local = tmp_path / "local"
    job = run(python, tmp_path / "job", 2, _argv(local, save=True), N, hosts=HOSTS,
              kill_when=lambda losses: KILL in losses and KILL in _complete(local))
    logged = job.losses()
    assert KILL <= max(logged) < N, f"the job was not killed after {KILL}: {sorted(logged)}\n{job.output[-4000:]}"
    assert not list((tmp_path / "job").glob("*:*")), "a store path was written as a local folder"
    endpoint.head_object(Bucket=BUCKET, Key="mlm/.ucp_local_job.json")  # the tier's job record, in the store
    tracker = endpoint.get_object(Bucket=BUCKET, Key="mlm/latest_checkpointed_iteration.txt")["Body"].read()
    assert tracker.strip() == str(PERSISTENT).encode()
    newest = max(_complete(local))
    assert newest >= KILL

    moved = tmp_path / "elsewhere" / "local"
    shutil.copytree(local, moved)
    r = run(python, tmp_path / "elsewhere", 2, _argv(moved, save=False), N, hosts=HOSTS).check()
    assert f"local checkpoint tier: restored iteration {newest}" in r.output, r.output[-4000:]
    restored = r.losses()
    assert sorted(restored) == list(range(newest + 1, N + 1))

    s = run(python, tmp_path / "no_local", 2, _argv(tmp_path / "no_local" / "local", save=False), N,
            hosts=HOSTS).check()
    assert f"successfully loaded universal checkpoint from {STORE} at iteration {PERSISTENT}" in s.output, \
        s.output[-4000:]
    assert "local checkpoint tier: restored" not in s.output
    stored = s.losses()
    assert sorted(stored) == list(range(PERSISTENT + 1, N + 1))
    both = range(PERSISTENT + 1, max(logged) + 1)
    deltas = {"store restart vs the job": max_delta(logged, stored, both),
              "local restart vs store restart": max_delta(stored, restored, range(newest + 1, N + 1))}
    if newest < max(logged):
        deltas["local restart vs the job"] = max_delta(logged, restored, range(newest + 1, max(logged) + 1))
    print(f"\nrestored local iteration {newest} (store: {PERSISTENT}); max |dloss| {deltas}")
    assert all(d <= TOL for d in deltas.values()), deltas
