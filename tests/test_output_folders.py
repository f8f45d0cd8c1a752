"""Every converter, import and export writer into a folder (issue 38, bug 4): the owner lock,
no tracker moved back, no format mixed under one tracker, no output inside a checkpoint.
On copies of tests/fixtures/v1_moe (a universal save folder whose tracker names iteration 4)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ucp.convert import hf, writer
from megatron_ucp.convert.export_torch_dist import plan
from megatron_ucp.engine import ownership
from megatron_ucp.errors import ConfigError, SaveError
from megatron_ucp.format import manifest as mf
from test_inspect import ARCHITECTURE

FIXTURE = Path(__file__).parent / "fixtures" / "v1_moe"


@pytest.fixture
def save(tmp_path) -> Path:
    root = tmp_path / "save"
    shutil.copytree(FIXTURE, root)
    return root


def _state(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _head(iteration: int) -> mf.Manifest:
    """A head the reader takes (the writer refuses to write any other: manifest.check_written)."""
    layout = mf.Layout(1, 1, None, None, 1, 1, False)
    return mf.head(iteration=iteration, consumed_samples=0, architecture=dict(ARCHITECTURE), layout=layout,
                   optimizer=None, scheduler=None, args={}, rng_saved=False)


def _write(output: Path, iteration: int) -> dict:
    """The universal writer every converter and import_hf go through, with no tensors."""
    return writer.write_checkpoint(str(output), iteration, {}, None, _head(iteration), {}, progress=False)


def test_a_converter_never_moves_a_tracker_back(save):
    before = _state(save)
    with pytest.raises(ConfigError) as e:
        _write(save, 2)  # convert_to_universal of iteration 2 into a save folder at 4
    assert f"{save} is a save folder at iteration 4" in str(e.value) and "move its tracker back" in str(e.value)
    assert _state(save) == before


def test_a_converter_refuses_a_folder_a_live_job_owns(tmp_path):
    out = tmp_path / "owned"
    out.mkdir()
    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / ownership.OWNER).write_text(json.dumps(dict(job="training-run", host=os.uname().nodename,
                                                           pid=run.pid, start=ownership.process_start(run.pid))))
        with pytest.raises(SaveError, match="being written by another job \\(training-run"):
            _write(out, 0)
    finally:
        run.kill()
        run.wait()
    assert not list(out.glob("iter_*"))


def test_a_converter_takes_and_gives_back_the_lock(tmp_path):
    out = tmp_path / "fresh"
    _write(out, 3)
    _write(out, 5)  # a later iteration into the same folder is fine
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert not (out / ownership.OWNER).exists()


def test_output_inside_a_checkpoint_is_refused(save):
    before = _state(save)
    inside = save / "iter_0000004" / "tensors" / "hf"
    with pytest.raises(ConfigError, match=f"lies inside the checkpoint {save / 'iter_0000004'}"):
        hf.export(str(save), str(inside), progress=False)
    with pytest.raises(ConfigError, match="lies inside the checkpoint"):
        _write(save / "iter_0000004" / "out", 0)
    assert _state(save) == before


def test_export_torch_dist_refuses_a_universal_save_folder(save, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    before = _state(save)
    with pytest.raises(ConfigError, match=f"OUT {save} holds universal checkpoints"):
        plan(str(src), str(save), extra=["--tensor-model-parallel-size", "1"])
    assert _state(save) == before


def test_output_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        _write(f, 0)
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        _write(Path("/dev/null"), 0)


def test_import_hf_into_a_save_folder_is_refused(save, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    hf_dir = tmp_path / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32)).float().save_pretrained(hf_dir)
    before = _state(save)
    with pytest.raises(ConfigError, match="is a save folder at iteration 4"):
        hf.import_(str(hf_dir), str(save), progress=False)  # was: tracker 4 -> 0
    assert _state(save) == before
    summary = hf.import_(str(hf_dir), str(tmp_path / "imported"), progress=False)
    assert summary["tensors"] > 0 and not (tmp_path / "imported" / ownership.OWNER).exists()


def test_a_failed_export_torch_dist_leaves_nothing_and_says_disk_full(save, tmp_path, monkeypatch):
    """The workers die writing (megatron's writer reports a full disk as 'unexpected pos 704 vs
    598'): the partial OUT/iter_N is removed, so a rerun is not blocked, and a file system with
    less room than the checkpoint's tensors is called full."""
    from megatron_ucp.convert import export_torch_dist, launch

    out = tmp_path / "out"

    def dying_workers(nproc, module, argv):
        (out / "iter_0000004").mkdir(parents=True)
        (out / "iter_0000004" / "__0_0.distcp").write_bytes(b"partial")
        return 1

    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(launch, "run_workers", dying_workers)
    monkeypatch.setattr(export_torch_dist.os, "statvfs", lambda path: Full())
    job = plan(str(save), str(out), extra=["--tensor-model-parallel-size", "1"])
    with pytest.raises(SaveError) as e:
        export_torch_dist.export(job)
    message = str(e.value)
    assert "exit code 1" in message and "disk full: 0.000 GB free" in message and "rerun starts clean" in message
    assert not (out / "iter_0000004").exists() and not (out / ownership.OWNER).exists()
    plan(str(save), str(out), extra=["--tensor-model-parallel-size", "1"])  # a rerun is not blocked
