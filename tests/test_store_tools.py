"""The tools on a checkpoint in an object store (moto on 127.0.0.1, tests/s3_server.py): a tiny
HF Llama imported into a folder, uploaded object for file, then `export-hf` and `inspect
--verify --prove` read it from s3:// through the store (no copy on local disk); `import-hf`
writes into s3:// (staged on disk, committed by the save's protocol: convert/store_output.py),
an upload that fails half-way commits nothing. Foreign inputs in the store (an HF folder, an
fsdp_dtensor checkpoint built by hand) are downloaded into a staging folder and converted as
on disk; a torch_dist folder is uploaded from one, the tracker last (convert/store_staging.py).
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


def test_export_hf_into_the_store_uploads_the_folder_config_last(stored, tmp_path, monkeypatch):
    """export-hf into an empty prefix: the folder on disk, object for file, config.json last (a
    reader opens it first); a failed upload leaves nothing; a prefix with objects is refused."""
    from megatron_ucp.format import stores

    local, url, client, faults = stored
    export(str(local), str(tmp_path / "from_disk"), progress=False)
    out = f"s3://{BUCKET}/hf_out"
    faults.add("PUT", "model.safetensors", "503")
    try:
        with pytest.raises(SaveError, match=rf"upload of .* to {out} failed; what was uploaded is deleted"):
            export(url, out, progress=False, staging_dir=str(tmp_path))
    finally:
        faults.clear()
    assert not _objects(client, "hf_out") and not list(tmp_path.glob("ucp-staging-*"))
    order = []
    store = stores.store_for(out)
    real = store.upload
    monkeypatch.setattr(store, "upload", lambda path, f: (order.append(path.rsplit("/", 1)[1]), real(path, f)))
    assert export(url, out, progress=False, staging_dir=str(tmp_path))["output"] == out
    assert order[-1] == "config.json" and not list(tmp_path.glob("ucp-staging-*"))
    assert {k: _read(client, f"hf_out/{k}") for k in _objects(client, "hf_out")} == _files(tmp_path / "from_disk")
    with pytest.raises(ConfigError, match=rf"output {out}: the prefix holds objects already"):
        export(url, out, progress=False)


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


def test_a_missing_store_input_is_one_line(stored, tmp_path, monkeypatch, capsys):
    from megatron_ucp.cli import main

    monkeypatch.chdir(tmp_path)
    for argv in (["convert", f"--input=s3://{BUCKET}/nothing", "--output", "out"],
                 ["import-hf", f"s3://{BUCKET}/nothing", "out"], ["import-deepspeed", f"s3://{BUCKET}/nothing", "out"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert f"s3://{BUCKET}/nothing: no objects under this prefix" in err and "\n" not in err, err
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


# ---------------------------------------------------------------- staging (convert/store_staging.py)


def _tensor_bytes(folder: Path) -> dict:
    return {f.relative_to(folder).as_posix(): f.read_bytes() for f in folder.rglob("*")
            if f.is_file() and "tensors" in f.parts}


def _manifest(iter_dir: Path) -> dict:
    return json.loads((iter_dir / "ucp.json").read_text())


def _from_store(faults, not_read, tmp_path, run):
    """`run(staging_dir)` with a 503 on every GET of the objects named by `not_read` (the
    command must not download them); the staging folder is left empty. Returns run's result."""
    staging = tmp_path / "staging"
    staging.mkdir()
    for text in not_read:
        faults.add("GET", text, "503")
    try:
        result = run(str(staging))
    finally:
        faults.clear()
    assert not list(staging.iterdir()), "the staging copy is left behind"
    return result


def test_import_hf_from_the_store_equals_the_import_on_disk(stored, tmp_path):
    local, _, client, faults = stored
    hf = local.parent / "hf"
    _upload(client, hf, "hf_src")
    client.put_object(Bucket=BUCKET, Key="hf_src/pytorch_model.bin", Body=b"not read")  # other weights, a subfolder
    client.put_object(Bucket=BUCKET, Key="hf_src/original/consolidated.00.pth", Body=b"not read")
    s3 = _from_store(faults, ["pytorch_model.bin", "consolidated"], tmp_path, lambda staging: import_(
        f"s3://{BUCKET}/hf_src", str(tmp_path / "from_s3"), progress=False, prove=False, staging_dir=staging))
    import_(str(hf), str(tmp_path / "from_disk"), progress=False, prove=False)
    it = Path(s3["output"]).name
    assert _tensor_bytes(tmp_path / "from_s3" / it) == _tensor_bytes(tmp_path / "from_disk" / it)
    on_s3, on_disk = _manifest(tmp_path / "from_s3" / it), _manifest(tmp_path / "from_disk" / it)
    assert on_s3.pop("source")["huggingface"] == f"s3://{BUCKET}/hf_src"
    on_disk.pop("source")
    assert on_s3 == on_disk


def _fsdp_save_prefix(root: Path) -> Path:
    """A hand-built fsdp_dtensor checkpoint (fsdp_dtensor_fixture.py) in a save folder with megatron's tracker."""
    import fsdp_dtensor_fixture as fx

    fx.write(root)
    (root / "latest_checkpointed_iteration.txt").write_text(str(fx.ITERATION))
    return root


def test_convert_from_the_store_downloads_the_tracked_iteration(stored, tmp_path):
    from megatron_ucp.convert.to_universal import convert

    _, _, client, faults = stored
    src = _fsdp_save_prefix(tmp_path / "src")
    _upload(client, src, "fsdp")
    client.put_object(Bucket=BUCKET, Key="fsdp/iter_0000002/__0_0.distcp", Body=b"an older iteration, not read")
    s3 = _from_store(faults, ["iter_0000002"], tmp_path, lambda staging: convert(
        f"s3://{BUCKET}/fsdp", str(tmp_path / "from_s3"), progress=False, prove=False, staging_dir=staging))
    disk = convert(str(src), str(tmp_path / "from_disk"), progress=False, prove=False)
    it = Path(disk["output"]).name
    assert s3["iteration"] == disk["iteration"] and s3["tensors"] == disk["tensors"] > 0
    assert _tensor_bytes(tmp_path / "from_s3" / it) == _tensor_bytes(tmp_path / "from_disk" / it)
    on_s3, on_disk = _manifest(tmp_path / "from_s3" / it), _manifest(tmp_path / "from_disk" / it)
    assert on_s3.pop("source")["fsdp_dtensor"] == f"s3://{BUCKET}/fsdp/{it}"
    on_disk.pop("source")
    assert on_s3 == on_disk
    # the iteration prefix itself (no tracker) converts the same, into the store too
    staging = tmp_path / "staging"  # _from_store's, empty again
    convert(f"s3://{BUCKET}/fsdp/{it}", f"s3://{BUCKET}/fsdp_ucp", progress=False, prove=False,
            staging_dir=str(staging))
    assert {k: _read(client, f"fsdp_ucp/{k}") for k in _objects(client, "fsdp_ucp") if k.startswith(f"{it}/tensors/")} \
        == {f"{it}/{k}": v for k, v in _tensor_bytes(tmp_path / "from_disk" / it).items()}
    assert not list(staging.iterdir())
    with pytest.raises(ConfigError, match=rf"--input s3://{BUCKET}/fsdp_ucp/{it} holds a universal checkpoint"):
        convert(f"s3://{BUCKET}/fsdp_ucp", str(tmp_path / "again"), progress=False, prove=False)


def test_a_download_without_room_is_refused_before_any_byte(stored, tmp_path, monkeypatch):
    import os

    from megatron_ucp.convert.to_universal import convert

    _, _, client, faults = stored
    _upload(client, _fsdp_save_prefix(tmp_path / "src"), "fsdp_room")
    real = os.statvfs

    def tiny(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0) + tuple(st)[5:])
    monkeypatch.setattr(os, "statvfs", tiny)
    gets = faults.seen.get("GET", 0)
    with pytest.raises(SaveError, match=r"ucp-staging-.*: disk full: 0.000 GB free, the input s3://.*fsdp_room takes"):
        convert(f"s3://{BUCKET}/fsdp_room", str(tmp_path / "out"), progress=False, prove=False,
                staging_dir=str(tmp_path / "src"))
    assert faults.seen.get("GET", 0) == gets + 2  # the tracker and the listing, no object
    assert [p.name for p in (tmp_path / "src").iterdir() if p.name.startswith("ucp-staging")] == []


def test_a_torch_dist_upload_puts_the_tracker_last_and_a_failed_one_leaves_none(stored, tmp_path, monkeypatch):
    from megatron_ucp.convert import store_staging
    from megatron_ucp.format import stores

    _, _, client, faults = stored
    src = _fsdp_save_prefix(tmp_path / "src")  # a folder megatron's DCP writer wrote, with its tracker
    url = f"s3://{BUCKET}/td"
    files = sorted(p.name for p in (src / "iter_0000004").iterdir())
    faults.add("PUT", files[1], "503")
    try:
        with pytest.raises(SaveError, match=rf"upload of iteration 4 to {url} failed, nothing committed.*{files[1]}"):
            store_staging.upload(str(src), url, 4)
    finally:
        faults.clear()
    assert not _objects(client, "td"), "a failed upload left objects"
    order = []
    store = stores.store_for(url)
    real = store.upload
    monkeypatch.setattr(store, "upload", lambda path, local: (order.append(path.rsplit("/", 1)[1]), real(path, local)))
    store_staging.upload(str(src), url, 4)
    assert order[-1] == "latest_checkpointed_iteration.txt" and sorted(order[:-1]) == files
    assert {k: _read(client, f"td/{k}") for k in _objects(client, "td")} == \
        {f.relative_to(src).as_posix(): f.read_bytes() for f in src.rglob("*") if f.is_file()}
    with pytest.raises(ConfigError, match=r"td/iter_0000004 exists already"):
        store_staging.check_output(url, 4)
    with pytest.raises(ConfigError, match=r"at iteration 4; writing iteration 3 there would move its tracker back"):
        store_staging.check_output(url, 3)


def test_import_deepspeed_from_the_store_equals_the_import_on_disk(stored, tmp_path):
    """A DeepSpeed universal folder written by hand (tests/ds_universal.py), downloaded whole."""
    import ds_universal
    from megatron_ucp.convert.deepspeed import import_ as import_deepspeed

    _, _, client, _ = stored
    variant = dict(tied=True, groups=2)
    gpt = ds_universal.model(variant)
    folder = Path(ds_universal.write(tmp_path / "ds", gpt, ds_universal.args_of(gpt, variant), 1))
    _upload(client, folder, "ds_src")
    staging = tmp_path / "staging"
    staging.mkdir()
    s3 = import_deepspeed(f"s3://{BUCKET}/ds_src", str(tmp_path / "from_s3"), progress=False, prove=False,
                          staging_dir=str(staging))
    assert not list(staging.iterdir()), "the staging copy is left behind"
    disk = import_deepspeed(str(folder), str(tmp_path / "from_disk"), progress=False, prove=False)
    it = Path(disk["output"]).name
    assert s3["tensors"] == disk["tensors"] > 0
    assert _tensor_bytes(tmp_path / "from_s3" / it) == _tensor_bytes(tmp_path / "from_disk" / it)
    on_s3, on_disk = _manifest(tmp_path / "from_s3" / it), _manifest(tmp_path / "from_disk" / it)
    assert on_s3["source"].pop("deepspeed") == f"s3://{BUCKET}/ds_src"
    on_disk["source"].pop("deepspeed")
    assert on_s3 == on_disk
