"""Runs of Megatron-LM's own trainer through the plug-in (`python -m megatron_ucp.megatron_lm
--cpu examples/megatron_lm/pretrain_gpt.py ...`) for the tests, and their losses.

The trainer ships with megatron-core >= 0.17: the interpreter is this one when its megatron-core
has it, else UCP_OTHER_PYTHON's (run.sh points it at the 0.19.2 venv); without either the
tests skip, and with UCP_REQUIRE_OTHER=1 (CI) they fail instead.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import REPO, free_port

SCRIPT = REPO / "examples" / "megatron_lm" / "pretrain_gpt.py"

# A tiny GPT on megatron's mock data, fp32, dropout 0, the local spec (no TE here).
BASE = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "5e-3", "--lr-decay-style", "constant", "--seed", "7", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "250", "--make-vocab-size-divisible-by", "32",
    "--transformer-impl", "local", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--num-workers", "0",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
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
    """{iteration: loss} as Megatron-LM computes it: summed token losses over summed tokens of
    every micro-batch of every data-parallel rank (the script's UCP_LOSS_LOG lines)."""
    sums = {}
    for path in workdir.glob("losses.jsonl.rank*"):
        for line in path.read_text().splitlines():
            if not line.endswith("}"):
                continue  # a line still being written
            r = json.loads(line)
            loss, tokens = sums.get(r["iteration"], (0.0, 0))
            sums[r["iteration"]] = (loss + r["loss"], tokens + r["tokens"])
    return {it: loss / tokens for it, (loss, tokens) in sorted(sums.items())}


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
        kill_after_iteration: int = None, base: list = BASE) -> Run:
    """Train `base` + `extra` to `iters` in `nproc` CPU processes; with `kill_after_iteration`,
    SIGTERM the whole process group once that iteration's loss is logged, as Slurm signals a
    job step (torchrun itself then exits 1, its SignalException; the workers save and exit)."""
    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("losses.jsonl.rank*"):
        old.unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), UCP_INLINE_HASH_BYTES="1",
               UCP_LOSS_LOG=str(workdir / "losses.jsonl"))
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "megatron_ucp.megatron_lm", "--cpu",
           str(SCRIPT)] + base + extra + ["--train-iters", str(iters)]
    if kill_after_iteration is None:
        proc = subprocess.run(cmd, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout)
        return Run(proc.returncode, proc.stdout + proc.stderr, workdir)
    log = open(workdir / "trainer.log", "w")  # a file, not a pipe that fills while we poll
    proc = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
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
