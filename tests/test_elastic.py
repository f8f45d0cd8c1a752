"""Elastic training under torchrun: a node dies mid-run, the survivor continues on a new layout.

Two torchrun agents on this machine share a c10d rendezvous (--nnodes 1:2, 2 workers each) and
train TP2 x DP2 with the distributed optimizer, saving universally. One agent and its workers
are SIGKILLed (a node lost); the survivor's workers fail, torchrun restarts them with world size
2, and --elastic resumes the latest checkpoint on TP2 x DP1 with the same global batch. The
losses must match an uninterrupted 4-process run.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness import BASE, REPO, free_port

pytestmark = pytest.mark.slow  # 2-6 minutes on 2 busy CPU cores; run by hand (docs/elastic.md)

N, SAVE_INTERVAL, KILL_AFTER = 16, 4, 6  # train to N; kill once iteration KILL_AFTER is logged
ARGS = BASE + ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
               "--train-iters", str(N), "--save-interval", str(SAVE_INTERVAL),
               "--distributed-timeout-minutes", "1"]


def env():
    # A fresh worker store every rendezvous round: torchrun's shared agent store keeps the last
    # round's keys, and gloo's restarted workers then dial the dead workers' addresses.
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore",
                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def read_log(path: Path) -> list:
    """[(iteration, loss)] in the order rank 0 wrote them (several runs append to one file)."""
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


def test_node_loss_resumes_on_fewer_ranks(tmp_path):
    start = time.monotonic()
    # The uninterrupted reference: 4 processes, TP2 x DP2.
    ref_log = tmp_path / "ref.jsonl"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                    "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                    str(REPO / "pretrain_gpt_ucp.py"), *ARGS, "--save", str(tmp_path / "ref"),
                    "--loss-log", str(ref_log)],
                   env=env(), cwd=tmp_path, capture_output=True, text=True, timeout=600, check=True)
    reference = dict(read_log(ref_log))
    assert sorted(reference) == list(range(1, N + 1))
    ref_seconds = time.monotonic() - start

    # The elastic run: two agents ("nodes") of 2 workers in one rendezvous.
    ckpt, log = tmp_path / "ckpt", tmp_path / "elastic.jsonl"
    port = free_port()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-id", f"elastic-test-{port}", "--rdzv-conf", "last_call_timeout=10",
             "--max-restarts", "3", "--monitor-interval", "0.5",
             str(REPO / "pretrain_gpt_ucp.py"), *ARGS, "--elastic", "--save", str(ckpt),
             "--load", str(ckpt), "--loss-log", str(log)]
    # Agent 0 starts first and hosts the rendezvous store; agent 1 is the node that dies.
    with open(tmp_path / "agent0.log", "w") as out0, open(tmp_path / "agent1.log", "w") as out1:
        survivor = subprocess.Popen(agent, env=env(), cwd=tmp_path, stdout=out0,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        victim = None
        try:
            wait_listening(port, 60)
            victim = subprocess.Popen(agent, env=env(), cwd=tmp_path, stdout=out1,
                                      stderr=subprocess.STDOUT, start_new_session=True)
            elastic_start = time.monotonic()
            deadline = elastic_start + 300
            while not (tracker(ckpt) >= SAVE_INTERVAL and read_log(log)
                       and read_log(log)[-1][0] >= KILL_AFTER):
                assert time.monotonic() < deadline, "the 4-process elastic run never reached the kill point"
                assert victim.poll() is None and survivor.poll() is None, "an agent exited early"
                time.sleep(0.05)
            kill_node(victim)
            killed_at = time.monotonic()
            saved_at_kill = tracker(ckpt)
            rc = survivor.wait(timeout=400)
            finished = time.monotonic()
        finally:
            for p in (survivor, victim):
                if p is not None and p.poll() is None:
                    kill_node(p)
    text = (tmp_path / "agent0.log").read_text()
    assert rc == 0, text[-6000:]

    parts = segments(read_log(log))
    assert len(parts) == 2, parts
    before, after = parts
    last_before = before[-1][0]
    resumed_from = after[0][0] - 1
    assert last_before < N, "the kill came after the end of training"
    assert resumed_from >= saved_at_kill >= SAVE_INTERVAL  # nothing committed before the kill is lost
    assert 0 <= last_before - resumed_from <= SAVE_INTERVAL  # iterations redone
    assert after[-1][0] == N and tracker(ckpt) == N
    # The survivor restarted its workers on 2 ranks and the policy kept TP2: TP2 x DP1.
    assert "elastic: world size 2: training on TP2 PP1 DP1, 4 micro-batches per step" in text, text[-4000:]
    assert f"resuming iteration {resumed_from} saved on TP2 PP1 DP2 on 4 ranks" in text
    delta_before = max(abs(loss - reference[it]) for it, loss in before)
    delta_after = max(abs(loss - reference[it]) for it, loss in after)
    assert delta_before < 1e-4 and delta_after < 1e-4, (delta_before, delta_after)
    print(f"\nreference 4-process run {ref_seconds:.1f} s; elastic run {finished - elastic_start:.1f} s, "
          f"of which {finished - killed_at:.1f} s after the kill; killed after iteration {last_before}, "
          f"resumed from {resumed_from} ({last_before - resumed_from} redone); max |loss - reference| "
          f"{delta_before:.2e} before, {delta_after:.2e} after")
