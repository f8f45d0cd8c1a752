"""Universal -> megatron-core torch_dist export (megatron_ucp/convert/export_torch_dist.py): a checkpoint
saved on TP2xPP2 with the distributed optimizer, exported to DP4 and TP4 in both optimizer
shardings, continues under megatron's own loader (`--ckpt-format torch_dist --load OUT`) with
the losses of the uninterrupted run. The exports of the matrix run in the test's process group
(tests/runner.py); the command-line tool is run once end to end, to DP2, and on bad input.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import BASE, REPO, losses, max_loss_delta, ok, run_steps, train_step
from megatron_ucp.convert.dcp_reader import read_common
from megatron_ucp.errors import ConfigError, FormatError, IncompleteCheckpointError
from megatron_ucp.convert.export_torch_dist import plan

N, K = 10, 5  # train to N saving at K; the exports resume K
TOL = 1e-4
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
DIST = ["--use-distributed-optimizer"]
TP4 = ["--tensor-model-parallel-size", "4"]
TARGETS = {  # name: (flags after '--', optimizer sharding)
    "dp4_dp_reshardable": (DIST, "dp_reshardable"),
    "dp4_fully_reshardable": (DIST, "fully_reshardable"),
    "tp4_dp_reshardable": (TP4 + DIST, "dp_reshardable"),
    "tp4_fully_reshardable": (TP4 + DIST, "fully_reshardable"),
    "tp4_plain": (TP4, None),  # no distributed optimizer
}


def resume_torch_dist(name, flags, load):
    """pretrain_gpt_ucp.py --ckpt-format torch_dist --load OUT: the tracker's iteration, and the
    sharding the checkpoint records (no --dist-ckpt-optim-format given)."""
    argv = BASE + flags + ["--train-iters", str(N), "--ckpt-format", "torch_dist", "--load", load]
    return {"name": name, "op": "train", "argv": argv}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export_torch_dist")


@pytest.fixture(scope="module")
def w4(work):
    d = lambda name: str(work / name)  # noqa: E731
    steps = [train_step("a_tp2pp2", TP2PP2 + DIST, iters=N, save=d("A"), interval=K)]
    for name, (flags, fmt) in TARGETS.items():
        steps.append({"name": f"e_{name}", "op": "export_torch_dist", "input": d("A"),
                      "iteration": K, "output": d(f"T_{name}"), "argv": flags, "optim_format": fmt})
        steps.append(resume_torch_dist(f"b_{name}", flags, d(f"T_{name}")))
    return run_steps(4, steps, work / "w4")


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_export_continues_under_megatrons_loader(w4, work, name):
    flags, fmt = TARGETS[name]
    ok(w4, f"e_{name}")
    out = work / f"T_{name}"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == f"{K}\n"
    common = read_common(str(out / f"iter_{K:07d}"))  # common.pt, or inside the DCP files (0.19)
    assert common["iteration"] == K and common["consumed_samples"] == K * 8
    assert common["content_metadata"]["distrib_optim_sharding_type"] == (fmt or "dp_reshardable")
    reference, resumed = losses(w4, "a_tp2pp2"), losses(w4, f"b_{name}")
    assert sorted(resumed) == list(range(K + 1, N + 1))
    delta = max_loss_delta(reference, resumed)
    print(f"{name}: max |loss delta| over iterations {K + 1}..{N} = {delta:.2e}")
    assert delta <= TOL


def _tool(*argv, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(REPO / "tools" / "export_torch_dist.py"), *map(str, argv)],
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_tool_end_to_end_to_dp2(w4, work):
    """The command line, given an iter_ folder: its own 2 processes, then a 2-process resume."""
    ok(w4, "a_tp2pp2")
    out = work / "T_dp2"
    proc = _tool(work / "A" / f"iter_{K:07d}", out, "--nproc", "2", "--", *DIST)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "exporting iteration 5" in proc.stdout and "TP1 PP1 DP2" in proc.stdout
    assert f"exported iteration {K} to {out / f'iter_{K:07d}'}" in proc.stdout
    resumed = run_steps(2, [resume_torch_dist("b_dp2", DIST, str(out))], work / "w2")
    delta = max_loss_delta(losses(w4, "a_tp2pp2"), losses(resumed, "b_dp2"))
    print(f"dp2 (tool): max |loss delta| = {delta:.2e}")
    assert delta <= TOL


def test_tool_missing_checkpoint(tmp_path):
    proc = _tool(tmp_path / "nowhere", tmp_path / "out", "--", *DIST)
    assert proc.returncode == 2
    assert f"export_torch_dist: error: {tmp_path / 'nowhere'}: no such checkpoint folder" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, nproc, fmt, error, message", [
    (["--tensor-model-parallel-size", "3"], 3, None, ConfigError,
     r"--tensor-model-parallel-size \(3\) must divide --num-attention-heads \(4\)"),
    (TP4, 6, None, ConfigError, r"world size 6 is not divisible by --tensor-model-parallel-size \(4\)"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, None, ConfigError, "--num-layers"),
    (TP4, None, "fully_reshardable", ConfigError, "give --use-distributed-optimizer"),
    (["--hidden-size", "banana"], None, None, ConfigError, "bad flags after '--'"),
    (DIST + ["--load", "x", "--dist-ckpt-optim-format", "fully_reshardable"], None, None, ConfigError,
     "--load, --dist-ckpt-optim-format after '--': the export loads CKPT and saves OUT itself"),
])
def test_layout_that_does_not_fit(w4, work, extra, nproc, fmt, error, message):
    ok(w4, "a_tp2pp2")
    with pytest.raises(error, match=message):
        plan(str(work / "A"), str(work / "never"), K, extra, nproc, fmt)
    assert not (work / "never").exists()


def test_bad_input_folders(w4, work):
    ok(w4, "e_tp4_plain")
    with pytest.raises(FormatError, match=r"holds a torch_dist checkpoint .*not a universal one"):
        plan(str(work / "T_tp4_plain"), str(work / "never"), None, TP4)
    with pytest.raises(IncompleteCheckpointError, match=r"iter_0000007: no such checkpoint"):
        plan(str(work / "A"), str(work / "never"), 7, TP4)
    with pytest.raises(ConfigError, match=r"iter_0000005: already exists and is not empty"):
        plan(str(work / "A"), str(work / "T_tp4_plain"), K, TP4)
    with pytest.raises(ConfigError, match="contradicts"):
        plan(str(work / "A" / f"iter_{K:07d}"), str(work / "never"), 10, TP4)


@pytest.mark.parametrize("flags", [[], ["--no-store-param-remainders", "--swiglu"]])
def test_carried_arguments_are_the_models_not_the_layout(flags):
    """The checkpoint's model and training flags come back as they were (store_false ones too);
    its layout and folders do not."""
    from megatron_ucp.convert.export_torch_dist import carried_argv
    from megatron_ucp.mcore.flags import build_parser, parse_args

    stored = vars(parse_args(["--cpu", "--mock-data", "--tensor-model-parallel-size", "2", "--save", "x",
                              "--save-interval", "5", "--use-distributed-optimizer", *flags], 2))
    rebuilt = vars(build_parser().parse_args(carried_argv(stored)))
    for name in ("swiglu", "store_param_remainders", "num_layers", "lr", "seed"):
        assert rebuilt[name] == stored[name], name
    assert rebuilt["tensor_model_parallel_size"] == 1 and not rebuilt["use_distributed_optimizer"]
    assert rebuilt["save"] is None and rebuilt["save_interval"] is None
