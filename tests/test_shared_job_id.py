"""Two launches with one job id on one --save folder (issue 38, bug 3): `examples/slurm` passes
`--rdzv-id $SLURM_JOB_ID`, so two torchrun steps of one allocation carry the same id. The owner
lock refuses a live rank 0 on this host (pid alive, same start time) whatever the id says."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import BASE, REPO, free_port

from megatron_ucp.engine import ownership
from megatron_ucp.errors import SaveError


def _record(folder: Path, **fields) -> Path:
    path = folder / ownership.OWNER
    record = dict(job=ownership.job_id(), host=os.uname().nodename, pid=os.getppid(),
                  start=ownership.process_start(os.getppid()))
    record.update(fields)
    path.write_text(json.dumps(record))
    return path


def test_a_live_process_with_this_job_id_is_refused(tmp_path):
    path = _record(tmp_path)  # our parent: alive, another process, the same job id
    with pytest.raises(SaveError) as e:
        ownership.claim(str(tmp_path))
    assert f"a live process of a job with the same id ({ownership.job_id()}, pid {os.getppid()}" in str(e.value)
    assert "--rdzv-id" in str(e.value) and f"delete {path}" in str(e.value)
    assert json.loads(path.read_text())["pid"] == os.getppid()


def test_this_process_and_a_dead_predecessor_keep_the_folder(tmp_path):
    _record(tmp_path, pid=os.getpid(), start=ownership.process_start(os.getpid()))
    ownership.claim(str(tmp_path))  # a later save of the same process
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    start = ownership.process_start(proc.pid)
    proc.wait()
    _record(tmp_path, pid=proc.pid, start=start)  # a restarted worker's predecessor
    ownership.claim(str(tmp_path))
    assert json.loads((tmp_path / ownership.OWNER).read_text())["pid"] == os.getpid()


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ownership.OWNER}


def _launch(save: Path, rdzv_id: str, extra: list, log: Path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--rdzv-id", rdzv_id,
           "--master-port", str(free_port()), str(REPO / "pretrain_gpt_ucp.py"), *BASE, "--save", str(save),
           "--log-interval", "1", *extra]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)


def _tracker(save: Path):
    try:
        return int((save / "latest_checkpointed_iteration.txt").read_text())
    except (FileNotFoundError, ValueError):
        return None


def test_second_launch_with_the_same_rdzv_id_is_refused_before_training(tmp_path):
    """The first job saves every 10 iterations and goes on; the second (another --lr, saving
    every iteration, so its folders would be odd-numbered) is refused at start-up; the first's
    checkpoints are byte for byte as they were and its next save succeeds."""
    save, id_ = tmp_path / "save", "job-4242"
    first = _launch(save, id_, ["--train-iters", "100000", "--save-interval", "10"], tmp_path / "first.log")
    worker = None
    try:
        deadline = time.time() + 180
        while (_tracker(save) or 0) < 10 and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert (_tracker(save) or 0) >= 10, (tmp_path / "first.log").read_text()[-3000:]
        worker = json.loads((save / ownership.OWNER).read_text())["pid"]  # torchrun's worker: its own session
        before = _snapshot(save)
        reached = _tracker(save)
        second = _launch(save, id_, ["--train-iters", "5", "--save-interval", "1", "--lr", "1e-3"],
                         tmp_path / "second.log")
        code = second.wait(timeout=180)
        out = (tmp_path / "second.log").read_text()
        lines = [line for line in out.splitlines() if "pretrain_gpt_ucp.py: error:" in line]
        assert code != 0 and len(lines) == 1, out[-3000:]
        assert "a live process of a job with the same id (job-4242" in lines[0], lines[0]
        assert " iteration " not in out, out[-3000:]
        after = _snapshot(save)
        assert {k: after.get(k) for k in before if k != "latest_checkpointed_iteration.txt"} == \
            {k: v for k, v in before.items() if k != "latest_checkpointed_iteration.txt"}
        assert not [p.name for p in save.glob("iter_*") if int(p.name[5:]) % 10], "the second job saved"
        assert _tracker(save) >= reached  # never moved back
        deadline = time.time() + 120
        while _tracker(save) == reached and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert first.poll() is None and _tracker(save) > reached, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        for pid in (worker, first.pid):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        first.wait()
