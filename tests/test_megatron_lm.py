"""Universal checkpoints inside Megatron-LM's own trainer (megatron_ucp.megatron_lm): an unchanged
Megatron-LM-style script (examples/megatron_lm/pretrain_gpt.py) trains through the plug-in, saves
universal checkpoints at the trainer's own save points and resumes them on other layouts with
the uninterrupted run's losses (fp32, dropout 0). Needs megatron-core >= 0.17 (mlm_harness)."""

import json
import os

import pytest

from mlm_harness import max_delta, run, trainer_python

N, K = 10, 4  # the reference trains to N, saving every K (iterations 4 and 8, then the final 10)
TOL = 1e-4
UNIVERSAL = ["--ckpt-format", "universal"]
TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
DIST = ["--use-distributed-optimizer"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


@pytest.fixture(scope="module")
def python():
    return trainer_python()


@pytest.fixture(scope="module")
def reference(python, tmp_path_factory):
    """TP2, universal checkpoints written in the background (--async-save) every K iterations."""
    work = tmp_path_factory.mktemp("reference")
    r = run(python, work / "run", 2, TP2 + UNIVERSAL + ["--async-save", "--save", str(work / "ckpt"),
                                                        "--save-interval", str(K)], N).check()
    return {"losses": r.losses(), "ckpt": work / "ckpt", "output": r.output}


def resume(python, reference, tmp_path, nproc, layout, extra=()):
    r = run(python, tmp_path, nproc, layout + UNIVERSAL + ["--load", str(reference["ckpt"]),
                                                          "--ckpt-step", str(K)] + list(extra), N).check()
    return r


def test_reference_saves_universal_checkpoints_at_the_trainers_save_points(reference):
    ckpt = reference["ckpt"]
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000004", "iter_0000008", "iter_0000010"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(N)
    manifest = json.loads((ckpt / "iter_0000004" / "ucp.json").read_text())
    assert manifest["layout"]["tensor_model_parallel_size"] == 2
    assert manifest["consumed_samples"] == K * 8
    assert manifest["progress"]["num_floating_point_operations_so_far"] > 0
    assert sorted(reference["losses"]) == list(range(1, N + 1))


@pytest.mark.parametrize("name,nproc,layout", [
    ("pp2", 2, PP2),
    ("dp2_dist", 2, DIST),  # 2 processes, no TP: data-parallel 2
    ("tp2pp2", 4, TP2 + PP2),
])
def test_resume_on_another_layout(python, reference, tmp_path, name, nproc, layout):
    r = resume(python, reference, tmp_path, nproc, layout)
    assert f"successfully loaded universal checkpoint from {reference['ckpt']} at iteration {K}" in r.output
    delta = max_delta(reference["losses"], r.losses(), range(K + 1, N + 1))
    assert min(r.losses()) == K + 1, "the resumed run starts after the checkpoint's iteration"
    assert delta <= TOL, f"{name}: max |dloss| {delta:.3g}"


def test_resume_with_another_padded_vocabulary(python, reference, tmp_path):
    """--make-vocab-size-divisible-by 100 pads 250 to 300; the checkpoint's 256 rows are kept
    (padding rows take part in the softmax) and the loss continues."""
    r = resume(python, reference, tmp_path, 2, PP2, ["--make-vocab-size-divisible-by", "100"])
    assert "keeping the checkpoint's padded vocabulary of 256 rows (instead of 300)" in r.output
    assert max_delta(reference["losses"], r.losses(), range(K + 1, N + 1)) <= TOL


def test_sigterm_with_exit_signal_handler_saves_and_resumes(python, reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    cut = run(python, tmp_path / "cut", 2, TP2 + UNIVERSAL + ["--exit-signal-handler", "--save", str(ckpt),
                                                              "--save-interval", "1000"], N,
              kill_after_iteration=3)
    assert "exiting program after receiving SIGTERM" in cut.output, cut.output[-4000:]
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < N and f"successfully saved universal checkpoint from iteration {saved:7d}" in cut.output
    r = run(python, tmp_path / "resume", 2, PP2 + UNIVERSAL + ["--load", str(ckpt)], N).check()
    assert min(r.losses()) == saved + 1
    assert max_delta(reference["losses"], r.losses(), range(saved + 1, N + 1)) <= TOL


def test_finetune_loads_the_weights_and_starts_over(python, reference, tmp_path):
    """--finetune: the weights only, iteration 0 and no consumed samples, on any layout: the
    saving layout and another train alike from the loaded weights."""
    same = resume(python, reference, tmp_path / "tp2", 2, TP2, ["--finetune"])
    other = resume(python, reference, tmp_path / "pp2", 2, PP2, ["--finetune"])
    assert sorted(same.losses()) == sorted(other.losses()) == list(range(1, N + 1))
    assert max_delta(same.losses(), other.losses(), range(1, N + 1)) <= TOL
    # The loaded weights, not fresh ones: the first loss is that of a model trained K iterations.
    assert same.losses()[1] < reference["losses"][1] - 0.05


def test_a_torch_dist_job_switches_to_universal(python, reference, tmp_path):
    """A job on Megatron-LM's own torch_dist checkpoints (distributed optimizer) continues with
    --ckpt-format universal: its next checkpoint is universal and resumes on another layout."""
    ckpt = tmp_path / "ckpt"
    # --exit-interval: the same --train-iters throughout (megatron's scheduler checks it on load).
    run(python, tmp_path / "a", 2, TP2 + DIST + ["--ckpt-format", "torch_dist", "--save", str(ckpt),
                                                     "--save-interval", str(K), "--exit-interval", str(K)], N).check()
    b = run(python, tmp_path / "b", 2, TP2 + DIST + UNIVERSAL + ["--load", str(ckpt), "--save", str(ckpt),
                                                          "--save-interval", str(K),
                                                          "--exit-interval", str(2 * K)], N).check()
    assert (ckpt / f"iter_{2 * K:07d}" / "ucp.json").exists()
    assert not (ckpt / f"iter_{K:07d}" / "ucp.json").exists()
    c = run(python, tmp_path / "c", 2, PP2 + UNIVERSAL + ["--load", str(ckpt)], N).check()
    losses = {**b.losses(), **c.losses()}
    assert max_delta(reference["losses"], losses, range(K + 1, N + 1)) <= TOL


def test_moe_resumes_from_ep2_on_ep1(python, tmp_path):
    ckpt = tmp_path / "ckpt"
    ref = run(python, tmp_path / "ref", 2, MOE + ["--expert-model-parallel-size", "2"] + UNIVERSAL
              + ["--save", str(ckpt), "--save-interval", str(K)], N).check()
    r = run(python, tmp_path / "ep1", 2, MOE + DIST + UNIVERSAL + ["--load", str(ckpt),
                                                                      "--ckpt-step", str(K)], N).check()
    assert max_delta(ref.losses(), r.losses(), range(K + 1, N + 1)) <= TOL
