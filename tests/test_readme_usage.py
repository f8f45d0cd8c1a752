"""README.md's "Usage" commands, run as written in a copy of the clone (issue 41): the first run
stops at iteration 200 of a 300-iteration schedule, the resume on another layout trains 201-300
at a learning rate above 0 (a resume that learns), both exit 0, nothing is written into the
repository. About 5 minutes on a busy 2-core machine (4 then 2 CPU processes): slow.

`torchrun` comes from this interpreter's bin folder, as `source .venv/bin/activate` gives it.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import REPO, copy_checkout

LOG = re.compile(r" iteration +(\d+)/ *(\d+) \|.* learning rate: ([0-9.E+-]+) \|.* lm loss: ([0-9.E+-]+) \|")


def section_commands(markdown: str, heading: str) -> list:
    """The shell commands of the ```bash blocks under `heading` (to the next heading of any
    level outside a code block): continuation lines joined, comments and blank lines dropped."""
    commands, inside, in_bash, fenced = [], False, False, False
    for line in markdown.replace("\\\n", " ").splitlines():
        if line.startswith("```"):
            fenced, in_bash = not fenced, not fenced and line.strip() == "```bash"
        elif not fenced and line.startswith("#"):
            inside = line.strip() == heading
        elif inside and in_bash and line.strip() and not line.lstrip().startswith("#"):
            commands.append(line.strip())
    return commands


def _iterations(output: str) -> dict:
    return {int(m[1]): (float(m[3]), float(m[4])) for m in LOG.finditer(output)}


def test_section_commands_reads_blocks():
    text = "# A\n## Usage\ntext\n```bash\n# note\nrun one \\\n    --flag\n\nrun two\n```\n### Next\n```bash\nno\n```\n"
    assert section_commands(text, "## Usage") == ["run one      --flag", "run two"]


@pytest.mark.slow
def test_readme_usage_as_written(tmp_path):
    clone = copy_checkout(tmp_path / "clone")
    first, resume = section_commands((REPO / "README.md").read_text(), "## Usage")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", OMP_NUM_THREADS="1")

    def run(command):
        proc = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True,
                              text=True, timeout=1500)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return _iterations(proc.stdout)

    trained = run(first)
    assert sorted(trained) == list(range(1, 201))
    assert (clone / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "200"
    assert trained[200][0] > 0  # stopped on the way: the schedule goes on to 300
    resumed = run(resume)
    assert sorted(resumed) == list(range(201, 301)), sorted(resumed)
    assert all(lr > 0 for lr, _ in (resumed[i] for i in range(201, 300))), resumed
    # the resumed run continues the same cosine (the saved schedule): its rate keeps falling
    assert trained[200][0] > resumed[201][0] > resumed[250][0] > resumed[299][0]
