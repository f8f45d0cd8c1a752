"""`--async-save` into an object store (the own loop; moto on 127.0.0.1, tests/s3_server.py):
the save's uploads and its commit run in the background thread over the checkpoint's own gloo
group (engine/store_save.py through save.AsyncSave), and what they commit resumes on another
layout with the losses of the saving run. Slow: one 2-process group training twice (about
30-50 s here)."""

import pytest

pytest.importorskip("boto3", reason="the s3-tests extra (run.sh setup installs it)")
pytest.importorskip("moto", reason="the s3-tests extra (run.sh setup installs it)")

from harness import losses, max_loss_delta, run_steps, train_step  # noqa: E402
from s3_server import s3_endpoint  # noqa: E402

pytestmark = pytest.mark.slow

BUCKET = "async"
SAVE = f"s3://{BUCKET}/run"


def test_async_save_to_the_store_resumes_on_another_layout(tmp_path, monkeypatch):
    from megatron_ucp.format.store_inspection import verify

    with s3_endpoint() as (_url, _faults, env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        import boto3

        client = boto3.client("s3", endpoint_url=env["UCP_TEST_MOTO_URL"])
        client.create_bucket(Bucket=BUCKET)
        saving = train_step("a", ["--tensor-model-parallel-size", "2", "--async-save"], iters=6, save=SAVE,
                            interval=2)
        resumed = train_step("b", ["--use-distributed-optimizer"], iters=6, load=SAVE, step=4)
        result = run_steps(2, [saving, resumed], tmp_path)
        a, b = losses(result, "a"), losses(result, "b")
        assert sorted(b) == [5, 6]
        assert max_loss_delta(a, b) <= 1e-4
        assert client.get_object(Bucket=BUCKET, Key="run/latest_checkpointed_iteration.txt")["Body"].read() == b"6\n"
        for it in (2, 4, 6):
            assert verify(f"{SAVE}/iter_{it:07d}") == [], it
        monkeypatch.undo()
