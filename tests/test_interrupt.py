"""Ctrl-C (SIGINT to torchrun, which passes it on to its workers) in the middle of saves (issue
38's weak class): the job ends within seconds, without a traceback of ours, and the checkpoint
the tracker names verifies (before: 30 s, one rank stuck in a collective until torchrun's
SIGKILL, tracebacks from every rank)."""

import os
import signal
import subprocess
import sys
import time

from harness import BASE, REPO, free_port

from megatron_ucp.format.inspection import verify


def test_ctrl_c_during_saves_ends_the_job_at_once(tmp_path):
    save = tmp_path / "save"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    log = tmp_path / "job.log"
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                            "--master-port", str(free_port()), str(REPO / "pretrain_gpt_ucp.py"), *BASE,
                            "--tensor-model-parallel-size", "2", "--train-iters", "100000", "--save", str(save),
                            "--save-interval", "1"], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        tracker = save / "latest_checkpointed_iteration.txt"
        deadline = time.time() + 180
        while (not tracker.exists() or int(tracker.read_text() or 0) < 3) and job.poll() is None \
                and time.time() < deadline:
            time.sleep(0.05)
        assert job.poll() is None and tracker.exists(), log.read_text()[-3000:]
        start = time.perf_counter()
        job.send_signal(signal.SIGINT)
        job.wait(timeout=60)
        seconds = time.perf_counter() - start
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    out = log.read_text()
    assert seconds < 10, (seconds, out[-3000:])
    # torchrun's own, of its launcher, is the only one (before: one per worker as well)
    tracebacks = out.split("Traceback (most recent call last):")[1:]
    assert len(tracebacks) == 1 and "torch/distributed/run.py" in tracebacks[0], out[-4000:]
    assert verify(str(save)) == []
