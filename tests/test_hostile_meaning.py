"""Hostile meaning (issue 23): checkpoints whose files are well formed but whose content lies.

The manifest is checked as a whole before any tensor is read (iteration against its folder and
the load, complete architecture and layout, typed optimizer and scheduler records); a missing
piece is an error naming the flag that skips it; RNG and tracker content is checked; an error
from a checkpoint is one line per job; the save folder's owner lock is a lock.
"""

import errno
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from harness import BASE, REPO, ok, run_steps
from megatron_ucp.format import folder
from megatron_ucp.format import manifest as mf
from megatron_ucp.engine import ownership
from megatron_ucp.errors import FormatError, LayoutError, SaveError
from test_inspect import ARCHITECTURE, RNG_STATE, _make_checkpoint

# ---------------------------------------------------------------------------------------------
# The manifest, in process, on the synthetic checkpoint of test_inspect (no torch needed).


def _set(*keys, value):
    def edit(m):
        for k in keys[:-1]:
            m = m[k]
        m[keys[-1]] = value
    return edit


def _drop(*keys):
    def edit(m):
        for k in keys[:-1]:
            m = m[k]
        del m[keys[-1]]
    return edit


# name: (edit of the manifest, substrings of the FormatError)
MANIFEST_CASES = {
    "iteration_not_its_folder": (_set("iteration", value=13), ["'iteration' is 13, expected 12", "folder"]),
    "negative_iteration": (_set("iteration", value=-4), ["'iteration' is -4", ">= 0"]),
    "iteration_is_true": (_set("iteration", value=True), ["'iteration' is True"]),
    "negative_consumed_samples": (_set("consumed_samples", value=-8), ["'consumed_samples' is -8"]),
    "empty_architecture": (_set("architecture", value={}), ["'architecture' lacks 'num_layers'"]),
    "architecture_lacks_heads": (_drop("architecture", "num_attention_heads"),
                                 ["'architecture' lacks 'num_attention_heads'"]),
    "heads_as_text": (_set("architecture", "num_attention_heads", value="4"),
                      ["'architecture.num_attention_heads' is '4', expected an integer >= 1"]),
    "flag_as_number": (_set("architecture", "gated_linear_unit", value=1),
                       ["'architecture.gated_linear_unit' is 1, expected true or false"]),
    "bad_moe_pattern": (_set("architecture", "moe_layer_pattern", value=[1, 2]),
                        ["'architecture.moe_layer_pattern'"]),
    "layout_lacks_tp": (_drop("layout", "tensor_model_parallel_size"),
                        ["'layout' lacks 'tensor_model_parallel_size'"]),
    "layout_tp_zero": (_set("layout", "tensor_model_parallel_size", value=0),
                       ["'layout.tensor_model_parallel_size' is 0"]),
    "padded_vocab_text": (_set("layout", "padded_vocab_size", value="16"), ["'layout.padded_vocab_size'"]),
    "optimizer_a_list": (_set("optimizer", value=[1]), ["'optimizer' is list"]),
    "optimizer_sgd": (_set("optimizer", "type", value="sgd"), ["'optimizer.type' is 'sgd', expected 'adam'"]),
    "optimizer_step_text": (_set("optimizer", "step", value="3"), ["'optimizer.step' is '3'"]),
    "optimizer_step_negative": (_set("optimizer", "step", value=-1), ["'optimizer.step' is -1"]),
    "param_groups_not_list": (_set("optimizer", "param_groups", value={"lr": 1}),
                              ["'optimizer.param_groups'", "a list of objects"]),
    "grad_scaler_zero": (_set("optimizer", "grad_scaler", value={"scale": 0.0, "growth_tracker": 0,
                                                                  "hysteresis_tracker": 2}),
                         ["'optimizer.grad_scaler.scale' is 0.0, expected a finite number > 0"]),
    "grad_scaler_text": (_set("optimizer", "grad_scaler", value="big"),
                         ["'optimizer.grad_scaler' lacks 'scale'"]),
    "scheduler_a_number": (_set("scheduler", value=3), ["'scheduler' is int"]),
    "scheduler_empty": (_set("scheduler", value={}), ["'scheduler' lacks 'max_lr'"]),
    "scheduler_steps_text": (_set("scheduler", value={"max_lr": 1e-3, "min_lr": 0.0, "lr_warmup_steps": 0,
                                                      "lr_decay_steps": 8, "lr_decay_style": "cosine",
                                                      "num_steps": "8"}),
                             ["'scheduler.num_steps' is '8', expected an integer >= 0"]),
    "scheduler_nan_lr": (_set("scheduler", value={"max_lr": float("nan"), "min_lr": 0.0, "lr_warmup_steps": 0,
                                                  "lr_decay_steps": 8, "lr_decay_style": "cosine",
                                                  "num_steps": 8}),
                         ["NaN is not a JSON number"]),  # refused by the JSON reader already
    "scheduler_half_wd": (_set("scheduler", value={"max_lr": 1e-3, "min_lr": 0.0, "lr_warmup_steps": 0,
                                                   "lr_decay_steps": 8, "lr_decay_style": "cosine",
                                                   "num_steps": 8, "start_wd": 0.1}),
                          ["'scheduler' lacks 'end_wd'"]),
}
GOOD_SCHEDULER = {"max_lr": 1e-3, "min_lr": 0.0, "lr_warmup_steps": 0, "lr_decay_steps": 8,
                  "lr_decay_style": "cosine", "num_steps": 8, "start_wd": 0.1, "end_wd": 0.1,
                  "wd_incr_steps": 8, "wd_incr_style": "constant"}
OLD_SCHEDULER = {"start_lr": 1e-3, "min_lr": 0.0, "warmup_iter": 0, "end_iter": 8, "decay_style": "linear",
                 "num_iters": 8}  # older Megatron-LM names, which megatron still reads


@pytest.fixture
def synthetic(tmp_path):
    save = tmp_path / "save"
    root = _make_checkpoint(save)
    return save, root


def _edit(root: Path, edit) -> None:
    path = root / mf.MANIFEST
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_manifest_is_checked_as_a_whole(synthetic, case):
    _, root = synthetic
    edit, parts = MANIFEST_CASES[case]
    _edit(root, edit)
    with pytest.raises(FormatError) as e:
        mf.read_manifest(str(root))
    for part in parts + [str(root / mf.MANIFEST)]:
        assert part in str(e.value), (case, str(e.value))


@pytest.mark.parametrize("scheduler", [None, GOOD_SCHEDULER, OLD_SCHEDULER])
def test_good_records_are_accepted(synthetic, scheduler):
    _, root = synthetic
    _edit(root, _set("scheduler", value=scheduler))
    assert mf.read_manifest(str(root)).scheduler == scheduler


def test_a_loss_scaler_after_overflows_is_accepted(synthetic):
    """megatron's DynamicGradScaler counts its hysteresis tracker below 0 while overflows go on."""
    _, root = synthetic
    scaler = {"scale": 262144.0, "growth_tracker": 1, "hysteresis_tracker": -3}
    _edit(root, _set("optimizer", "grad_scaler", value=scaler))
    assert mf.read_manifest(str(root)).optimizer["grad_scaler"] == scaler


def test_a_folder_not_named_iter_is_not_held_to_a_number(synthetic, tmp_path):
    _, root = synthetic
    other = tmp_path / "elsewhere"
    shutil.copytree(root, other)
    assert mf.read_manifest(str(other)).iteration == 12


def test_architecture_compares_every_key():
    """A block lacking a key is a misfit, not a key skipped (4 heads vs 8 of the same QKV shape)."""
    model = dict(ARCHITECTURE, num_attention_heads=8, kv_channels=2)
    saved = {k: v for k, v in ARCHITECTURE.items() if k not in ("num_attention_heads", "kv_channels")}
    with pytest.raises(LayoutError, match=r"num_attention_heads: checkpoint \(none\), model 8"):
        mf.check_architecture(saved, model, "ckpt")
    with pytest.raises(LayoutError, match="num_attention_heads: checkpoint 2, model 8"):
        mf.check_architecture(ARCHITECTURE, model, "ckpt")
    mf.check_architecture(ARCHITECTURE, dict(ARCHITECTURE), "ckpt")


@pytest.mark.parametrize("raw, expected", [(b"12\n", 12), (b" 7 ", 7), (b"0", 0)])
def test_tracker_numbers(raw, expected):
    assert folder.tracker_iteration(raw, "t") == expected


@pytest.mark.parametrize("raw", [b"-4", b"+4", b"4_0", "\u0663".encode(), b"\xff\xfe", b"", b"release",
                                 b"1" * 30])
def test_tracker_refuses_what_names_no_folder(raw):
    with pytest.raises(FormatError, match="tracker.txt: expected an iteration number"):
        folder.tracker_iteration(raw, "tracker.txt")


def _rng(**changes):
    state = json.loads(json.dumps(RNG_STATE))
    state.update(changes)
    return state


@pytest.mark.parametrize("state, key", [
    ([1, 2], ""),
    (_rng(python=[3, [1, 2], None]), "python"),
    (_rng(python=[3, [5] * 624 + [9999], None]), "python"),
    (_rng(numpy=["MT19937", [7] * 623, 624, 0, 0.0]), "numpy"),
    (_rng(numpy=["MT19937", [7] * 624, 624, 0, "x"]), "numpy"),
    (_rng(torch=[1] * 15), "torch"),
    (_rng(torch=[1] * 15 + [256]), "torch"),
    (_rng(torch="abc"), "torch"),
    (_rng(cuda={"a": 1}), "cuda"),
    (_rng(tracker={"other-rng": [2] * 16}), "tracker"),
    (_rng(tracker={"model-parallel-rng": [2] * 8}), "tracker"),
    (_rng(tracker=[1]), "tracker"),
])
def test_rng_content_is_checked(state, key):
    found = mf.rng_problems(state, 16, {"model-parallel-rng": 16})
    assert [p[0] for p in found][:1] == [key], found
    assert f"f.json: {key!r} is" in mf.rng_problem_message("f.json", found[0])


def test_rng_state_as_saved_passes():
    assert mf.rng_problems(RNG_STATE, 16, {"model-parallel-rng": 16}) == []
    assert mf.rng_problems(RNG_STATE) == []


def _inspect(*args):
    return subprocess.run([sys.executable, str(REPO / "tools" / "inspect_checkpoint.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_inspect_reports_bad_records_in_one_line(synthetic):
    save, root = synthetic
    _edit(root, _set("optimizer", value=[1]))
    r = _inspect(save)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.startswith("inspect_checkpoint: error: ") and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "'optimizer' is list" in r.stderr


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"-12"])
def test_inspect_reports_a_bad_tracker(synthetic, raw):
    save, _ = synthetic
    (save / "latest_checkpointed_iteration.txt").write_bytes(raw)
    r = _inspect(save)
    assert r.returncode == 2 and "latest_checkpointed_iteration.txt" in r.stderr, r
    assert "Traceback" not in r.stderr


def test_inspect_verify_lists_bad_rng_content(synthetic):
    save, root = synthetic
    (root / "rng" / "rank_00000.json").write_text(json.dumps(_rng(torch="abc")))
    r = _inspect(save, "--verify")
    assert r.returncode == 1 and "rank_00000.json: 'torch' is" in r.stdout, r


# ---------------------------------------------------------------------------------------------
# A full disk while the manifest is written.


def test_full_disk_on_the_manifest_names_it(tmp_path, monkeypatch):
    from megatron_ucp.format import folder

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(folder, "atomic_write_json", full)
    tmp = folder.begin(str(tmp_path), 3)
    with pytest.raises(OSError) as e:
        folder.commit(str(tmp_path), tmp, 3, {"tensors": {}})
    assert os.path.join(tmp, mf.MANIFEST) in str(e.value) and "No space left on device" in str(e.value)
    assert not (tmp_path / "iter_0000003").exists() and not (tmp_path / folder.TRACKER).exists()


# ---------------------------------------------------------------------------------------------
# The owner lock.


def _claimer(folder, barrier, results):
    ownership._JOB_ID = uuid.uuid4().hex  # each process a job of its own
    barrier.wait()
    try:
        ownership.claim(folder, announce=lambda *a, **k: None)
        results.put("won")
    except SaveError:
        results.put("refused")
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put(f"{type(e).__name__}: {e}")
    barrier.wait()  # the winner stays alive until every process has tried


def test_twenty_processes_claim_one_folder_one_wins(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for round_ in range(3):
        folder = tmp_path / f"save{round_}"
        folder.mkdir()
        barrier, results = ctx.Barrier(20), ctx.Queue()
        procs = [ctx.Process(target=_claimer, args=(str(folder), barrier, results)) for _ in range(20)]
        for p in procs:
            p.start()
        outcomes = sorted(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        assert outcomes == ["refused"] * 19 + ["won"], (round_, outcomes)


def _record(folder: Path, **fields) -> Path:
    path = folder / ownership.OWNER
    record = dict(job="someone-else", host=os.uname().nodename, pid=os.getpid(),
                  start=ownership.process_start(os.getpid()))
    record.update(fields)
    path.write_text(json.dumps(record))
    return path


def _claim(folder: Path) -> list:
    said = []
    ownership.claim(str(folder), announce=lambda line, **k: said.append(line))
    assert json.loads((folder / ownership.OWNER).read_text())["job"] == ownership.job_id()
    return said


def test_live_owner_is_refused_with_the_lock_file_named(tmp_path):
    path = _record(tmp_path)
    with pytest.raises(SaveError) as e:
        ownership.claim(str(tmp_path))
    message = str(e.value)
    assert "another job (someone-else" in message and str(path) in message and f"delete {path}" in message
    assert json.loads(path.read_text())["job"] == "someone-else"


def test_dead_owner_is_taken_over(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    start = ownership.process_start(proc.pid)
    proc.wait()
    _record(tmp_path, pid=proc.pid, start=start)
    said = _claim(tmp_path)
    assert len(said) == 1 and "someone-else" in said[0] and f"process {proc.pid} is gone" in said[0]


def test_reused_pid_is_taken_over(tmp_path):
    """The recorded pid is alive, but it is another process than the one that took the lock."""
    _record(tmp_path, start=ownership.process_start(os.getpid()) - 1000)
    said = _claim(tmp_path)
    assert len(said) == 1 and f"pid {os.getpid()} now belongs to another process" in said[0]


def test_other_hosts_record_is_stale_after_the_window(tmp_path):
    path = _record(tmp_path, host="elsewhere.invalid", pid=12345)
    with pytest.raises(SaveError, match="elsewhere.invalid"):
        ownership.claim(str(tmp_path))
    old = time.time() - 7200
    os.utime(path, (old, old))
    assert "on another host" in _claim(tmp_path)[0]


def test_unreadable_record_is_taken_over(tmp_path):
    (tmp_path / ownership.OWNER).write_bytes(b"\xff{")
    assert "unreadable" in _claim(tmp_path)[0]


def test_same_job_keeps_the_folder_and_releases_it(tmp_path):
    _record(tmp_path, job=ownership.job_id(), pid=1, start=0.0)  # a restarted worker of this job
    assert _claim(tmp_path) == []
    ownership.release(str(tmp_path))
    assert not (tmp_path / ownership.OWNER).exists()
    path = _record(tmp_path)
    ownership.release(str(tmp_path))  # not ours: kept
    assert path.exists()


# ---------------------------------------------------------------------------------------------
# End to end: a real 2-rank checkpoint, damaged in meaning; every rank raises the same error.

ARGS = BASE + ["--train-iters", "2"]


def _copy_edit(good: Path, dest: Path, edit) -> Path:
    shutil.copytree(good, dest)
    edit(dest)
    return dest


def _manifest_edit(fn):
    def edit(ckpt):
        _edit(ckpt / "iter_0000002", fn)
    return edit


def _rng_edit(ckpt):
    path = ckpt / "iter_0000002" / "rng" / "rank_00001.json"
    state = json.loads(path.read_text())
    state["torch"] = state["torch"][:100]
    path.write_text(json.dumps(state))


# name: (damage, extra argv, substrings every rank's error holds; None: it loads)
E2E = {
    "empty_architecture": (_manifest_edit(_set("architecture", value={})), [],
                           ["FormatError", "ucp.json", "'architecture' lacks 'num_layers'"]),
    "iteration_mismatch": (_manifest_edit(_set("iteration", value=5)), [],
                           ["FormatError", "ucp.json", "'iteration' is 5, expected 2"]),
    "no_scheduler": (_manifest_edit(_set("scheduler", value=None)), [],
                     ["IncompleteCheckpointError", "ucp.json", "--no-load-scheduler"]),
    "no_scheduler_skipped": (_manifest_edit(_set("scheduler", value=None)), ["--no-load-scheduler"], None),
    "no_scheduler_no_optim": (_manifest_edit(_set("scheduler", value=None)), ["--no-load-optim"], None),
    "no_optimizer": (_manifest_edit(_set("optimizer", value=None)), [],
                     ["IncompleteCheckpointError", "--no-load-optim"]),
    "no_rng": (lambda c: (c / "iter_0000002" / "rng" / "rank_00001.json").unlink(), [],
               ["IncompleteCheckpointError", "rank_00001.json", "--no-load-rng"]),
    "no_rng_skipped": (lambda c: (c / "iter_0000002" / "rng" / "rank_00001.json").unlink(),
                       ["--no-load-rng"], None),
    "short_rng": (_rng_edit, [], ["FormatError", "rank_00001.json", "'torch' is a list of 100"]),
    "negative_tracker": (lambda c: (c / "latest_checkpointed_iteration.txt").write_text("-2"), [],
                         ["FormatError", "latest_checkpointed_iteration.txt", "found b'-2'"]),
    "binary_tracker": (lambda c: (c / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe2"), [],
                       ["FormatError", "latest_checkpointed_iteration.txt"]),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    work = tmp_path_factory.mktemp("hostile_meaning")
    ckpt = work / "good"
    ok(run_steps(2, [{"name": "a", "op": "train", "argv": ARGS + ["--save", str(ckpt), "--save-interval", "2"]}],
                 work / "a"), "a")
    return work, ckpt


@pytest.fixture(scope="module")
def e2e(good):
    work, ckpt = good
    steps = []
    for name, (damage, extra, _) in E2E.items():
        damaged = _copy_edit(ckpt, work / name, damage)
        steps.append({"name": name, "op": "load_expecting_error", "fatal": False,
                      "argv": ARGS + extra + ["--load", str(damaged), "--train-iters", "3"]})
    return run_steps(2, steps, work / "b")


@pytest.mark.parametrize("case", sorted(E2E))
def test_damaged_meaning_is_the_same_error_on_every_rank(e2e, case):
    r = ok(e2e, case)
    parts = E2E[case][2]
    if parts is None:
        assert r.get("loaded") == 2, f"{case}: {r}"
        return
    assert "raised" in r, f"{case}: loaded without complaint: {r}"
    for rank, message in enumerate(r["raised"]):
        for part in parts:
            assert part in message, f"{case}, rank {rank}: {part!r} not in {message!r}"


def _pretrain(argv, nproc=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    script = [str(REPO / "pretrain_gpt_ucp.py")]
    launcher = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
        "127.0.0.1", "--master-port", str(__import__("harness").free_port())]
    start = time.perf_counter()
    r = subprocess.run(launcher + script + argv, env=env, capture_output=True, text=True, timeout=timeout)
    return r, time.perf_counter() - start


def _error_lines(output: str) -> list:
    return [line for line in output.splitlines() if line.startswith("pretrain_gpt_ucp.py: error:")]


def test_a_failing_resume_is_one_line_no_traceback(good):
    work, ckpt = good
    damaged = _copy_edit(ckpt, work / "one_line", _manifest_edit(_set("architecture", value={})))
    r, _ = _pretrain(ARGS + ["--load", str(damaged), "--train-iters", "3"])
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    lines = _error_lines(out)
    assert len(lines) == 1 and str(damaged / "iter_0000002" / "ucp.json") in lines[0], out[-3000:]
    assert "'architecture' lacks 'num_layers'" in lines[0] and "Traceback" not in out


def test_entry_point_closes_its_process_group_on_success_and_on_error(good, tmp_path):
    """pretrain_gpt_ucp.main destroys the process group before returning, after a run and after
    a one-line error: left to the interpreter's exit, gloo aborts the process now and then
    (SIGABRT, "terminate called without an active exception"), which CI saw as a failed job."""
    work, ckpt = good
    damaged = _copy_edit(ckpt, tmp_path / "damaged", _manifest_edit(_set("architecture", value={})))
    probe = (
        "import sys, torch.distributed as dist\n"
        "sys.argv = ['pretrain_gpt_ucp.py'] + sys.argv[1:]\n"
        "import pretrain_gpt_ucp\n"
        "status = pretrain_gpt_ucp.main()\n"
        "print('status', status, 'initialized after', dist.is_initialized())\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    for argv, status in ((ARGS, 0), (ARGS + ["--load", str(damaged), "--train-iters", "3"], 2)):
        r = subprocess.run([sys.executable, "-c", probe] + argv, env=env, capture_output=True,
                           text=True, timeout=300, cwd=REPO)
        assert f"status {status} initialized after False" in r.stdout, (r.stdout + r.stderr)[-3000:]
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def test_torchrun_job_fails_promptly_with_one_line(good):
    """Every rank raises the error (no rank hangs in a collective); rank 0 prints it once. The
    only traceback is torchrun's own, of its launcher (no frame of megatron_ucp)."""
    work, ckpt = good
    damaged = _copy_edit(ckpt, work / "one_line_2", _manifest_edit(_set("scheduler", value=None)))
    r, seconds = _pretrain(ARGS + ["--load", str(damaged), "--train-iters", "3"], nproc=2)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and seconds < 120, out[-3000:]
    lines = _error_lines(out)
    assert len(lines) == 1 and "ucp.json" in lines[0] and "--no-load-scheduler" in lines[0], out[-3000:]
    assert "megatron_ucp" not in "".join(line for line in out.splitlines() if line.strip().startswith("File "))


def test_lock_is_taken_before_training(good):
    """A job whose --save folder a live job owns stops at start-up: nothing trained, nothing saved."""
    work, _ = good
    folder = work / "owned"
    folder.mkdir()
    path = _record(folder)
    r, _ = _pretrain(ARGS + ["--save", str(folder), "--save-interval", "1", "--log-interval", "1"])
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    lines = _error_lines(out)
    assert len(lines) == 1 and f"delete {path}" in lines[0] and "Traceback" not in out, out[-3000:]
    assert " iteration " not in out and not list(folder.glob("iter_*"))
