"""The tools on a checkpoint in an object store (moto on 127.0.0.1, tests/s3_server.py): a tiny
HF Llama imported into a folder, uploaded object for file, then `export-hf` and `inspect
--verify --prove` read it from s3:// through the store (no copy on local disk); `import-hf`
writes into s3:// (staged on disk, committed by the save's protocol: convert/store_output.py),
an upload that fails half-way commits nothing; what stays refused is one line.
(`convert` and `export-torch-dist` through a store: tests/test_store_convert.py, slow.)"""

import json
import shutil

from pathlib import Path

import pytest

pytest.importorskip("boto3", reason="the s3-tests extra (run.sh setup installs it)")
pytest.importorskip("moto", reason="the s3-tests extra (run.sh setup installs it)")
transformers = pytest.importorskip("transformers")  # the [hf] extra
import torch  # noqa: E402

from s3_server import s3_endpoint  # noqa: E402

from megatron_ucp.convert.hf import export, import_  # noqa: E402
from megatron_ucp.errors import ConfigError, IntegrityError, SaveError  # noqa: E402

BUCKET = "tools"


def _hf(folder: Path) -> Path:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32)).float().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """(local universal folder, its s3:// copy, moto client, the proxy's faults)."""
    work = tmp_path_factory.mktemp("store_tools")
    local = work / "ucp"
    import_(str(_hf(work / "hf")), str(local), progress=False, prove=False)  # the slow test proves its own
    with s3_endpoint() as (_url, faults, env), pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        import boto3

        client = boto3.client("s3", endpoint_url=env["UCP_TEST_MOTO_URL"])
        client.create_bucket(Bucket=BUCKET)
        _upload(client, local, "llama")
        yield local, f"s3://{BUCKET}/llama", client, faults


def _upload(client, local: Path, prefix: str) -> None:
    """A folder copied object for file (as aws s3 sync does)."""
    for f in local.rglob("*"):
        if f.is_file():
            client.upload_file(str(f), BUCKET, f"{prefix}/{f.relative_to(local).as_posix()}")


def _files(folder: Path) -> dict:
    return {f.name: f.read_bytes() for f in folder.iterdir()}


def test_export_hf_reads_a_checkpoint_in_the_store(stored, tmp_path):
    local, url, client, _ = stored
    export(str(local), str(tmp_path / "from_disk"), progress=False)
    summary = export(url, str(tmp_path / "from_s3"), progress=False)
    assert summary["tensors"] > 0
    assert _files(tmp_path / "from_s3") == _files(tmp_path / "from_disk")  # bitwise the same model
    with pytest.raises(ConfigError, match="export-hf writes a local folder"):
        export(url, f"s3://{BUCKET}/hf_out", progress=False)


def test_export_hf_from_the_store_names_a_changed_object(stored, tmp_path):
    local, url, client, _ = stored
    key = next(k for k in (o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="llama/")["Contents"])
               if k.endswith(".safetensors"))
    data = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[-1] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key.replace("llama/", "bad/"), Body=bytes(data))
    for o in client.list_objects_v2(Bucket=BUCKET, Prefix="llama/")["Contents"]:
        if o["Key"] != key:
            client.copy_object(Bucket=BUCKET, Key=o["Key"].replace("llama/", "bad/"),
                               CopySource={"Bucket": BUCKET, "Key": o["Key"]})
    with pytest.raises(IntegrityError, match=rf"s3://{BUCKET}/bad/.*{key.rsplit('/', 1)[1]}: block \d+ .* has crc32"):
        export(f"s3://{BUCKET}/bad", str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # two one-process model loads (the import's proof, the check): 13-38 s here, with load
def test_inspect_prove_reads_a_checkpoint_in_the_store(stored, tmp_path, capsys):
    from megatron_ucp.commands.inspect_checkpoint import main

    _, _, client, _ = stored
    import_(str(_hf(tmp_path / "hf")), str(tmp_path / "ucp"), progress=False)
    _upload(client, tmp_path / "ucp", "proved")
    assert main([f"s3://{BUCKET}/proved", "--verify", "--prove"]) == 0
    out = capsys.readouterr().out
    assert "resume proof" in out and "OK" in out, out


def _objects(client, prefix: str) -> dict:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        out.update({o["Key"][len(prefix) + 1:]: o for o in page.get("Contents", ())})
    return out


def _read(client, key: str) -> bytes:
    return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def _checkpoint_files(local: Path) -> dict:
    """The tracker and the iteration folders' files of a save folder, as the store names them."""
    return {f.relative_to(local).as_posix(): f.read_bytes() for f in local.rglob("*")
            if f.is_file() and (f.name == "latest_checkpointed_iteration.txt" or f.parts[len(local.parts)].startswith("iter_"))}


def test_import_hf_into_the_store_equals_the_import_on_disk(stored, tmp_path, capsys):
    from megatron_ucp.cli import main

    local, _, client, _ = stored
    staging = tmp_path / "staging"
    staging.mkdir()
    assert main(["import-hf", str(local.parent / "hf"), f"s3://{BUCKET}/imported", "--no-proof", "--no-progress",
                 "--staging-dir", str(staging)]) == 0
    assert f"into s3://{BUCKET}/imported/iter_0000000" in capsys.readouterr().out
    objects = _objects(client, "imported")
    assert {k: _read(client, f"imported/{k}") for k in objects} == _checkpoint_files(local)  # bitwise the same
    assert not list(staging.iterdir()), "the staging folder is left behind"
    from megatron_ucp.format.store_inspection import verify

    assert verify(f"s3://{BUCKET}/imported") == []
    # a second import would move nothing back but replace iteration 0: refused, nothing changed
    with pytest.raises(ConfigError, match=r"imported/iter_0000000 exists already"):
        import_(str(local.parent / "hf"), f"s3://{BUCKET}/imported", progress=False, prove=False)
    assert _objects(client, "imported").keys() == objects.keys()


def _as_iteration(local: Path, dest: Path, iteration: int) -> Path:
    """A copy of the save folder `local` renumbered to `iteration` (manifest and tracker)."""
    shutil.copytree(local, dest)
    (dest / "iter_0000000").rename(dest / f"iter_{iteration:07d}")
    manifest = dest / f"iter_{iteration:07d}" / "ucp.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), iteration=iteration), indent=1, sort_keys=True))
    (dest / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    return dest


def test_an_upload_that_fails_half_way_commits_nothing(stored, tmp_path):
    from megatron_ucp.convert.store_output import publish
    from megatron_ucp.format.store_inspection import verify

    local, _, client, faults = stored
    _upload(client, local, "prev")  # the previous checkpoint: iteration 0, tracked
    before = {k: o["ETag"] for k, o in _objects(client, "prev").items()}
    newer = _as_iteration(local, tmp_path / "newer", 5)
    victim = sorted((newer / "iter_0000005" / "tensors").iterdir())[3].name
    faults.add("PUT", victim, "503")  # every attempt at that object: SlowDown
    try:
        with pytest.raises(SaveError, match=rf"upload of iteration 5 to s3://{BUCKET}/prev failed, nothing committed.*"
                                            rf"{victim}") as e:
            publish(str(newer), f"s3://{BUCKET}/prev")
    finally:
        faults.clear()
    assert "\n" not in str(e.value)
    after = _objects(client, "prev")
    assert {k: after[k]["ETag"] for k in before} == before  # the previous checkpoint untouched
    assert _read(client, "prev/latest_checkpointed_iteration.txt") == b"0\n"
    assert not [k for k in after if k.startswith("iter_0000005/")], "the failed upload left objects"
    assert verify(f"s3://{BUCKET}/prev") == []  # the tracker's checkpoint loads
    publish(str(newer), f"s3://{BUCKET}/prev")  # a rerun commits it
    assert _read(client, "prev/latest_checkpointed_iteration.txt") == b"5\n"
    assert verify(f"s3://{BUCKET}/prev") == []
    assert ".ucp_owner.json" not in _objects(client, "prev"), "the command's owner record is left behind"
    with pytest.raises(ConfigError, match="move its tracker back"):  # iteration 0 into a prefix at 5
        import_(str(local.parent / "hf"), f"s3://{BUCKET}/prev", progress=False, prove=False)


def test_staging_without_room_is_refused_before_any_upload(stored, tmp_path, monkeypatch):
    import os

    local, _, client, _ = stored
    real = os.statvfs

    def tiny(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0) + tuple(st)[5:])
    monkeypatch.setattr(os, "statvfs", tiny)
    with pytest.raises(SaveError, match=r"ucp-staging-.*: disk full: 0.000 GB free.*--staging-dir"):
        import_(str(local.parent / "hf"), f"s3://{BUCKET}/no_room", progress=False, prove=False,
                staging_dir=str(tmp_path))
    assert not _objects(client, "no_room") and not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, message", [
    (["convert", "--input=msc://p/ckpt", "--output", "out"], "convert reads torch_dist, fsdp_dtensor and legacy"),
    (["import-hf", "s3://b/hf", "out"], "import-hf reads a Hugging Face model folder from a folder"),
    (["import-deepspeed", "s3://b/ds", "out"], "import-deepspeed reads DeepSpeed's torch.load files from a folder"),
    (["export-torch-dist", "ckpt", "s3://b/out", "--", "--tensor-model-parallel-size", "2"],
     "export-torch-dist writes a folder"),
])
def test_what_a_store_cannot_take_is_one_line(argv, message, tmp_path, monkeypatch, capsys):
    from megatron_ucp.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err
    assert not list(tmp_path.iterdir()), "a URL was taken for a local folder"


def test_export_torch_dist_plans_from_a_checkpoint_in_the_store(stored, tmp_path):
    """The export's checks read the store (the workers' load: tests/test_store_convert.py, slow)."""
    from megatron_ucp.convert.export_torch_dist import plan
    from megatron_ucp.errors import IncompleteCheckpointError

    _, url, _, _ = stored
    tp2 = ["--tensor-model-parallel-size", "2"]
    job = plan(url, str(tmp_path / "out"), extra=tp2)
    assert (job.root, job.iteration, job.nproc) == (url, 0, 2)
    job = plan(f"{url}/iter_0000000/", str(tmp_path / "out"), extra=tp2)
    assert (job.root, job.iteration) == (url, 0)
    with pytest.raises(IncompleteCheckpointError, match=r"llama/iter_0000003: holds no universal checkpoint"):
        plan(url, str(tmp_path / "out"), iteration=3, extra=tp2)
