"""examples/slurm/pretrain.sbatch's decision after its training step, without Slurm.

The script runs under bash with stand-ins for `srun` (writes loss-log lines, exits as told, or
waits for SIGTERM) and `scontrol` (records what it was asked). What matters: a setup error (the
step fails before its first iteration) ends the job instead of being requeued three times, a
failure after training is requeued, a stop before the time limit (SIGUSR1) is requeued and
exits 0, and a SIGTERM (scancel, preemption) saves and ends the job. Everything a script writes
goes under the RUN_DIR it is given: nothing into the repository.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "examples" / "slurm"

SRUN = r"""#!/bin/bash
log=""; prev=""
for a in "$@"; do [ "$prev" = --loss-log ] && log=$a; prev=$a; done
for i in $(seq "${STUB_ITERATIONS:-0}"); do echo "{\"iteration\": $i}" >> "$log"; done
if [ -n "${STUB_WAIT_TERM:-}" ]; then
    echo $$ > "$STUB_DIR/srun.pid"
    trap 'echo "{\"iteration\": 99}" >> "$log"; exit 1' TERM  # torchrun: workers saved, exits 1
    touch "$STUB_DIR/started"
    for _ in $(seq 600); do sleep 0.1; done  # a minute at most, should the script never signal
    exit 3
fi
exit "${STUB_RC:-0}"
"""

SCANCEL = r"""#!/bin/bash
echo "$*" >> "$STUB_DIR/scancel.log"
kill -TERM "$(cat "$STUB_DIR/srun.pid")"  # --signal=TERM: to the step's processes
"""

SCONTROL = r"""#!/bin/bash
if [ "$1" = show ] && [ "$2" = hostnames ]; then echo node1; exit 0; fi
echo "$*" >> "$STUB_DIR/scontrol.log"
"""


def _repository_outputs() -> dict:
    """What the scripts would write into the repository by default: runs/, job output files."""
    found = [p for p in (REPO / "runs").rglob("*") if p.is_file()] + list(REPO.glob("*.out"))
    return {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in found}


@pytest.fixture(autouse=True)
def nothing_into_the_repository():
    before = _repository_outputs()
    yield
    assert _repository_outputs() == before, "a script wrote into the repository"


@pytest.mark.parametrize("rc,signalled,iterations,restarts,expected", [
    (0, 0, 10, 0, "done"),
    (1, 0, 0, 0, "setup"),      # import error, bad argument: fails before iteration 1
    (2, 0, 0, 2, "setup"),
    (1, 0, 5, 0, "failed"),     # trained, then lost the rendezvous host / ran out of restarts
    (1, 0, 5, 2, "failed"),
    (1, 0, 5, 3, "exhausted"),
    (1, "limit", 5, 7, "stopped"),  # torchrun got SIGTERM: exits 1, its workers saved and exit 0
    (0, "limit", 1, 0, "stopped"),
    (1, "limit", 0, 0, "stalled"),   # the warning came before iteration 1: every requeue would too
    (1, "term", 5, 0, "cancelled"),  # scancel, preemption: saved, and not requeued by the script
])
def test_after_training(rc, signalled, iterations, restarts, expected):
    out = subprocess.run(
        ["bash", "-c", f'source "$1"; after_training {rc} {signalled} {iterations} {restarts} 3',
         "bash", str(SLURM / "requeue.sh")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


def _job(tmp_path, script="pretrain.sbatch", **stub):
    """Start `script` with the stand-ins first on PATH; returns (process, stub folder)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("scancel", SCANCEL)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", STUB_DIR=str(tmp_path),
               REPO_DIR=str(REPO), RUN_DIR=str(tmp_path / "run"), SLURM_JOB_ID="17",
               SLURM_JOB_NODELIST="node1", SLURM_JOB_NUM_NODES="1", SLURM_RESTART_COUNT="0",
               **{k: str(v) for k, v in stub.items()})
    proc = subprocess.Popen(["bash", str(SLURM / script)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, tmp_path


def _requeues(stub_dir: Path) -> list:
    log = stub_dir / "scontrol.log"
    return [line for line in log.read_text().splitlines() if "requeue" in line] if log.exists() else []


def test_setup_failure_is_not_requeued(tmp_path):
    proc, stub_dir = _job(tmp_path, STUB_RC=1, STUB_ITERATIONS=0)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert _requeues(stub_dir) == [], out
    assert "a setup error, not requeued" in out


def test_failure_after_training_is_requeued(tmp_path):
    proc, stub_dir = _job(tmp_path, STUB_RC=1, STUB_ITERATIONS=3)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert _requeues(stub_dir) == ["requeue 17"], out


def test_earlier_allocations_do_not_count(tmp_path):
    """Lines an earlier allocation logged are not this step's iterations."""
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "losses.jsonl").write_text('{"iteration": 1}\n' * 5)
    proc, stub_dir = _job(tmp_path, STUB_RC=1, STUB_ITERATIONS=0)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and _requeues(stub_dir) == [], out


def _wait_started(proc, stub_dir: Path) -> None:
    deadline = time.monotonic() + 30
    while not (stub_dir / "started").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)


def test_time_limit_stop_is_requeued_and_exits_0(tmp_path):
    proc, stub_dir = _job(tmp_path, STUB_WAIT_TERM=1, STUB_ITERATIONS=2)
    _wait_started(proc, stub_dir)
    proc.send_signal(signal.SIGUSR1)  # --signal=B:USR1@N: the batch script only
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert (stub_dir / "scancel.log").read_text().split() == ["--signal=TERM", "17"], out
    assert _requeues(stub_dir) == ["requeue 17"], out
    assert "after 3 iteration(s)" in out


def test_sigterm_stop_is_not_requeued(tmp_path):
    """scancel (and a preemption) signals the step itself and the batch script: save, end."""
    proc, stub_dir = _job(tmp_path, STUB_WAIT_TERM=1, STUB_ITERATIONS=2)
    _wait_started(proc, stub_dir)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the trap runs before the step ends, as under Slurm (both signalled at once)
    os.kill(int((stub_dir / "srun.pid").read_text()), signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert _requeues(stub_dir) == [] and not (stub_dir / "scancel.log").exists(), out


def test_resume_other_layout_time_limit_and_sigterm(tmp_path):
    """resume_other_layout.sbatch: the time-limit warning requeues, a SIGTERM does not; the
    checkpoint is RUN_DIR/checkpoints unless CKPT_DIR names one, the losses go to RUN_DIR/logs."""
    for name, signum, requeues in (("limit", signal.SIGUSR1, ["requeue 17"]), ("term", signal.SIGTERM, [])):
        ckpt = tmp_path / name / ("run/checkpoints" if name == "limit" else "elsewhere")
        ckpt.mkdir(parents=True)
        (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
        named = {} if name == "limit" else {"CKPT_DIR": ckpt}
        proc, stub_dir = _job(tmp_path / name, "resume_other_layout.sbatch", STUB_WAIT_TERM=1,
                              PYTHON="true", **named)
        _wait_started(proc, stub_dir)
        proc.send_signal(signum)
        if signum == signal.SIGTERM:
            time.sleep(0.5)
            os.kill(int((stub_dir / "srun.pid").read_text()), signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, out
        assert _requeues(stub_dir) == requeues, out
        assert f"resuming {ckpt} (iteration 4)" in out
        assert (tmp_path / name / "run" / "logs" / "losses.jsonl").read_text() == '{"iteration": 99}\n'
