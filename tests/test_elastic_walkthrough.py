"""docs/elastic.md's "Trying it on one machine", its commands run as written on a real Slurm
(issue 41), in a copy of the clone: the reference run, the job cut by its 3-minute limit,
requeued and resumed, the comparison (max |dloss| 0.0), the one-process resume on another
layout. About 8 minutes on 2 cores (slow); it needs Slurm installed
(`bash examples/slurm/local_cluster.sh install`, as root) and skips, saying so, without it.

Three lines are not run as written: `bash run.sh test ...` (it would make a venv: the copy's
.venv is a link to this interpreter's instead), `local_cluster.sh install` when Slurm is already
there, and `tail -f`, which never ends: it waits for `squeue` to be empty instead.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import REPO, copy_checkout

WAIT = 'sleep 5; while [ -n "$(squeue -h)" ]; do sleep 5; done'


def walkthrough(markdown: str, heading: str, venv: Path, installed: bool) -> str:
    """The section's ```bash blocks (to the next heading outside a code block) as one script,
    with the three lines above replaced."""
    lines, inside, fenced, in_bash = [], False, False, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced, in_bash = not fenced, not fenced and line.strip() == "```bash"
        elif not fenced and line.startswith("#"):
            inside = line.strip() == heading
        elif inside and in_bash:
            if line.startswith("bash run.sh test"):
                line = f"ln -s {venv} .venv"
            elif line.startswith("bash examples/slurm/local_cluster.sh install") and installed:
                continue
            elif line.startswith("tail -f"):
                line = WAIT
            lines.append(line)
    return "\n".join(lines)


def test_walkthrough_script_replaces_only_what_it_says():
    text = ("## Other\n### Trying it on one machine\nwords\n```bash\nbash run.sh test x\n"
            "bash examples/slurm/local_cluster.sh install   # apt\nsource env\ntail -f out   # note\n```\n"
            "more\n```bash\ncmd \\\n  --flag\n```\n### Next\n```bash\nnot this\n```\n")
    script = walkthrough(text, "### Trying it on one machine", Path("/v"), installed=True)
    assert script.splitlines() == ["ln -s /v .venv", "source env", WAIT, "cmd \\", "  --flag"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("sbatch") is None or os.geteuid() != 0,
                    reason="needs Slurm (bash examples/slurm/local_cluster.sh install) and root")
def test_one_machine_walkthrough_as_written(tmp_path):
    clone = copy_checkout(tmp_path / "clone")
    script = walkthrough((REPO / "docs" / "elastic.md").read_text(), "### Trying it on one machine",
                         Path(sys.prefix), installed=True)
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    proc = subprocess.run(["bash", "-c", script], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=1800)
    run = clone / "runs" / "cpu-demo"
    jobs = {p.name: p.read_text() for p in run.glob("*.out")}
    story = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\n" + "\n".join(f"== {k}\n{v[-3000:]}" for k, v in jobs.items())
    assert proc.returncode == 0, story
    iterations = int((run / "reference" / "latest_checkpointed_iteration.txt").read_text())
    assert f"{iterations} iterations; max |dloss| = 0.0" in proc.stdout, story
    train = next(v for k, v in jobs.items() if k.startswith("gpt-ucp-") and "resume" not in k)
    assert "time limit near: saving and stopping" in train and "requeueing job" in train, story
    assert re.search(r"resuming iteration \d+ saved on TP2 PP1 DP1 on 2 ranks", train), story
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(iterations)
    resume = next(v for k, v in jobs.items() if k.startswith("gpt-ucp-resume-"))
    assert "BrokenPipeError" not in resume and "Traceback" not in resume, story
    assert (run / "tp1" / "latest_checkpointed_iteration.txt").read_text().strip() == str(iterations + 100)
