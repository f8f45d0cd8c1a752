"""The package as a user installs it (issue 41): `pip wheel --no-deps .`, the wheel installed
non-editable into a fresh venv that sees this interpreter's torch and megatron-core, and its
`megatron-ucp` command run from a folder outside the checkout: help and version, a two-process
training run saved on TP2 and resumed on DP2, inspect, export-torch-dist and convert back.

The venv is made from this venv's base interpreter; after the wheel is installed (into a venv
with nothing else, so pip sees no other megatron-ucp), one .pth line adds this interpreter's
site-packages for torch and megatron-core. A path in a .pth is only appended to sys.path, so the
.pth files inside it (the checkout's editable install) do not run: `import megatron_ucp` can
only find the wheel's copy, which the test checks.
"""

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from harness import BASE, REPO, copy_checkout, free_port


def _install(tmp: Path) -> Path:
    """Build the wheel, install it into a fresh venv; returns the venv's bin folder."""
    src = copy_checkout(tmp / "src")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # a PYTHONPATH holding the checkout (and its egg-info) would have pip find megatron-ucp
    # installed already in the new venv, and install nothing
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(pip + ["wheel", "--no-deps", "-w", str(tmp / "dist"), str(src)], check=True, env=env)
    wheel, = (tmp / "dist").glob("megatron_ucp-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=env)
    subprocess.run(pip + ["--python", str(venv / "bin" / "python"), "install", "--no-deps",
                          str(wheel)], check=True, env=env)
    lib, = (venv / "lib").glob("python3.*/site-packages")
    (lib / "torch_and_megatron_core.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv / "bin"


def _run(bin_dir: Path, cwd: Path, *cmd, check=True):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", OMP_NUM_THREADS="1")
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    if check:
        assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _torchrun(*argv):
    return ["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
            "127.0.0.1", "--master-port", free_port(), *argv]


def _losses(path: Path) -> dict:
    return {r["iteration"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def _tensors(iter_dir: Path) -> dict:
    return {f.name: load_file(str(f)) for f in sorted((iter_dir / "tensors").glob("*.safetensors"))}


def test_installed_wheel_runs_outside_the_checkout(tmp_path):
    bin_dir = _install(tmp_path)
    work = tmp_path / "work"
    work.mkdir()

    where = _run(bin_dir, work, "python", "-c", "import json, sys, megatron_ucp; "
                 "print(json.dumps([megatron_ucp.__file__, sys.path]))")
    module, path = json.loads(where.stdout)
    assert Path(module).is_relative_to(bin_dir.parent), module
    # The one entry allowed inside the checkout is this interpreter's site-packages (torch and
    # megatron-core, from the .pth); a clone's venv lies in the clone (run.sh's .venv).
    shared = {Path(p).resolve() for p in site.getsitepackages()}
    inside = [p for p in path if p and Path(p).resolve().is_relative_to(REPO) and Path(p).resolve() not in shared]
    assert not inside, path
    assert (bin_dir / "megatron-ucp").exists()
    plug_in = _run(bin_dir, work, "python", "-m", "megatron_ucp.megatron_lm", "--help").stdout
    assert plug_in.startswith("usage: python -m megatron_ucp.megatron_lm"), plug_in

    usage = _run(bin_dir, work, "megatron-ucp", "--help").stdout
    for command in ("train", "megatron-lm", "convert", "inspect", "export-hf", "import-hf", "import-deepspeed",
                    "export-torch-dist", "gpu-check"):
        assert f"\n  {command} " in usage, usage
    assert _run(bin_dir, work, "megatron-ucp", "--version").stdout.startswith("megatron-ucp 0.1.0 ")
    bad = _run(bin_dir, work, "megatron-ucp", "inspect", "nothing_here", check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("inspect_checkpoint: error: "), bad.stderr

    # train on TP2 through the console script, save at 3 and 6; resume 3 on DP2 via -m
    _run(bin_dir, work, *_torchrun("--no-python", "megatron-ucp", "train", *BASE,
                                   "--tensor-model-parallel-size", "2", "--train-iters", "6", "--save",
                                   "tp2", "--save-interval", "3", "--loss-log", "tp2.jsonl"))
    _run(bin_dir, work, *_torchrun("-m", "megatron_ucp.train", *BASE, "--train-iters", "6",
                                   "--load", "tp2", "--ckpt-step", "3", "--load-universal",
                                   "--loss-log", "dp2.jsonl"))
    full, resumed = _losses(work / "tp2.jsonl"), _losses(work / "dp2.jsonl")
    assert sorted(resumed) == [4, 5, 6] and sorted(full) == list(range(1, 7))
    assert max(abs(full[i] - resumed[i]) for i in resumed) < 1e-4, (full, resumed)

    table = _run(bin_dir, work, "megatron-ucp", "inspect", "tp2", "--verify").stdout
    assert "iteration" in table and "OK: " in table, table

    # universal -> megatron's torch_dist on TP2 (worker processes of the installed package) -> back
    _run(bin_dir, work, "megatron-ucp", "export-torch-dist", "tp2", "td", "--", "--tensor-model-parallel-size", "2")
    _run(bin_dir, work, "megatron-ucp", "convert", "--input", "td", "--output", "back", "--no-progress")
    saved, back = _tensors(work / "tp2" / "iter_0000006"), _tensors(work / "back" / "iter_0000006")
    assert saved.keys() == back.keys() and saved
    for name in saved:
        assert saved[name].keys() == back[name].keys(), name
        for key in saved[name]:
            np.testing.assert_array_equal(saved[name][key], back[name][key], err_msg=f"{name} {key}")
