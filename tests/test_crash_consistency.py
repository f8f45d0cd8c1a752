"""A save killed with SIGKILL midway leaves the previous checkpoint loadable and the tracker on it."""

import json

import pytest

from harness import BASE, losses, run_steps

ARGS = BASE + ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]


@pytest.mark.parametrize("function,rank,after", [
    ("write_runs", 1, 2),  # while the tensor files are being written
    ("atomic_write_json", 0, 1),  # all data written, just before the manifest
])
def test_killed_save_leaves_previous_checkpoint(tmp_path, function, rank, after):
    save = str(tmp_path / "ckpt")
    first = run_steps(2, [{"name": "a", "op": "train",
                           "argv": ARGS + ["--train-iters", "3", "--save", save, "--save-interval", "3"]}],
                      tmp_path / "a")
    assert losses(first, "a")
    killed = run_steps(2, [{"name": "k", "op": "kill_during_save", "rank": rank, "function": function,
                            "after": after, "argv": ARGS + ["--train-iters", "6", "--load", save,
                                                            "--save", save]}],
                       tmp_path / "k", allow_failure=True)
    assert "k" not in killed or "survived" not in killed["k"], "the save was not killed"
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert not (tmp_path / "ckpt" / "iter_0000004").exists()
    json.loads((tmp_path / "ckpt" / "iter_0000003" / "ucp.json").read_text())
    resumed = run_steps(2, [{"name": "b", "op": "train",
                             "argv": ARGS + ["--train-iters", "5", "--load", save]}], tmp_path / "b")
    assert sorted(losses(resumed, "b")) == [4, 5]
