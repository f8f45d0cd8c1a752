"""A node lost mid-run under torchrun, for either trainer (tests/test_elastic.py: the own loop;
tests/test_megatron_lm.py: Megatron-LM's trainer through the plug-in).

Two torchrun agents on this machine share a c10d rendezvous (--nnodes 1:2, 2 workers each) and
train with --elastic, saving universally. Once a checkpoint is committed and iteration
`kill_after` is logged, one agent and its workers are SIGKILLed (a node lost); the survivor's
workers fail, torchrun restarts them with world size 2, and --elastic resumes the latest
checkpoint on the layout that fits.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from harness import REPO, free_port


def env():
    # A fresh worker store every rendezvous round: torchrun's shared agent store keeps the last
    # round's keys, and gloo's restarted workers then dial the dead workers' addresses.
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore",
                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def read_log(path: Path) -> list:
    """[(iteration, loss)] in the order they were written (several runs append to one file)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
        out.append((r["iteration"], r["loss"]))
    return out


def segments(log: list) -> list:
    """Split the log where the iteration count goes back (a restart from a checkpoint)."""
    parts = [[]]
    for it, loss in log:
        if parts[-1] and it <= parts[-1][-1][0]:
            parts.append([])
        parts[-1].append((it, loss))
    return [p for p in parts if p]


def tracker(ckpt: Path) -> int:
    try:
        return int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    except (FileNotFoundError, ValueError):
        return 0


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL an agent and everything it started (its workers run in sessions of their own)."""
    victims = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_listening(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.net_connections("tcp")):
            return
        time.sleep(0.1)
    raise AssertionError(f"the rendezvous store never listened on port {port}")


def lose_a_node(workdir: Path, python: str, argv: list, ckpt: Path, kill_after: int, min_saved: int,
                timeout: float = 400) -> dict:
    """Run `python pretrain_gpt_ucp.py argv --elastic` on two 2-worker agents, kill one once
    `min_saved` is committed and `kill_after` logged; the survivor finishes. Returns the
    survivor's output, its exit code, the log's segments (before, after the restart), what
    was committed at the kill, and the seconds from the first agent to the kill and the end."""
    log = workdir / "elastic.jsonl"
    port = free_port()
    agent = [python, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", f"elastic-test-{port}", "--rdzv-conf",
             # a dead agent drops out after 3 missed keep-alives 2 s apart (torch: 5 s apart)
             "last_call_timeout=10,keep_alive_interval=2,keep_alive_max_attempt=3",
             "--max-restarts", "3", "--monitor-interval", "0.5",
             str(REPO / "pretrain_gpt_ucp.py"), *argv, "--elastic", "--save", str(ckpt),
             "--load", str(ckpt), "--loss-log", str(log)]
    # Agent 0 starts first and hosts the rendezvous store; agent 1 is the node that dies.
    with open(workdir / "agent0.log", "w") as out0, open(workdir / "agent1.log", "w") as out1:
        survivor = subprocess.Popen(agent, env=env(), cwd=workdir, stdout=out0,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        victim = None
        try:
            wait_listening(port, 60)
            victim = subprocess.Popen(agent, env=env(), cwd=workdir, stdout=out1,
                                      stderr=subprocess.STDOUT, start_new_session=True)
            start = time.monotonic()
            deadline = start + 300
            while not (tracker(ckpt) >= min_saved and read_log(log) and read_log(log)[-1][0] >= kill_after):
                assert time.monotonic() < deadline, "the 4-process elastic run never reached the kill point"
                assert victim.poll() is None and survivor.poll() is None, \
                    "an agent exited early:\n" + (workdir / "agent0.log").read_text()[-4000:]
                time.sleep(0.05)
            kill_node(victim)
            killed_at = time.monotonic()
            saved_at_kill = tracker(ckpt)
            rc = survivor.wait(timeout=timeout)
            finished = time.monotonic()
        finally:
            for p in (survivor, victim):
                if p is not None and p.poll() is None:
                    kill_node(p)
    return {"rc": rc, "output": (workdir / "agent0.log").read_text(), "segments": segments(read_log(log)),
            "saved_at_kill": saved_at_kill, "to_kill": killed_at - start, "after_kill": finished - killed_at}
