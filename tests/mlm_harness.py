"""Runs of Megatron-LM's own trainer through the plug-in for the tests, and their losses:
`pretrain_gpt_ucp.py --cpu ...` (on megatron-core >= 0.17 the trainer with the project's GPT
script), or `python -m megatron_ucp.megatron_lm --cpu SCRIPT ...` for a script of a user's.

The trainer ships with megatron-core >= 0.17: the interpreter is this one when its megatron-core
has it, else UCP_OTHER_PYTHON's (run.sh points it at the 0.19.2 venv); without either the
tests skip, and with UCP_REQUIRE_OTHER=1 (CI) they fail instead.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launch
from harness import REPO, free_port
from megatron_ucp.megatron_lm import loss_log

ENTRY = REPO / "pretrain_gpt_ucp.py"
GPT_SCRIPT = REPO / "megatron_ucp" / "megatron_lm" / "gpt.py"  # run as a user's script is

# A tiny GPT on megatron's mock data, fp32, dropout 0; --cpu takes the local spec and no fused
# kernels by default (megatron_lm/flags.py).
BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "5e-3", "--lr-decay-style", "constant", "--seed", "7", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "250", "--make-vocab-size-divisible-by", "32",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0",
]
CORE_CHECK = "from megatron_ucp.mcore.compat import core_version; print(core_version() >= (0, 17))"


def trainer_python() -> str:
    """An interpreter whose megatron-core ships Megatron-LM's trainer."""
    candidates = [sys.executable] + [p for p in [os.environ.get("UCP_OTHER_PYTHON")] if p]
    for python in candidates:
        proc = subprocess.run([python, "-c", CORE_CHECK], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
        if proc.returncode == 0 and proc.stdout.strip().endswith("True"):
            return python
    message = ("no megatron-core >= 0.17 (Megatron-LM's trainer): run under UCP_CORE=0.19, or set "
               "UCP_OTHER_PYTHON (`UCP_CORE=0.19 bash run.sh setup` then `bash run.sh test`)")
    if os.environ.get("UCP_REQUIRE_OTHER") == "1":
        pytest.fail(f"UCP_REQUIRE_OTHER=1 but {message}")
    pytest.skip(message)


def read_losses(workdir: Path) -> dict:
    """{iteration: loss} as Megatron-LM computes it (the trainer's --loss-log)."""
    path = workdir / "loss.jsonl"
    return loss_log.read(path) if path.exists() else {}


class Run:
    """One torchrun group of the trainer: its exit code, output and per-iteration losses."""

    def __init__(self, returncode: int, output: str, workdir: Path):
        self.returncode, self.output, self.workdir = returncode, output, workdir

    def losses(self) -> dict:
        return read_losses(self.workdir)

    def check(self):
        assert self.returncode == 0, f"trainer failed ({self.returncode}):\n{self.output[-8000:]}"
        return self


def run(python: str, workdir: Path, nproc: int, extra: list, iters: int, timeout: int = 600,
        kill_after_iteration: int = None, base: list = BASE, as_script: bool = False,
        hosts: list = None, kill_when=None, path: tuple = ()) -> Run:
    """Train `base` + `extra` to `iters` in `nproc` CPU processes with pretrain_gpt_ucp.py (or,
    `as_script`, the GPT script through `python -m megatron_ucp.megatron_lm`); with
    `kill_after_iteration`, SIGTERM the whole process group once that iteration's loss is
    logged, as Slurm signals a job step (torchrun itself then exits 1, its SignalException;
    the workers save and exit); with `kill_when` (a test of the losses so far), SIGKILL torchrun
    and its workers once it holds (a lost node). `hosts`: the host name each rank pretends
    (tests/pretend_host.py). `path`: folders after the repository on PYTHONPATH (a Megatron-LM
    clone's trainer beside an earlier wheel)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "loss.jsonl").unlink(missing_ok=True)
    # NVTE_*: megatron's argument validation sets them in the process that ran it (an earlier
    # in-process test), and a trainer started with them refuses another --attention-backend
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), *map(str, path)]),
               UCP_INLINE_HASH_BYTES="1")
    entry = ["-m", "megatron_ucp.megatron_lm", "--cpu", str(GPT_SCRIPT)] if as_script else [str(ENTRY), "--cpu"]
    if hosts:
        assert len(hosts) == nproc and not as_script
        entry = [str(REPO / "tests" / "pretend_host.py")] + entry
        env["UCP_TEST_HOSTS"] = ",".join(hosts)
    argv = entry + base + extra + ["--train-iters", str(iters), "--loss-log", str(workdir / "loss.jsonl")]
    if kill_when is not None:
        from elastic_harness import kill_node

        kill_after_iteration = -1
    if kill_after_iteration is None:  # no signal to forward: the workers without torchrun's agent
        # forked from the interpreter's warm zygote; a group that logged no loss may start again
        proc = launch.start(python, nproc, argv, env, workdir, timeout, lambda: bool(read_losses(workdir)))
        return Run(proc.returncode, proc.stdout + proc.stderr, workdir)
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), *argv]
    log = open(workdir / "trainer.log", "w")  # a file, not a pipe that fills while we poll
    proc = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if kill_when is not None and kill_when(read_losses(workdir)):
            kill_node(proc)
            break
        if kill_after_iteration in read_losses(workdir):
            os.killpg(proc.pid, signal.SIGTERM)
            break
        time.sleep(0.2)
    proc.wait(timeout=max(1, deadline - time.time()))
    log.close()
    return Run(proc.returncode, (workdir / "trainer.log").read_text(), workdir)


def max_delta(reference: dict, resumed: dict, iterations) -> float:
    missing = [i for i in iterations if i not in reference or i not in resumed]
    assert not missing, f"iterations {missing} missing (reference {sorted(reference)}, resumed {sorted(resumed)})"
    return max(abs(reference[i] - resumed[i]) for i in iterations)
