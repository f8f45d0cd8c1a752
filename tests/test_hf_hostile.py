"""import_hf on a stranger's Hugging Face folder (issue 38, bugs 6-7 and the weak class): the
config typed and bounded and compared with the tensors present before anything is sized from
it, safetensors dtypes checked, lying headers one line naming the file; each case fast, exit 2
from the tool, no output left."""

import errno
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")  # the [hf] extra
import torch  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from harness import REPO  # noqa: E402
from megatron_ucp.convert.hf import import_  # noqa: E402
from megatron_ucp.errors import UCPError  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32)).float().save_pretrained(folder)
    return folder


def _copy(src: Path, dst: Path, config=None, drop=(), tensors=None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg).replace("Infinity", "1e400"))  # a number JSON allows
    t = load_file(str(src / "model.safetensors"))
    t.update(tensors or {})
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


CONFIGS = {
    "layers_a_million": ({"num_hidden_layers": 10**6}, (), "'num_hidden_layers' is 1000000, the tensors"),
    "heads_zero": ({"num_attention_heads": 0}, (), "'num_attention_heads' is 0, expected an integer"),
    "layers_text": ({"num_hidden_layers": "2"}, (), "'num_hidden_layers' is '2', expected an integer"),
    "layers_float": ({"num_hidden_layers": 2.0}, (), "'num_hidden_layers' is 2.0, expected an integer"),
    "missing_key": ({}, ("hidden_size",), "lacks 'hidden_size'"),
    "rope_theta_inf": ({"rope_theta": 1e400}, (), "'rope_theta' is inf, expected a finite number"),
    "rope_theta_text": ({"rope_theta": "abc"}, (), "'rope_theta' is 'abc'"),
    "rope_scaling_text": ({"rope_scaling": "yes"}, (), "'rope_scaling' is 'yes', expected null or an object"),
    "architectures_dict": ({"architectures": {"a": 1}}, (), "'architectures' is {'a': 1}, expected a list"),
    "positions_text": ({"max_position_embeddings": "abc"}, (), "'max_position_embeddings' is 'abc'"),
    "tie_text": ({"tie_word_embeddings": "false"}, (), "'tie_word_embeddings' is 'false', expected true or false"),
    "vocab_not_the_embedding": ({"vocab_size": 10**9}, (), "model.embed_tokens.weight"),
    "experts_a_hundred_million": ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 10**8,
                                   "num_experts_per_tok": 2}, (), "'num_local_experts' is 100000000, the tensors"),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_config_is_typed_and_checked_against_the_tensors(llama, tmp_path, case):
    config, drop, words = CONFIGS[case]
    bad = _copy(llama, tmp_path / "bad", config, drop)
    start = time.perf_counter()
    with pytest.raises(UCPError) as e:
        import_(str(bad), str(tmp_path / "out"), progress=False)
    assert words in str(e.value) and str(bad / "config.json") in str(e.value), str(e.value)
    assert time.perf_counter() - start < 5
    assert not (tmp_path / "out").exists()


def test_a_distinct_lm_head_under_tied_embeddings_is_refused(llama, tmp_path):
    """It was dropped without a word (with tie_word_embeddings "false", which counted as true)."""
    import numpy as np

    head = np.ones((64, 16), np.float32)
    bad = _copy(llama, tmp_path / "bad", {"tie_word_embeddings": True}, tensors={"lm_head.weight": head})
    with pytest.raises(UCPError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        import_(str(bad), str(tmp_path / "out"), progress=False)


def _relabel(path: Path, name: str, dtype: str) -> None:
    """Give `name` another dtype in the header, same bytes (and header length)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header[name]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", n) + text.ljust(n) + raw[8 + n:])


def test_integer_data_is_refused(llama, tmp_path):
    """model.norm.weight relabelled I32 (same bytes) imported as 1.07e9s, exit 0."""
    bad = _copy(llama, tmp_path / "bad")
    _relabel(bad / "model.safetensors", "model.norm.weight", "I32")
    with pytest.raises(UCPError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has dtype I32, "
                                       r"expected a floating-point one"):
        import_(str(bad), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


def _header_lie(kind):
    def lie(path: Path):
        raw = path.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        if kind == "huge_length":
            path.write_bytes(struct.pack("<Q", 2**62) + raw[8:])
        elif kind == "not_json":
            path.write_bytes(struct.pack("<Q", n) + b"{" * n + raw[8 + n:])
        elif kind == "truncated":
            path.write_bytes(raw[:8 + n + 10])
        elif kind == "pickle":
            torch.save({"x": torch.zeros(2)}, path)
        elif kind == "bad_offsets":
            header = json.loads(raw[8:8 + n])
            first = next(k for k in header if k != "__metadata__")
            header[first]["data_offsets"] = [0, 10**12]
            text = json.dumps(header, separators=(",", ":")).encode()
            path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    return lie


@pytest.mark.parametrize("kind", ["huge_length", "not_json", "truncated", "pickle", "bad_offsets"])
def test_lying_safetensors_header_is_one_line_naming_the_file(llama, tmp_path, kind):
    bad = _copy(llama, tmp_path / "bad")
    _header_lie(kind)(bad / "model.safetensors")
    start = time.perf_counter()
    with pytest.raises(UCPError) as e:
        import_(str(bad), str(tmp_path / "out"), progress=False)
    assert str(bad / "model.safetensors") in str(e.value), str(e.value)
    assert time.perf_counter() - start < 5


def test_the_tool_says_one_line_exit_2(llama, tmp_path):
    bad = _copy(llama, tmp_path / "bad", {"num_hidden_layers": "2"})
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, str(REPO / "tools" / "import_hf.py"), str(bad), str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "'num_hidden_layers' is '2'" in lines[0], r.stderr[-2000:]


def test_a_good_folder_still_imports(llama, tmp_path):
    summary = import_(str(llama), str(tmp_path / "out"), progress=False)
    assert summary["tensors"] > 0


# ---- the weak classes: disk full, an index's paths, a cache snapshot, export_hf's own input ------

def test_import_disk_full_says_so_and_keeps_nothing(llama, tmp_path, monkeypatch):
    from megatron_ucp.convert import writer

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(writer, "write_tensor_file", full)
    out = tmp_path / "out"
    with pytest.raises(UCPError) as e:
        import_(str(llama), str(out), progress=False)
    assert str(e.value).startswith(f"{out}: disk full: No space left on device"), str(e.value)
    assert not list(out.glob("iter_*")) and not list(out.glob(".tmp*"))
    monkeypatch.undo()
    assert import_(str(llama), str(out), progress=False)["tensors"] > 0  # the rerun


def test_index_paths_name_the_index(llama, tmp_path):
    bad = _copy(llama, tmp_path / "bad")
    (bad / "model.safetensors").rename(bad / "shard.safetensors")
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": "../x"}}))
    with pytest.raises(UCPError, match=r"path '\.\./x' in .*model\.safetensors\.index\.json must be relative"):
        import_(str(bad), str(tmp_path / "out"), progress=False)


def test_a_cache_snapshot_gets_a_hint(llama, tmp_path):
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in llama.iterdir():
        (blobs / f.name).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blobs / f.name, snap))
    with pytest.raises(UCPError, match=r"resolves outside .*cp -rL.*local_dir="):
        import_(str(snap), str(tmp_path / "out"), progress=False)


@pytest.fixture(scope="module")
def universal(llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ucp") / "llama"
    import_(str(llama), str(out), progress=False)
    return out


def _with_args(universal: Path, dst: Path, **args) -> Path:
    import shutil

    shutil.copytree(universal, dst)
    path = dst / "iter_0000000" / "ucp.json"
    m = json.loads(path.read_text())
    m["args"].update(args)
    path.write_text(json.dumps(m))
    return dst


@pytest.mark.parametrize("args,words", [
    ({"rotary_base": "abc"}, "'args.rotary_base' is 'abc', expected an integer"),
    ({"rotary_base": 10**400}, "'args.rotary_base' is 1000"),
    ({"norm_epsilon": [1]}, "'args.norm_epsilon' is [1], expected a finite number"),
    ({"norm_epsilon": None}, "'args.norm_epsilon' is None, expected a finite number"),
])
def test_export_hf_types_the_manifest_args(universal, tmp_path, args, words):
    from megatron_ucp.convert.hf import export

    ckpt = _with_args(universal, tmp_path / "ckpt", **args)
    with pytest.raises(UCPError) as e:
        export(str(ckpt), str(tmp_path / "hf"), progress=False)
    assert words in str(e.value) and "ucp.json" in str(e.value), str(e.value)
    assert not (tmp_path / "hf").exists()


def test_export_hf_max_shard_nan_is_one_line(universal, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, str(REPO / "tools" / "export_hf.py"), str(universal), str(tmp_path / "hf"),
                        "--max-shard-gb", "nan"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "--max-shard-gb" in r.stderr, r.stderr[-2000:]


def test_export_hf_disk_full_and_a_killed_exports_leftovers(universal, tmp_path, monkeypatch):
    from megatron_ucp.convert import hf

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = tmp_path / f".tmp_hf_{dead.pid}_0badc0de"  # what a killed export leaves
    leftover.mkdir()
    real = hf._to_bytes

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "_to_bytes", full)
    with pytest.raises(UCPError) as e:
        hf.export(str(universal), str(tmp_path / "hf"), progress=False)
    assert str(e.value).startswith(f"{tmp_path / 'hf'}: disk full"), str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    monkeypatch.setattr(hf, "_to_bytes", real)
    hf.export(str(universal), str(tmp_path / "hf"), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
