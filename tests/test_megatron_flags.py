"""Megatron-LM's checkpoint flags and exits in pretrain_gpt_ucp.py (issue 28).

- `--load` of a folder with no checkpoint trains from scratch (and saves there);
  `--exit-on-missing-checkpoint` makes it an error; a tracker naming a broken checkpoint stays one;
- `--no-save-optim`, `--no-save-rng` (the manifest says RNG was not saved: the load reseeds
  without --no-load-rng, while a missing RNG file of a checkpoint saved with it stays an error,
  checked on the interrupted run's checkpoint);
- `--use-checkpoint-args` takes the model's shape from the checkpoint;
- a resume keeps the checkpoint's learning-rate schedule; `--override-opt_param-scheduler`
  takes the command line's (README, "Usage");
- FLOPs so far and skipped iterations are kept across a resume;
- `--exit-signal-handler`: SIGTERM in the middle of a torchrun job saves the last finished
  iteration and exits 0; the resumed run (on another layout) has the uninterrupted run's losses,
  also with an `--async-save` in flight.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import BASE, REPO, free_port, losses, ok, run_steps

from megatron_ucp.engine import ownership
from megatron_ucp.errors import ConfigError
from megatron_ucp.format.inspection import verify
from megatron_ucp.train import progress
from megatron_ucp.mcore.flags import parse_args
from megatron_ucp.train.checkpointing import CHECKPOINT_ARGS, use_checkpoint_args

TP2 = ["--tensor-model-parallel-size", "2"]


def _train(name, extra, iters, fatal=True):
    return {"name": name, "op": "train", "argv": BASE + extra + ["--train-iters", str(iters)],
            "fatal": fatal}


def _manifest(root: Path, iteration: int) -> dict:
    return json.loads((root / f"iter_{iteration:07d}" / "ucp.json").read_text())


def _log(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_checkpoint_flags(tmp_path):
    """One torchrun group of 2 processes, steps in order (each can fail on its own)."""
    fresh, weights, broken = tmp_path / "fresh", tmp_path / "weights", tmp_path / "broken"
    log, timed, fp16 = tmp_path / "resumed.jsonl", tmp_path / "timed", tmp_path / "fp16"
    steps = [
        # an empty --load folder that is also --save: trains from scratch and saves there
        _train("scratch", ["--load", str(fresh), "--save", str(fresh), "--save-interval", "1000"], 3),
        _train("weights", ["--save", str(weights), "--no-save-optim", "--no-save-rng"], 3),
        # no --no-load-rng needed: the manifest says RNG was not saved
        _train("weights_loaded", ["--load", str(weights), "--no-load-optim"], 5, fatal=False),
        # the model's shape comes from the checkpoint, whatever the command line says
        _train("checkpoint_args", ["--load", str(fresh), "--use-checkpoint-args", "--hidden-size", "64",
                                   "--num-layers", "2", "--loss-log", str(log)], 5, fatal=False),
        _train("missing", ["--load", str(tmp_path / "new"), "--exit-on-missing-checkpoint"], 3,
               fatal=False),
        _train("broken", ["--load", str(broken)], 3, fatal=False),
        # fp16 with a loss scale of 2^40: the first updates overflow and are skipped
        _train("overflow", ["--fp16", "--initial-loss-scale", str(2.0 ** 40), "--save", str(fp16)], 3,
               fatal=False),
        # the first iteration takes longer than 6 ms: stop after it, saved
        _train("duration", ["--exit-duration-in-mins", "0.0001", "--save", str(timed),
                            "--save-interval", "1000"], 50, fatal=False),
    ]
    broken.mkdir()
    (broken / "latest_checkpointed_iteration.txt").write_text("3\n")  # names no folder
    results = run_steps(2, steps, tmp_path, allow_failure=True)

    assert sorted(losses(results, "scratch")) == [1, 2, 3]
    assert (fresh / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    m = _manifest(weights, 3)
    assert m["optimizer"] is None and m["scheduler"] is None, "--no-save-optim saved optimizer state"
    assert all(e["states"] == ["param"] for e in m["tensors"].values())
    assert m["rng_saved"] is False and not os.listdir(weights / "iter_0000003" / "rng")
    assert verify(str(weights)) == []  # inspect_checkpoint --verify: no RNG files expected
    assert sorted(losses(results, "weights_loaded")) == [4, 5]
    assert sorted(losses(results, "checkpoint_args")) == [4, 5]

    # FLOPs go on from the checkpoint's count: 5 iterations' worth at iteration 5
    args = parse_args(BASE + ["--train-iters", "5"], world_size=2)
    per_iteration = progress.num_floating_point_operations(args, args.global_batch_size)
    saved = _manifest(fresh, 3)["progress"]
    assert saved["num_floating_point_operations_so_far"] == pytest.approx(3 * per_iteration)
    assert saved["skipped_iterations"] == 0
    last = _log(log)[-1]
    assert last["iteration"] == 5
    assert last["num_floating_point_operations_so_far"] == pytest.approx(5 * per_iteration)

    missing = results["missing"].get("error", "")
    assert "IncompleteCheckpointError" in missing and "--exit-on-missing-checkpoint" in missing, missing
    assert "error" in results["broken"] and "iter_0000003" in results["broken"]["error"]
    ok(results, "overflow")
    assert _manifest(fp16, 3)["progress"]["skipped_iterations"] >= 1
    assert sorted(losses(results, "duration")) == [1]
    assert (timed / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_resume_keeps_the_saved_schedule_unless_overridden(tmp_path):
    """A cosine schedule over 4 iterations, saved at 4, resumed with --train-iters 8: the saved
    schedule has decayed to 0 (it wins, as megatron-core's scheduler does by default); with
    --override-opt_param-scheduler the resumed run follows an 8-iteration schedule from its saved
    step, as an uninterrupted 8-iteration run does."""
    cosine = ["--lr-decay-style", "cosine", "--lr", "5e-3"]
    ckpt = str(tmp_path / "ckpt")
    names = ("first", "kept", "override", "reference")
    argv = {
        "first": (4, ["--save", ckpt, "--save-interval", "4"]),
        "kept": (8, ["--load", ckpt]),
        "override": (8, ["--load", ckpt, "--override-opt_param-scheduler"]),
        "reference": (8, []),
    }
    steps = [_train(n, cosine + argv[n][1] + ["--loss-log", str(tmp_path / f"{n}.jsonl")], argv[n][0])
             for n in names]
    run_steps(1, steps, tmp_path)
    lr = {n: {r["iteration"]: r["lr"] for r in _log(tmp_path / f"{n}.jsonl")} for n in names}
    # "lr" is the rate the iteration's update used, as the trainer's --loss-log writes it: the
    # first update uses the full rate (it was the next one's, decayed, before)
    assert lr["first"][1] == 5e-3 and lr["first"][4] > 0 and sorted(lr["kept"]) == [5, 6, 7, 8]
    assert all(v == 0.0 for v in lr["kept"].values()), lr["kept"]
    assert lr["override"][5] > 0
    assert [lr["override"][i] for i in range(5, 9)] == pytest.approx([lr["reference"][i] for i in range(5, 9)])


@pytest.mark.parametrize("flag", ["--no-save-optim", "--no-save-rng"])
def test_weights_only_flags_need_the_universal_format(flag):
    with pytest.raises(ConfigError, match=flag):
        parse_args(BASE + [flag, "--ckpt-format", "torch_dist"], world_size=1)


def test_use_checkpoint_args_overrides_the_command_line(capsys):
    args = parse_args(BASE + ["--hidden-size", "64", "--train-iters", "2"], world_size=1)
    saved = dict(vars(args), hidden_size=32, num_layers=2, lr=1.0)
    changed = use_checkpoint_args(args, saved, verbose=True)
    assert (args.hidden_size, args.num_layers, args.lr) == (32, 2, 5e-3)  # lr is not architecture
    assert {c[0] for c in changed} == {"hidden_size", "num_layers"}
    assert "--hidden-size 32 from the checkpoint (was 64)" in capsys.readouterr().out
    assert "lr" not in CHECKPOINT_ARGS


def test_flops_formula():
    """Megatron-LM's GPT formula: 12 x batch x seq x layers x h^2 x (attention + MLP + logits)."""
    args = parse_args(BASE + ["--train-iters", "2"], world_size=1)
    b, s, n, h, v = 8, 16, 4, 32, args.padded_vocab_size
    expected = 12 * b * s * n * h * h * ((1 + 1 + s / h) + 4 + v / (2 * n * h))
    assert progress.num_floating_point_operations(args, b) == pytest.approx(expected)


# --- --exit-signal-handler ---------------------------------------------------------------------

def _children(pid: int) -> list:
    """The workers torchrun started (its direct children)."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _start(workdir: Path, extra: list) -> subprocess.Popen:
    """Train 2 processes (DP2) for long, with --exit-signal-handler."""
    workdir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(REPO / "pretrain_gpt_ucp.py"), *BASE, "--train-iters", "3000",
           "--save", str(workdir / "ckpt"), "--exit-signal-handler",
           "--loss-log", str(workdir / "losses.jsonl"), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), UCP_INLINE_HASH_BYTES="1")
    return subprocess.Popen(cmd, env=env, cwd=workdir, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _stop(proc: subprocess.Popen) -> None:
    """A run the test gave up on goes, with its workers (torchrun starts them in sessions of
    their own)."""
    if proc.poll() is None:
        for pid in _children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()


def _interrupt(proc: subprocess.Popen, workdir: Path, signal_workers: bool):
    """SIGTERM after 4 logged iterations (to one worker only: the ranks must agree to stop, or
    to torchrun, which forwards it to all);
    returns (torchrun's exit code, its output, iterations logged)."""
    log = workdir / "losses.jsonl"
    deadline = time.monotonic() + 90
    while len(_log(log)) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    targets = _children(proc.pid)[-1:] if signal_workers else [proc.pid]
    assert proc.poll() is None and targets, f"the run did not get going: {proc.poll()}"
    for pid in targets:
        os.kill(pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=90)
    return proc.returncode, out, [r["iteration"] for r in _log(log)]


def test_sigterm_saves_the_last_iteration_and_the_resumed_run_continues(tmp_path):
    # The two interrupted runs go side by side (time); each is signalled on its own.
    sync_run = _start(tmp_path / "sync", ["--save-interval", "1000"])
    async_run = _start(tmp_path / "async", ["--async-save", "--save-interval", "2"])
    try:
        # SIGTERM to one worker: every rank must stop after the same iteration (the all-reduced flag)
        rc, out, done = _interrupt(sync_run, tmp_path / "sync", True)
        # torchrun's own SIGTERM, forwarded to the workers, while --async-save writes in background
        rc_async, out_async, done_async = _interrupt(async_run, tmp_path / "async", False)
    finally:
        _stop(sync_run)
        _stop(async_run)
    assert rc == 0, f"torchrun exited {rc} (some rank did not exit 0):\n{out[-3000:]}"
    stopped = done[-1]
    assert done == list(range(1, stopped + 1)) and stopped < 3000
    assert "SIGTERM received (--exit-signal-handler): exiting after iteration" in out
    sync_ckpt = tmp_path / "sync" / "ckpt"
    assert (sync_ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)

    stopped_async = done_async[-1]
    async_ckpt = tmp_path / "async" / "ckpt"
    assert f"exiting after iteration {stopped_async}, saving it first" in out_async, out_async[-3000:]
    assert (async_ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped_async)
    # every rank reached the end of training (the release follows a barrier of all ranks)
    assert not (async_ckpt / ownership.OWNER).exists(), out_async[-3000:]
    # torch's launcher re-raises the signal it got itself (launcher/api.py): exit 1, workers 0
    assert rc_async in (0, 1), out_async[-3000:]

    # A missing RNG file of a checkpoint saved with RNG stays an error on the same layout (only
    # "rng_saved": false reseeds without --no-load-rng)
    no_rng = tmp_path / "no_rng"
    shutil.copytree(sync_ckpt, no_rng)
    (no_rng / f"iter_{stopped:07d}" / "rng" / "rank_00001.json").unlink()
    end = max(stopped, stopped_async) + 3
    steps = [
        _train("reference", [], end),
        _train("resumed_tp2", TP2 + ["--load", str(sync_ckpt), "--ckpt-step", str(stopped)], stopped + 3),
        _train("resumed_async", ["--load", str(async_ckpt)], stopped_async + 3),
        _train("rng_missing", ["--load", str(no_rng)], stopped + 1, fatal=False),
    ]
    results = run_steps(2, steps, tmp_path / "resume")
    reference = losses(results, "reference")
    for name, first in (("resumed_tp2", stopped), ("resumed_async", stopped_async)):
        got = losses(results, name)
        assert sorted(got) == list(range(first + 1, first + 4)), (name, sorted(got))
        worst = max(abs(got[i] - reference[i]) for i in got)
        assert worst <= 1e-4, (name, worst)
        print(f"{name}: stopped after iteration {first}, worst |dloss| {worst:.2e}")
    ok(results, "reference")
    error = results["rng_missing"].get("error", "")
    assert "rank_00001.json" in error and "--no-load-rng" in error, results["rng_missing"]


def test_loss_log_read_takes_the_training_lines_of_either_loop(tmp_path):
    """The own loop writes validation lines into --loss-log between the training lines; read()
    (documented for either loop's log) returned KeyError 'loss' on them."""
    from megatron_ucp.megatron_lm import loss_log

    log = tmp_path / "loss.jsonl"
    log.write_text('{"iteration": 1, "loss": 5.0, "lr": 0.1}\n'
                   '{"iteration": 1, "validation_loss": 4.0, "validation_ppl": 54.6}\n'
                   '{"iteration": 2, "loss": 4.5, "lr": 0.1}\n{"iteration": 3, "lo')
    assert loss_log.read(log) == {1: 5.0, 2: 4.5}
