"""The tools on a checkpoint in an object store (moto on 127.0.0.1, tests/s3_server.py): a tiny
HF Llama imported into a folder, uploaded object for file, then `export-hf` and `inspect
--verify --prove` read it from s3:// through the store (no copy on local disk)."""

from pathlib import Path

import pytest

pytest.importorskip("boto3", reason="the s3-tests extra (run.sh setup installs it)")
pytest.importorskip("moto", reason="the s3-tests extra (run.sh setup installs it)")
transformers = pytest.importorskip("transformers")  # the [hf] extra
import torch  # noqa: E402

from s3_server import s3_endpoint  # noqa: E402

from megatron_ucp.convert.hf import export, import_  # noqa: E402
from megatron_ucp.errors import ConfigError, IntegrityError  # noqa: E402

BUCKET = "tools"


def _hf(folder: Path) -> Path:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32)).float().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """(local universal folder, its s3:// copy, moto client)."""
    work = tmp_path_factory.mktemp("store_tools")
    local = work / "ucp"
    import_(str(_hf(work / "hf")), str(local), progress=False, prove=False)  # the slow test proves its own
    with s3_endpoint() as (_url, _faults, env), pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        import boto3

        client = boto3.client("s3", endpoint_url=env["UCP_TEST_MOTO_URL"])
        client.create_bucket(Bucket=BUCKET)
        _upload(client, local, "llama")
        yield local, f"s3://{BUCKET}/llama", client


def _upload(client, local: Path, prefix: str) -> None:
    """A folder copied object for file (as aws s3 sync does)."""
    for f in local.rglob("*"):
        if f.is_file():
            client.upload_file(str(f), BUCKET, f"{prefix}/{f.relative_to(local).as_posix()}")


def _files(folder: Path) -> dict:
    return {f.name: f.read_bytes() for f in folder.iterdir()}


def test_export_hf_reads_a_checkpoint_in_the_store(stored, tmp_path):
    local, url, client = stored
    export(str(local), str(tmp_path / "from_disk"), progress=False)
    summary = export(url, str(tmp_path / "from_s3"), progress=False)
    assert summary["tensors"] > 0
    assert _files(tmp_path / "from_s3") == _files(tmp_path / "from_disk")  # bitwise the same model
    with pytest.raises(ConfigError, match="export-hf writes a local folder"):
        export(url, f"s3://{BUCKET}/hf_out", progress=False)


def test_export_hf_from_the_store_names_a_changed_object(stored, tmp_path):
    local, url, client = stored
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

    _, _, client = stored
    import_(str(_hf(tmp_path / "hf")), str(tmp_path / "ucp"), progress=False)
    _upload(client, tmp_path / "ucp", "proved")
    assert main([f"s3://{BUCKET}/proved", "--verify", "--prove"]) == 0
    out = capsys.readouterr().out
    assert "resume proof" in out and "OK" in out, out


@pytest.mark.parametrize("argv", [
    ["convert", "--input", "/ckpt", "--output", "s3://b/out"],
    ["convert", "--input=msc://p/ckpt", "--output", "out"],
    ["import-hf", "hf", "s3://b/out"],
    ["export-torch-dist", "s3://b/ckpt", "out", "--", "--tensor-model-parallel-size", "2"],
])
def test_a_store_path_to_a_folder_only_command_is_one_line(argv, tmp_path, monkeypatch, capsys):
    from megatron_ucp.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "reads and writes folders, not object stores yet" in err and "\n" not in err, err
    assert not list(tmp_path.iterdir()), "a URL was taken for a local folder"
