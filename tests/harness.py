"""Helpers for the multi-process tests: launch tests/runner.py in a group of workers (tests/launch.py)
and read results."""

import json
import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import launch
from launch import free_port  # noqa: F401 (tests import it from here)

REPO = Path(__file__).resolve().parents[1]

# A small GPT that trains in well under a second per iteration on 2 CPU cores.
BASE = [
    "--cpu", "--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--vocab-size", "250", "--make-vocab-size-divisible-by", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "5e-3", "--lr-decay-style",
    "constant", "--seed", "7", "--log-interval", "1000",
]


def copy_checkout(dest: Path) -> Path:
    """The checkout's files as a fresh clone has them (tracked and new, not ignored: no venv, no
    build outputs), copied to `dest`, for tests that build or run there instead of in the
    repository."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True)
    if listed.returncode != 0:  # not a git checkout (an unpacked source archive)
        shutil.copytree(REPO, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "*.egg-info", "__pycache__", "runs", ".pytest_cache", ".hypothesis"))
        return dest
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def train_step(name, extra, iters=10, save=None, interval=None, load=None, step=None, universal=True):
    """A runner step that trains BASE + `extra` to `iters`, saving and/or resuming as asked."""
    argv = BASE + extra + ["--train-iters", str(iters)]
    if save:
        argv += ["--save", save, "--save-interval", str(interval)]
    if load:
        argv += ["--load", load, "--ckpt-step", str(step)]
        if universal:
            argv += ["--load-universal"]
    return {"name": name, "op": "train", "argv": argv}


def roundtrip_step(name, extra, load, step, save_to, iters=10, env=None):
    """A runner step that loads `load` at `step` on BASE + `extra` and saves it again to
    `save_to` (with environment variables `env` set for the step)."""
    argv = BASE + extra + ["--train-iters", str(iters), "--load", load, "--ckpt-step", str(step)]
    return {"name": name, "op": "roundtrip", "argv": argv, "save_to": save_to, "env": env or {}}


def run_steps(nproc: int, steps: list, workdir: Path, timeout: int = 900,
              allow_failure: bool = False, python: str = sys.executable) -> dict:
    """Run `steps` in one torchrun group of `nproc` CPU processes; return {name: result}.
    `python`: the interpreter (and so the megatron-core) the group runs with."""
    workdir.mkdir(parents=True, exist_ok=True)
    # UCP_TEST_READ_POLICY=once: every load of the suite reads once over its replica groups
    # (the default, auto, reads per rank on this one node), but where a step names a policy.
    policy = os.environ.get("UCP_TEST_READ_POLICY")
    if policy:
        steps = [dict(s, argv=s["argv"] + ["--ckpt-read-policy", policy])
                 if "argv" in s and "--ckpt-read-policy" not in s["argv"] else s for s in steps]
    spec, result = workdir / "spec.json", workdir / "result.json"
    spec.write_text(json.dumps({"steps": steps}))
    # Every read of these small models is shorter than the inline-hashing threshold: at 1 byte,
    # verified loads hash inline and combine pieces on every layout (fault tests set it back).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), UCP_INLINE_HASH_BYTES="1")
    # a group whose port was taken before rank 0 listened wrote no result: it starts again
    proc = launch.start(python, nproc, [str(REPO / "tests" / "runner.py"), str(spec), str(result)], env, workdir,
                        timeout, lambda: any(workdir.glob("result.json*")))
    results = json.loads(result.read_text()) if result.exists() else {}  # written atomically
    for other in sorted(workdir.glob("result.json.rank*[0-9]")):  # the failing ranks' stories
        for name, r in json.loads(other.read_text()).items():
            if "error" in r and name in results:
                results[name]["error"] += f"\n[{other.suffix}] {r['error']}\n{r['traceback']}"
    if proc.returncode != 0 and not allow_failure and not any("error" in r for r in results.values()):
        raise AssertionError(f"the group failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return results


def ok(results: dict, name: str) -> dict:
    r = results.get(name)
    assert r is not None, f"step {name!r} did not run (an earlier step failed?): {sorted(results)}"
    assert "error" not in r, f"step {name!r} failed: {r['error']}\n{r.get('traceback', '')}"
    return r


def losses(results: dict, name: str) -> dict:
    return {int(k): v for k, v in ok(results, name)["losses"].items()}


def max_loss_delta(reference: dict, resumed: dict) -> float:
    assert resumed, "the resumed run trained no iteration"
    missing = set(resumed) - set(reference)
    assert not missing, f"reference run lacks iterations {sorted(missing)}"
    return max(abs(reference[i] - resumed[i]) for i in resumed)


def atomic_tensors(checkpoint_iter_dir: Path) -> dict:
    """Every tensor of every atomic file of a universal checkpoint, by (atomic name, entry)."""
    from safetensors.numpy import load_file

    out = {}
    for f in sorted((checkpoint_iter_dir / "tensors").glob("*.safetensors")):
        for key, value in load_file(str(f)).items():
            out[(f.name[: -len(".safetensors")], key)] = value
    return out


def assert_same_state(a_dir: Path, b_dir: Path) -> None:
    """Bitwise equality of every atomic tensor (weights and both Adam moments)."""
    a, b = atomic_tensors(a_dir), atomic_tensors(b_dir)
    assert a.keys() == b.keys(), f"tensor sets differ: {sorted(a.keys() ^ b.keys())[:5]}"
    for key in a:
        assert a[key].shape == b[key].shape, f"{key}: {a[key].shape} != {b[key].shape}"
        diff = np.flatnonzero(a[key].view(np.uint32) != b[key].view(np.uint32))
        assert diff.size == 0, f"{key}: {diff.size} elements differ, first at flat index {diff[0]}"


def assert_config_error_names(call, names) -> None:
    """`call()` raises one ConfigError, on one line, that names each of `names`."""
    import pytest

    from megatron_ucp.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message


@contextmanager
def deadline(seconds, what="took"):
    """Fail (instead of hanging or crawling the suite) when the body takes longer than `seconds`:
    a read that blocks on a FIFO, a loader that inflates or builds what it should refuse."""
    def expired(*_):
        raise TimeoutError(f"{what} more than {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
