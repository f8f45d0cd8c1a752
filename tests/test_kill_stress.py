"""Stress: SIGKILL saves at random points (slow; run by hand: pytest -m slow tests/test_kill_stress.py).

UCP_STRESS_KILLS sets the number of kills (default 100), UCP_STRESS_FIRST the first seed. Every kill must leave the tracker on
the previous checkpoint, or on a new one that is complete, and the checkpoint it names must
verify; every tenth case also resumes training from it.
"""

import os
import random
import shutil

import pytest

from harness import BASE, losses, ok, run_steps
from megatron_ucp.format.inspection import verify

ARGS = BASE + ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
POINTS = ["create_tensor_file", "write_runs", "block_checksums", "fsync_file", "atomic_write_json",
          "fsync_dir", "atomic_write_bytes"]
KILLS = int(os.environ.get("UCP_STRESS_KILLS", "100"))
FIRST = int(os.environ.get("UCP_STRESS_FIRST", "0"))  # to split a long stress run


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    work = tmp_path_factory.mktemp("stress")
    r = run_steps(2, [{"name": "a", "op": "train",
                       "argv": ARGS + ["--train-iters", "3", "--save", str(work / "good"), "--save-interval", "3"]}],
                  work / "a")
    ok(r, "a")
    return work


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(FIRST, FIRST + KILLS))
def test_random_kill_keeps_a_loadable_checkpoint(good, seed):
    rng = random.Random(seed)
    case = good / f"case{seed}"
    shutil.copytree(good / "good", case / "ckpt")
    point, rank, after = rng.choice(POINTS), rng.randrange(2), rng.randint(1, 12)
    run_steps(2, [{"name": "k", "op": "kill_during_save", "rank": rank, "function": point, "after": after,
                   "argv": ARGS + ["--train-iters", "6", "--load", str(case / "ckpt"), "--save", str(case / "ckpt")]}],
              case / "k", allow_failure=True)
    tracker = int((case / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert tracker in (3, 4), f"{point} rank {rank} call {after}: tracker says {tracker}"
    problems = verify(str(case / "ckpt"))
    assert not problems, f"{point} rank {rank} call {after}: {problems[:3]}"
    if seed % 10 == 0:
        resumed = run_steps(2, [{"name": "b", "op": "train", "argv": ARGS + ["--train-iters", "6", "--load", str(case / "ckpt")]}],
                            case / "b")
        assert sorted(losses(resumed, "b")) == list(range(tracker + 1, 7))
    shutil.rmtree(case)
