"""The plug-in on Megatron-LM's 0.16 trainer, which megatron-core 0.16.1's wheel does not ship:
a Megatron-LM clone at tag core_v0.16.1 gives it (`megatron/training` and the folders it
imports, put beside the wheel's `megatron/core` as a namespace overlay on PYTHONPATH). The
clone is UCP_MEGATRON_LM_CLONE (its checkout root); its trainer also imports `six` and `triton`,
from the interpreter or from UCP_MEGATRON_LM_DEPS (a `pip install --target` folder). Without the
clone these tests skip, saying so: CI has none (README "Megatron-LM's trainer on 0.16")."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import REPO
from mlm_harness import max_delta, run

N, K = 6, 3
TOL = 1e-4
# the folders of the clone that megatron/training imports (0.16.1: legacy's fused kernels, rl, post_training)
OVERLAY = ("training", "legacy", "rl", "post_training")


@pytest.fixture(scope="module")
def clone_trainer(tmp_path_factory):
    """(interpreter, PYTHONPATH folders) of megatron-core 0.16 with the clone's trainer."""
    clone = os.environ.get("UCP_MEGATRON_LM_CLONE")
    if not clone:
        pytest.skip("no Megatron-LM clone: set UCP_MEGATRON_LM_CLONE to a checkout of core_v0.16.1")
    overlay = tmp_path_factory.mktemp("overlay")
    (overlay / "megatron").mkdir()
    for name in OVERLAY:
        source = Path(clone) / "megatron" / name
        assert source.is_dir(), f"UCP_MEGATRON_LM_CLONE={clone} has no megatron/{name}"
        (overlay / "megatron" / name).symlink_to(source)
    path = [overlay] + [Path(p) for p in [os.environ.get("UCP_MEGATRON_LM_DEPS")] if p]
    code = "from megatron_ucp.mcore.compat import core_version; import megatron.training.training; print(core_version())"
    for python in [sys.executable] + [p for p in [os.environ.get("UCP_OTHER_PYTHON")] if p]:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, [REPO, *path]))))
        if proc.returncode == 0 and proc.stdout.strip().endswith("(0, 16, 1)"):
            return python, path
    pytest.fail(f"no megatron-core 0.16.1 interpreter imports the clone's trainer: {proc.stderr[-2000:]}")


def test_the_plug_in_resumes_on_the_016_trainer_on_another_layout(clone_trainer, tmp_path):
    """TP2 saves at K (the 0.16 trainer through `python -m megatron_ucp.megatron_lm --cpu`, the
    project's GPT script); PP2 resumes it with --load-universal within TOL."""
    python, path = clone_trainer
    ckpt = tmp_path / "ckpt"
    ref = run(python, tmp_path / "ref", 2, ["--tensor-model-parallel-size", "2", "--ckpt-format", "universal",
                                            "--save", str(ckpt), "--save-interval", str(K)], N,
              as_script=True, path=path).check()
    resumed = run(python, tmp_path / "resumed", 2, ["--pipeline-model-parallel-size", "2", "--ckpt-format",
                                                    "universal", "--load", str(ckpt), "--ckpt-step", str(K),
                                                    "--load-universal"], N, as_script=True, path=path).check()
    assert f"successfully loaded universal checkpoint from {ckpt} at iteration {K}" in resumed.output
    assert min(resumed.losses()) == K + 1
    assert max_delta(ref.losses(), resumed.losses(), range(K + 1, N + 1)) <= TOL


def test_without_a_trainer_the_plug_in_says_what_to_add():
    """A megatron-core without megatron.training (0.16.1's wheel alone): one line naming what is
    missing and the two ways on, the command's prefix once (it was printed twice, and the refusal
    was by version, so a clone's trainer beside the wheel was refused too)."""
    import importlib.util

    if importlib.util.find_spec("megatron.training") is not None:
        pytest.skip("this interpreter's megatron-core has megatron.training")
    proc = subprocess.run([sys.executable, "-m", "megatron_ucp.megatron_lm", "--cpu",
                           str(REPO / "megatron_ucp" / "megatron_lm" / "gpt.py")], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    lines = [line for line in proc.stderr.splitlines() if "megatron_ucp.megatron_lm: error:" in line]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].count("megatron_ucp.megatron_lm") == 1 and "without megatron.training" in lines[0]
    assert "Megatron-LM clone" in lines[0] and "pretrain_gpt_ucp.py" in lines[0]
