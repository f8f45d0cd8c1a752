"""The local tier in front of a persistent tier in an object store (the own loop, `--save
s3://...` with `--local-ckpt-dir`; moto on 127.0.0.1, tests/s3_server.py).

One job of 2 processes on 2 pretended nodes saves locally every 2 iterations and to the store
every 5, and is SIGKILLed after iteration 7 (the local save of 6 complete). A restart from
another working folder (as on another node) restores iteration 6 from the local tier: the
job's id is read from the store (before the fix it was written to a local folder named 's3:'
in the working folder, so that a restart elsewhere saw another job and fell back). A restart
whose local copies are gone loads iteration 5 from the store; both continue with the same
losses. Slow: three 2-process runs (about 60-90 s here).
"""

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("boto3", reason="the s3-tests extra (run.sh setup installs it)")
pytest.importorskip("moto", reason="the s3-tests extra (run.sh setup installs it)")

from harness import BASE, max_loss_delta, ok, run_steps  # noqa: E402
from s3_server import s3_endpoint  # noqa: E402

pytestmark = pytest.mark.slow

ITERS, LOCAL, PERSISTENT, KILL = 10, 2, 5, 7
BUCKET = "tier"
SAVE = f"s3://{BUCKET}/run"
HOSTS = ["node0", "node1"]


def _argv(root: Path, local_interval=LOCAL, save=True):
    argv = BASE + ["--elastic", "--train-iters", str(ITERS), "--load", SAVE,
                   "--local-ckpt-dir", str(root / "local"), "--local-save-interval", str(local_interval),
                   "--loss-log", str(root / "losses.jsonl")]
    return argv + (["--save", SAVE, "--save-interval", str(PERSISTENT)] if save else [])


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """(the killed job's folder, its logged losses by iteration, moto client)."""
    root = tmp_path_factory.mktemp("store_local_tier")
    with s3_endpoint() as (_url, _faults, env), pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        import boto3

        client = boto3.client("s3", endpoint_url=env["UCP_TEST_MOTO_URL"])
        client.create_bucket(Bucket=BUCKET)
        job = root / "job"
        complete = [str(job / "local" / node / "iter_0000006" / "COMPLETE") for node in HOSTS]
        run_steps(2, [{"name": "job", "op": "train", "argv": _argv(job), "kill_after": KILL,
                       "hosts": HOSTS, "wait_for": complete}], job, allow_failure=True)
        logged = {r["iteration"]: r["loss"] for r in map(json.loads, (job / "losses.jsonl").read_text().splitlines())}
        assert sorted(logged) == list(range(1, KILL + 1)), "the job was not killed after 7"
        tracker = client.get_object(Bucket=BUCKET, Key="run/latest_checkpointed_iteration.txt")["Body"].read()
        assert tracker.strip() == str(PERSISTENT).encode()
        yield job, logged, client


def _restart(job: Path, root: Path, keep_local: bool) -> dict:
    root.mkdir()
    if keep_local:
        shutil.copytree(job / "local", root / "local")
    result = run_steps(2, [{"name": "restart", "op": "train", "hosts": HOSTS,
                            "argv": _argv(root, local_interval=100, save=False)}], root)
    r = ok(result, "restart")
    return r, {int(k): v for k, v in r["losses"].items()}


def test_restarts_take_the_local_tier_then_the_store(crashed, tmp_path):
    job, logged, _ = crashed
    assert not (job / "s3:").exists(), "the job wrote its store prefix as a local folder"
    r, local = _restart(job, tmp_path / "elsewhere", keep_local=True)
    assert "restored iteration 6" in r["stdout"], r["stdout"]
    assert sorted(local) == list(range(7, ITERS + 1))
    r, stored = _restart(job, tmp_path / "no_local", keep_local=False)
    assert sorted(stored) == list(range(PERSISTENT + 1, ITERS + 1)), r["stdout"]
    assert max_loss_delta({i: logged[i] for i in (6, 7)}, {i: stored[i] for i in (6, 7)}) <= 1e-4
    assert max_loss_delta(local, {i: stored[i] for i in local}) <= 1e-6  # the two tiers, the same run
