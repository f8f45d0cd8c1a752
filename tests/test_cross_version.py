"""Checkpoints move between megatron-core releases: saved under one, resumed under the other on
another layout, and the reverse; the atomic names are the same under both.

The other release's interpreter is UCP_OTHER_PYTHON (run.sh sets it when the other venv exists:
`UCP_CORE=0.19 bash run.sh setup` makes megatron-core 0.19's, `bash run.sh setup` 0.16's).
Without it these tests skip, saying so; with UCP_REQUIRE_OTHER=1 (CI) they fail instead.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from harness import REPO, losses, max_loss_delta, ok, run_steps, train_step
from test_mapping import VARIANTS, names_step

N, K = 10, 5
TOL = 1e-4
TP2_DIST = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
PP2 = ["--pipeline-model-parallel-size", "2"]
GQA = ["--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
       "--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
       "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear"]
ENABLE = ("UCP_OTHER_PYTHON=<the other megatron-core's python>; `UCP_CORE=0.19 bash run.sh setup` "
          "then `bash run.sh test` sets it")


def core_version(python: str) -> str:
    code = "from megatron.core import package_info; print(package_info.__version__)"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, f"{python} cannot import megatron.core:\n{proc.stderr[-2000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def other() -> str:
    python = os.environ.get("UCP_OTHER_PYTHON")
    if not python:
        if os.environ.get("UCP_REQUIRE_OTHER") == "1":
            pytest.fail(f"UCP_REQUIRE_OTHER=1 but UCP_OTHER_PYTHON is not set ({ENABLE})")
        pytest.skip(f"no second megatron-core environment: {ENABLE}")
    assert os.access(python, os.X_OK), f"UCP_OTHER_PYTHON={python} is not an executable"
    mine, theirs = core_version(sys.executable), core_version(python)
    assert mine != theirs, f"UCP_OTHER_PYTHON runs megatron-core {theirs}, the same as this one"
    return python


@pytest.mark.slow  # run by hand (CI time): the cross-release resumes load every name
def test_atomic_names_are_the_same_under_both(other, tmp_path):
    layouts = {"tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
               "ep2": ["--expert-model-parallel-size", "2", "--use-distributed-optimizer"]}
    steps = []
    for variant in VARIANTS:
        for layout, extra in layouts.items():
            if layout == "ep2" and "--num-experts" not in VARIANTS[variant]:
                continue
            step = names_step(variant, "tp1")
            step["name"], step["argv"] = f"{variant}:{layout}", step["argv"] + extra
            steps.append(step)
    mine = run_steps(2, steps, tmp_path / "mine")
    theirs = run_steps(2, steps, tmp_path / "theirs", python=other)
    for step in steps:
        a, b = set(ok(mine, step["name"])["names"]), set(ok(theirs, step["name"])["names"])
        assert a == b, (step["name"], sorted(a ^ b)[:6])


@pytest.mark.parametrize("model", [pytest.param("gqa", marks=pytest.mark.slow), "moe"])  # gqa by hand (CI time)
def test_resume_under_the_other_release_on_another_layout(other, tmp_path, model):
    """This release saves on TP2 (distributed optimizer), the other resumes on PP2; the other
    saves on PP2, this one resumes on TP2: each resumed run's losses are its source run's."""
    extra = GQA if model == "gqa" else MOE
    save_layout = TP2_DIST if model == "gqa" else ["--expert-model-parallel-size", "2"] + TP2_DIST[2:]
    d = lambda name: str(tmp_path / name)  # noqa: E731
    mine = run_steps(2, [train_step("save_mine", extra + save_layout, iters=N, save=d("mine"), interval=K)],
                     tmp_path / "w_mine")
    theirs = run_steps(2, [
        train_step("save_theirs", extra + PP2, iters=N, save=d("theirs"), interval=K),
        train_step("resume_mine", extra + PP2, iters=N, load=d("mine"), step=K),
    ], tmp_path / "w_theirs", python=other)
    back = run_steps(2, [train_step("resume_theirs", extra + save_layout, iters=N, load=d("theirs"), step=K)],
                     tmp_path / "w_back")
    assert sorted(losses(theirs, "resume_mine")) == list(range(K + 1, N + 1))
    assert max_loss_delta(losses(mine, "save_mine"), losses(theirs, "resume_mine")) <= TOL
    assert sorted(losses(back, "resume_theirs")) == list(range(K + 1, N + 1))
    assert max_loss_delta(losses(theirs, "save_theirs"), losses(back, "resume_theirs")) <= TOL


def test_torch_dist_of_the_other_release_converts_and_resumes_here(other, tmp_path):
    """The other release saves megatron's own torch_dist (0.19 keeps the common state inside
    the DCP files, 0.16 in common.pt); this release's converter makes it universal and this
    release resumes it on another layout with the source run's losses."""
    d = lambda name: str(tmp_path / name)  # noqa: E731
    theirs = run_steps(2, [train_step("torch_dist_theirs", GQA + TP2_DIST + ["--ckpt-format", "torch_dist"],
                                      iters=N, save=d("native"), interval=K)], tmp_path / "w_theirs", python=other)
    ok(theirs, "torch_dist_theirs")
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_to_universal.py"), "--input", d("native"),
                           "--output", d("converted"), "--iteration", str(K)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    mine = run_steps(2, [train_step("resume_converted", GQA + PP2, iters=N, load=d("converted"), step=K)],
                     tmp_path / "w_mine")
    assert sorted(losses(mine, "resume_converted")) == list(range(K + 1, N + 1))
    assert max_loss_delta(losses(theirs, "torch_dist_theirs"), losses(mine, "resume_converted")) <= TOL


# One job script for every release (issue 49): the command line of a user who moves a 0.16 job
# (the own loop) to 0.19 (Megatron-LM's trainer) unchanged, as README "Which trainer" gives it:
# no --tokenizer-type (mock data takes a NullTokenizer of --vocab-size entries in both, nothing
# downloaded), no --eval-interval (0.19's default used to fail), `--load ckpt --load-universal`
# (the plug-in's parser refused it), the same --train-iters throughout (Megatron-LM's scheduler
# checks it). Run as written, in a folder of its own (its `ckpt` relative).
def readme_job() -> list:
    from test_readme_usage import section_commands

    commands = section_commands((REPO / "README.md").read_text(), "## Which trainer")
    [command] = [c for c in commands if "pretrain_gpt_ucp.py" in c]
    return shlex.split(command.split("pretrain_gpt_ucp.py", 1)[1])


def test_one_job_script_resumes_on_both_releases(other, tmp_path):
    """The README's command trains to 6 (saving at 3 and 6) on each release; the same command
    resumes a folder holding that run's iteration 3 (a job stopped there): iterations 4-6
    within TOL of the uninterrupted run's, on each. Both build the same model."""
    from mlm_harness import max_delta, run

    job = readme_job()
    assert "--load-universal" in job and "--tokenizer-type" not in job and "--eval-interval" not in job
    manifests = {}
    for name, python in (("mine", sys.executable), ("theirs", other)):
        ref = run(python, tmp_path / name / "ref", 1, [], 6, base=job).check()
        resume_dir = tmp_path / name / "resume"
        shutil.copytree(tmp_path / name / "ref" / "ckpt" / "iter_0000003", resume_dir / "ckpt" / "iter_0000003")
        (resume_dir / "ckpt" / "latest_checkpointed_iteration.txt").write_text("3\n")
        resumed = run(python, resume_dir, 1, [], 6, base=job).check()
        assert sorted(resumed.losses()) == [4, 5, 6], resumed.output[-3000:]
        assert max_delta(ref.losses(), resumed.losses(), range(4, 7)) <= TOL, name
        assert "GPT2BPE" not in resumed.output and "wget" not in resumed.output
        manifests[name] = json.loads((tmp_path / name / "ref" / "ckpt" / "iter_0000003" / "ucp.json").read_text())
    # the same model: the same architecture (true vocabulary included), padding and tensors
    assert manifests["mine"]["architecture"] == manifests["theirs"]["architecture"]
    assert manifests["mine"]["layout"]["padded_vocab_size"] == manifests["theirs"]["layout"]["padded_vocab_size"]
    assert sorted(manifests["mine"]["tensors"]) == sorted(manifests["theirs"]["tensors"])
