"""The tools' worker processes die with them (issue 38, bug 8): torchrun starts its workers in
sessions of their own, so a SIGKILL of export_torch_dist's process group left them running for
minutes (370 MB each). torchrun and the workers now ask the kernel to kill them when their
parent dies (launch.die_with_parent, PR_SET_PDEATHSIG)."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness import REPO

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

FIXTURE = Path(__file__).parent / "fixtures" / "v1_moe"


def _workers(pid: int) -> list:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            cmd = " ".join(k.cmdline())
        except psutil.Error:
            continue
        if "megatron_ucp.train.workers" in cmd and "torch.distributed.run" not in cmd and "torchrun" not in cmd:
            out.append(k)
    return out


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_killing_export_torch_dist_kills_its_workers(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    tool = subprocess.Popen([sys.executable, str(REPO / "tools" / "export_torch_dist.py"), str(src),
                             str(tmp_path / "out"), "--nproc", "2", "--", "--tensor-model-parallel-size", "1",
                             "--expert-model-parallel-size", "2"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    workers = []
    try:
        deadline = time.time() + 120
        while len(workers) < 2 and tool.poll() is None and time.time() < deadline:
            workers = _workers(tool.pid)
            time.sleep(0.1)
        assert len(workers) == 2 and tool.poll() is None, "the export's workers never started"
        time.sleep(1.0)
        assert all(_alive(w) for w in workers) and tool.poll() is None
        os.killpg(tool.pid, signal.SIGKILL)  # the tool and torchrun; the workers are in sessions of their own
        tool.wait()
        deadline = time.time() + 15
        while any(_alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), [w.pid for w in workers if _alive(w)]
    finally:
        for w in workers:
            try:
                w.kill()
            except psutil.NoSuchProcess:
                pass
        if tool.poll() is None:
            os.killpg(tool.pid, signal.SIGKILL)
            tool.wait()


_GLOO_WORKER = """import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w").write(str(int(t.item())))
dist.destroy_process_group()
"""


def test_the_workers_rendezvous_on_a_port_no_other_process_can_take_first(tmp_path, monkeypatch):
    """run_workers once picked a free port, closed it and handed it to torchrun: a port another
    process took meanwhile (simulated: the pick is a port this test listens on) failed the
    conversion with EADDRINUSE. torchrun's rendezvous store now binds port 0 itself."""
    import socket

    from megatron_ucp.convert import launch

    (tmp_path / "gloo_worker.py").write_text(_GLOO_WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(launch, "free_port", lambda: taken.getsockname()[1], raising=False)
        assert launch.run_workers(2, "gloo_worker", [str(tmp_path)]) == 0
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["2", "2"]
