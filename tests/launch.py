"""Start a one-node group of worker processes as torchrun does, without torchrun's agent.

torchrun's agent is one more Python process that imports torch and rendezvouses before any
worker starts: about 2 s on this 2-core machine, paid by each of the suite's hundred-odd
groups, serially. Tests whose subject is not the launcher (the runner's groups, most trainer
runs) start their workers here instead; tests of what torchrun itself does (elastic restarts,
signals forwarded to a job step, rendezvous ids, the README's commands) keep torchrun.

What the workers see is what torchrun's static rendezvous gives them: the same environment
variables (but TORCHELASTIC_USE_AGENT_STORE: rank 0 hosts the store, as in env:// without an
agent), output into the launcher's, and, as torchrun does, the other workers stopped when one
fails, and exit status 1 then.

`run_forked`: the same group forked from a warm interpreter (a "zygote") that imported torch and
megatron-core once. A worker's start-up is otherwise mostly those imports (about 5 s of CPU per
worker, 10 s of wall time for 4 workers on 2 cores), paid again by each of the runner's groups
and each of Megatron-LM's trainer runs (tests/mlm_harness.py; they import megatron.training
themselves, after the checkout's modules, as a fresh interpreter would).
The zygote imports third-party modules only, never this checkout's, and runs one thread, so a
forked worker starts as a fresh interpreter would: its environment, working folder, argv and
output are the group's, its random state reseeded, and it ends through the interpreter's own
shutdown (threads joined, atexit), so its exit status is the script's. A group's argv is a
script's path and its arguments, or "-m", a module and its arguments (as `python -m`).
"""

import atexit
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

GRACE = 5.0  # seconds between SIGTERM and SIGKILL for the rest of a failed group (torchrun: 30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(python: str, nproc: int, argv: list, env: dict, cwd, timeout: float, started) -> subprocess.CompletedProcess:
    """run_forked (run_group with UCP_TEST_FORK=0) on a free port, again on another one (three
    tries) when that port was taken by another process before rank 0 listened on it (EADDRINUSE)
    and `started()` says no worker got going."""
    run = run_forked if os.environ.get("UCP_TEST_FORK", "1") == "1" else run_group
    for _ in range(3):
        proc = run(python, nproc, argv, env, cwd, free_port(), timeout)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr or started():
            break
    return proc


def worker_env(base: dict, rank: int, nproc: int, port: int) -> dict:
    """torchrun's variables for `rank` of a one-node group of `nproc` (--master-port `port`)."""
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
               ROLE_NAME="default", WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
               ROLE_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
               TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_group(python: str, nproc: int, argv: list, env: dict, cwd, port: int,
              timeout: float) -> subprocess.CompletedProcess:
    """Run `python argv` as ranks 0..nproc-1; the CompletedProcess of the group (returncode 0 when
    every worker exited 0, else 1, as torchrun's). Raises subprocess.TimeoutExpired, after
    killing the workers, past `timeout` seconds."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        workers = [subprocess.Popen([python, *argv], env=worker_env(env, rank, nproc, port), cwd=cwd,
                                    stdout=out, stderr=err, start_new_session=True)
                   for rank in range(nproc)]
        try:
            failed = _wait(workers, time.monotonic() + timeout)
        except subprocess.TimeoutExpired:
            _stop(workers)
            raise subprocess.TimeoutExpired([python, *argv], timeout)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess([python, *argv], 1 if failed else 0, out.read(), err.read())


def _wait(workers, deadline) -> bool:
    """Wait for every worker; on the first failure stop the others. Whether one failed."""
    while True:
        codes = [w.poll() for w in workers]
        if any(c not in (None, 0) for c in codes):
            _stop(workers)
            return True
        if all(c == 0 for c in codes):
            return False
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("", 0)
        time.sleep(0.05)


def _stop(workers) -> None:
    """SIGTERM the workers still running (with their children), SIGKILL what is left after GRACE."""
    for sig, wait in ((signal.SIGTERM, GRACE), (signal.SIGKILL, None)):
        for w in workers:
            if w.poll() is None:
                try:
                    os.killpg(w.pid, sig)
                except ProcessLookupError:
                    pass
        end = time.monotonic() + (wait or 10)
        while any(w.poll() is None for w in workers) and time.monotonic() < end:
            time.sleep(0.05)


# -- forked groups -------------------------------------------------------------------------------

PRELOAD = ("numpy", "torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing")

# The zygote: import PRELOAD, then per request (a JSON line on stdin) fork a supervisor that forks
# the workers, waits for them (stopping the rest when one fails, as torchrun does), writes their
# exit codes to the request's status file, and exits. The zygote answers the supervisor's pid.
_ZYGOTE = r"""
import gc, json, os, random, signal, sys, time
for name in sys.argv[1:]:
    __import__(name)
gc.freeze()  # what the imports made is permanent: no collection in a worker walks (or copies) it
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel


def worker(req, rank):
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["envs"][rank])
    for fd, path in ((1, req["out"]), (2, req["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    random.seed()
    import runpy
    if req["argv"][0] == "-m":  # python -m MODULE ARGS: the working folder first on sys.path
        sys.argv = list(req["argv"][1:])
        sys.path[0] = os.getcwd()
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(req["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)  # through the interpreter's own shutdown, as the script's end would


def supervise(req):
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    workers = {}
    for rank in range(len(req["envs"])):
        pid = os.fork()
        if pid == 0:
            worker(req, rank)
        workers[pid] = rank
    codes, kill_at = [None] * len(workers), None
    while workers:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                for other in workers:
                    os.kill(other, signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(0.02)
            continue
        code = codes[workers.pop(pid)] = os.waitstatus_to_exitcode(status)
        if code != 0 and kill_at is None:
            for other in workers:
                os.kill(other, signal.SIGTERM)
            kill_at = time.monotonic() + req["grace"]
    with open(req["status"] + ".tmp", "w") as f:
        json.dump(codes, f)
    os.replace(req["status"] + ".tmp", req["status"])
    os._exit(0)


for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        supervise(req)
    sys.stdout.write(json.dumps({"pid": pid}) + "\n")
    sys.stdout.flush()
"""

_zygotes = {}  # (python, PYTHONPATH) -> Popen


def _zygote(python: str, env: dict) -> subprocess.Popen:
    key = (python, env.get("PYTHONPATH", ""))
    z = _zygotes.get(key)
    if z is None or z.poll() is not None:
        z = subprocess.Popen([python, "-c", _ZYGOTE, *PRELOAD], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        _zygotes[key] = z
    return z


@atexit.register
def _close_zygotes() -> None:
    for z in _zygotes.values():
        if z.poll() is None:
            z.stdin.close()
            z.wait(timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def run_forked(python: str, nproc: int, argv: list, env: dict, cwd, port: int,
               timeout: float) -> subprocess.CompletedProcess:
    """As run_group, the workers forked from the zygote of `python` (see above)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err, status = Path(tmp, "out"), Path(tmp, "err"), Path(tmp, "status.json")
        out.touch(), err.touch()
        request = {"argv": list(argv), "cwd": str(cwd), "out": str(out), "err": str(err),
                   "status": str(status), "grace": GRACE,
                   "envs": [worker_env(env, rank, nproc, port) for rank in range(nproc)]}
        z = _zygote(python, env)
        z.stdin.write(json.dumps(request) + "\n")
        z.stdin.flush()
        answer = z.stdout.readline()
        if not answer:  # the zygote could not start (its imports failed): start the workers afresh
            return run_group(python, nproc, argv, env, cwd, port, timeout)
        supervisor = json.loads(answer)["pid"]
        deadline = time.monotonic() + timeout
        try:
            while not status.exists() and _alive(supervisor):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired([python, *argv], timeout)
                time.sleep(0.05)
        except BaseException:  # a timeout, or the test's own deadline: no worker outlives it
            try:
                os.killpg(supervisor, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise
        # a supervisor killed before its report: every worker counts as failed
        codes = json.loads(status.read_text()) if status.exists() else [-9] * nproc
        return subprocess.CompletedProcess([python, *argv], 1 if any(codes) else 0,
                                           out.read_text(errors="replace"), err.read_text(errors="replace"))
