"""Megatron-LM's trainer (the plug-in) saving to and resuming from an object store on 127.0.0.1
(moto behind tests/s3_server.py's proxy): one saving run through `msc://` with the trainer's own
`--enable-msc`, one resume on another layout through `s3://` of the same bucket; and the uses of
an object-store --save that megatron's own code would write as a local folder, refused."""

import argparse
import json

import pytest

pytest.importorskip("boto3", reason="the s3-tests extra (run.sh setup installs it)")
pytest.importorskip("moto", reason="the s3-tests extra (run.sh setup installs it)")

from mlm_harness import max_delta, run, trainer_python  # noqa: E402
from s3_server import s3_endpoint  # noqa: E402

from megatron_ucp.megatron_lm import store_paths  # noqa: E402

N, K = 8, 4
BUCKET, PROFILE = "ucp", "ucp-mlm"
UNIVERSAL = ["--ckpt-format", "universal"]
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DIST = ["--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    """The loopback store, a bucket, and an MSC profile over it (the config --enable-msc reads)."""
    with s3_endpoint() as (url, _faults, env), pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        import boto3

        config = tmp_path_factory.mktemp("msc") / "msc_config.json"
        config.write_text(json.dumps({"profiles": {PROFILE: {
            "storage_provider": {"type": "s3", "options": {"base_path": BUCKET, "endpoint_url": url,
                                                           "region_name": "us-east-1"}},
            "credentials_provider": {"type": "S3Credentials",
                                     "options": {"access_key": "testing", "secret_key": "testing"}}}}}))
        mp.setenv("MSC_CONFIG", str(config))
        client = boto3.client("s3", endpoint_url=env["UCP_TEST_MOTO_URL"])
        client.create_bucket(Bucket=BUCKET)
        yield client


def _keys(client, prefix):
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"] for page in pages for o in page.get("Contents", ())}


@pytest.mark.slow  # two 4-rank trainer runs: 130 s on the shared 2-core machine (load from 3 users)
def test_trainer_saves_through_msc_and_resumes_from_s3_on_another_layout(endpoint, tmp_path):
    python = trainer_python()
    store = f"msc://{PROFILE}/mlm"  # the same objects as s3://ucp/mlm
    saved = run(python, tmp_path / "save", 4, TP2PP2 + DIST + UNIVERSAL + [
        "--enable-msc", "--save", store, "--load", store, "--save-interval", str(K)], N).check()
    assert "successfully saved universal checkpoint from iteration       4" in saved.output
    keys = _keys(endpoint, "mlm/")
    assert {"mlm/latest_checkpointed_iteration.txt", "mlm/iter_0000004/ucp.json", "mlm/iter_0000008/ucp.json"} <= keys
    assert not list((tmp_path / "save").glob("*:*")), "a store path was written as a local folder"
    assert "mlm/.ucp_owner.json" not in keys, "the owner record outlived the job's clean end"

    resumed = run(python, tmp_path / "resume", 4, DIST + UNIVERSAL + [
        "--load", f"s3://{BUCKET}/mlm", "--ckpt-step", str(K)], N).check()
    assert f"successfully loaded universal checkpoint from s3://{BUCKET}/mlm at iteration {K}" in resumed.output
    assert min(resumed.losses()) == K + 1
    delta = max_delta(saved.losses(), resumed.losses(), range(K + 1, N + 1))
    assert delta <= 1e-6, f"TP2 x PP2 -> TP1 x DP4 through the store: max |dloss| {delta:.3g}"


def _args(**kw):
    base = dict(save="s3://b/p", ckpt_format="universal", enable_msc=False, non_persistent_ckpt_type=None,
                non_persistent_global_ckpt_dir=None, log_progress=False, wandb_project=None, wandb_save_dir=None)
    return argparse.Namespace(**dict(base, **kw))


@pytest.mark.parametrize("kw,expected", [
    (dict(), None),
    (dict(save="/ckpt", ckpt_format="torch_dist", log_progress=True), None),  # a folder: megatron's
    (dict(save="msc://p/x", ckpt_format="torch_dist", enable_msc=True), None),  # megatron's own msc
    (dict(ckpt_format="torch_dist"), "--ckpt-format torch_dist is written by Megatron-LM's own code"),
    (dict(save="msc://p/x", ckpt_format="torch_dist"), "only through --enable-msc and an msc:// path"),
    (dict(non_persistent_ckpt_type="global"), "--non-persistent-global-ckpt-dir"),
    (dict(non_persistent_ckpt_type="global", non_persistent_global_ckpt_dir="/np"), None),
    (dict(log_progress=True), "--log-progress appends to <save>/progress.txt"),
    (dict(save="msc://p/x", enable_msc=True, log_progress=True), "--log-progress"),
    (dict(wandb_project="w"), "--wandb-save-dir"),
    (dict(wandb_project="w", wandb_save_dir="/w"), None),
])
def test_a_store_save_megatron_would_write_as_a_folder_is_refused(kw, expected):
    reason = store_paths.problem(_args(**kw))
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason and reason.startswith("--save ") and "\n" not in reason
