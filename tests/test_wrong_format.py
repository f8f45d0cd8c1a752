"""The tools on a checkpoint of another format (issue 38's weak class): inspect on a torch_dist or
legacy folder names that format (it said only 'ucp.json is missing'); convert on a universal
folder says there is nothing to convert (it asked 'a torch_dist checkpoint?'). One line, exit 2."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import REPO

FIXTURE = Path(__file__).parent / "fixtures" / "v1_moe"


def _tool(name, *argv):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, str(REPO / "tools" / name), *map(str, argv)], capture_output=True,
                       text=True, env=env, timeout=120)
    lines = [line for line in r.stderr.splitlines() if "error:" in line]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return lines[0]


def _other(tmp_path: Path, kind: str) -> Path:
    save = tmp_path / kind
    it = save / "iter_0000002"
    it.mkdir(parents=True)
    if kind == "torch_dist":
        (it / ".metadata").write_bytes(b"never read")
        (it / "__0_0.distcp").write_bytes(b"")
    else:
        (it / "mp_rank_00").mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    return save


@pytest.mark.parametrize("kind,evidence", [("torch_dist", ".metadata / *.distcp files"), ("torch", "mp_rank_* folders")])
@pytest.mark.parametrize("which", ["save", "iteration"])
def test_inspect_names_the_format(tmp_path, kind, evidence, which):
    save = _other(tmp_path, kind)
    target = save if which == "save" else save / "iter_0000002"
    line = _tool("inspect_checkpoint.py", target)
    assert f"holds a {kind} checkpoint ({evidence}), not a universal one" in line, line
    assert "convert_to_universal" in line


@pytest.mark.parametrize("which", ["save", "iteration"])
def test_convert_of_a_universal_folder_says_nothing_to_convert(tmp_path, which):
    save = tmp_path / "ucp"
    shutil.copytree(FIXTURE, save)
    target = save if which == "save" else save / "iter_0000004"
    line = _tool("convert_to_universal.py", "--input", target, "--output", tmp_path / "out")
    assert "holds a universal checkpoint (ucp.json) already: nothing to convert" in line, line
    assert not (tmp_path / "out").exists()


def test_convert_of_an_empty_iteration_folder(tmp_path):
    save = tmp_path / "empty"
    (save / "iter_0000002").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    line = _tool("convert_to_universal.py", "--input", save, "--output", tmp_path / "out")
    assert "holds no checkpoint" in line, line
